"""The pieces of a round's timing that `round_cost.py` and the other cost benchmarks share: random-weight
targets of public shapes, a fresh EAGLE-3 drafter of a target's shape, the device's copy bandwidth, the
matrix products of a forward alone and the floor they set, and a profile of a call by category."""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from harness import median_ms, synchronize


RANDOM_TARGETS = {  # shapes of public checkpoints, built with random weights (nothing is downloaded)
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                         tie_word_embeddings=False, rms_norm_eps=1e-5),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                         tie_word_embeddings=True, rms_norm_eps=1e-5),  # the embedded default's shape
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                         tie_word_embeddings=True, rms_norm_eps=1e-5),
}


def random_target(name: str, dtype: torch.dtype, device: str, layers: int | None):
    """A random-weight Llama of a named shape, built on the device, as the few attributes this script reads."""
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM

    shape = RANDOM_TARGETS.get(name)
    if shape is None:
        raise SystemExit(f"unknown random target {name!r}; known: {sorted(RANDOM_TARGETS)}")
    config = LlamaConfig(**{**shape, **({"num_hidden_layers": layers} if layers else {})})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(default)
    return SimpleNamespace(model=model, config=config, decoder=model.get_decoder(), embed_tokens=model.get_input_embeddings(),
                           lm_head=model.get_output_embeddings(), vocab_size=config.vocab_size,
                           hidden_size=config.hidden_size, dtype=dtype, num_layers=config.num_hidden_layers)


def step_bytes(model) -> int:
    """Bytes of weights one decoding step reads: all of them but the input embedding's unread rows."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return total if embed is head else total - embed.numel() * embed.element_size()


def copy_bandwidth(device: str, gib: float = 4.0) -> float:
    """GB/s of a large device-to-device copy, bytes read plus bytes written (median of 10)."""
    src = torch.randn(int(gib * 2**30) // 4, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), 10)
    return 2 * src.numel() * 4 / ms / 1e6


CATEGORIES = {  # ATen / oneDNN op name → part of a round
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "mkldnn::_linear_pointwise"),
    "attention": ("aten::_scaled_dot_product", "aten::scaled_dot_product", "aten::_softmax"),
    "kv cache": ("aten::cat", "aten::index_select", "aten::index_copy", "aten::copy_", "aten::clone"),
}


GPU_CATEGORIES = {  # substrings of CUDA kernel names → part of a round's GPU time
    "gpu matmul": ("gemv", "gemm", "nvjet", "cutlass", "cublas"),
    "gpu attention": ("fmha", "attention", "flash", "softmax"),
    "gpu copies": ("copy", "index", "cat", "memcpy", "memset", "fill"),
}


def linears_ms(linears: list[torch.nn.Module], packed, rows: int, repeats: int) -> float:
    """Milliseconds to run every one of `linears` (a model's linear layers, its decoder's and its head)
    once on `rows` rows, one after another as in a forward, the way the runtime runs them (`packed`, their
    PackedLinears: packed weights on a CPU): the matrix products of a forward over `rows` tokens alone."""
    weight = linears[0].weight
    inputs = {n: torch.randn(1, rows, n, dtype=weight.dtype, device=weight.device)
              for n in {m.in_features for m in linears}}

    def run():
        with packed:
            for m in linears:
                m(inputs[m.in_features])

    with torch.no_grad():
        return median_ms(run, repeats)


def profile_ms(fn, repeats: int) -> dict[str, float]:
    """Milliseconds per call of `fn` by category (self time of the ops), plus the wall time no op accounts for.
    On a GPU also its kernels' time by category (kernels replayed from CUDA graphs included) and in all."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    fn()
    synchronize()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        synchronize()
        wall = (time.perf_counter() - start) * 1e3 / repeats
    parts: dict[str, float] = defaultdict(float)
    gpu: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        if event.device_type == DeviceType.CUDA:
            name = event.key.lower()
            category = next((c for c, names in GPU_CATEGORIES.items() if any(n in name for n in names)), "gpu other")
            gpu[category] += event.self_device_time_total / 1e3 / repeats
            continue
        category = next((c for c, names in CATEGORIES.items() if event.key.startswith(names)), "other ops")
        parts[category] += event.self_cpu_time_total / 1e3 / repeats
    parts["python & framework"] = max(0.0, wall - sum(parts.values()))
    parts["wall"] = wall
    if gpu:
        parts.update(gpu)
        parts["gpu busy"] = sum(gpu.values())
    return dict(parts)


def fresh_eagle3(target, layer_ids: list[int], draft_vocab: int):
    from draftsmith.models.eagle3 import Eagle3Drafter

    torch.manual_seed(0)
    norm = getattr(target.decoder, "norm", None)
    device = target.embed_tokens.weight.device
    with torch.device(device):
        drafter = Eagle3Drafter(target.config, target.embed_tokens.weight.detach(), target.lm_head.weight.detach(),
                                norm.weight if norm is not None else None, torch.arange(draft_vocab), len(layer_ids),
                                target.hidden_size)
    return drafter.to(dtype=target.dtype)



def shape_key(name: str) -> str:
    """A shape's name as a RESULT key: "tree 4,4,12" → "tree4_4_12"."""
    return name.replace(" ", "").replace(",", "_")


def floor_keys(model, timed: dict, repeats: int) -> list[str]:
    """`floor_<shape>` for every shape the first arm timed: its verification's cost in steps if only its
    matrix products grew with its rows (against that arm's AR step), and the rate of those products."""
    from draftsmith.runtime.kernels import PackedLinears

    if not timed:
        return []
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    packed = PackedLinears(model)  # packs each weight once, at the first timed call
    rows = next(iter(timed.values()))
    ar = rows[0][3]
    counts = sorted({1} | {n + 1 for _, n, _, _ in rows[1:]})  # a verification's rows: the last token, n drafted
    ms = {n: float("inf") for n in counts}
    for _ in range(3):  # interleaved passes, the least median of each: the floor, as little noise in it as may be
        for n in counts:
            ms[n] = min(ms[n], linears_ms(linears, packed, n, repeats))
    params = sum(m.weight.numel() for m in linears)
    print("matrix products alone, ms: " + ", ".join(f"{n} rows {t:.2f}" for n, t in ms.items()))
    keys = [f"matmul_ms_1row={ms[1]:.2f}"]
    for name, n, _, _ in rows[1:]:
        keys.append(f"floor_{shape_key(name)}={1 + (ms[n + 1] - ms[1]) / ar:.3f}")
    most = counts[-1]
    if most > 1 and ms[most] > 1.1 * ms[1]:  # a rate only where the extra rows cost measurably (not on a GPU)
        keys.append(f"matmul_gflops={2 * params * (most - 1) / (ms[most] - ms[1]) / 1e6:.0f}")
    return keys
