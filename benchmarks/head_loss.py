"""The drafter's head loss, element-wise work in cache-sized rows against one pass per chunk, one run.

`head_logsumexp` (train/head_kernel.py) computes logsumexp(x Wᵀ) over the vocabulary a chunk of rows at a
time and recomputes the logits in the backward. Within a chunk, its float conversion, exp and
reductions run `cache_rows` rows at a time (as many as `CACHE_FLOATS` floats hold); a budget of
chunk × V floats is the former one-pass-per-chunk code. This script times forward + backward both
ways, alternating, in one process, under bf16 autocast as training runs, for the heads of the embedded-default recipes: hass-cpu's full
49,152-token head and hass-cpu-full's 8,192-token draft head (hidden 576, `--rows` loss positions,
about one batch of 2,048 tokens), and checks that both ways give bit-identical values and gradients.
Then, when the hass-cpu recipe's features are there (`--features`), whole training steps of that
recipe's module (forward and backward over `--batches` real batches, alternating) both ways.

    python benchmarks/head_loss.py [--rows 1440] [--repeats 10] [--features DIR] [--batches 6]

Ends with `RESULT identical=... ratio_<V>=<one pass / cache rows> ... ratio_step=...`.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from draftsmith.train import head_kernel as losses

from harness import parser, print_result


def fwd_bwd(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, cache_floats: int) -> tuple[torch.Tensor, ...]:
    losses.CACHE_FLOATS = cache_floats
    x = x.detach().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lse = losses.head_logsumexp(x, weight)
    lse.backward(grad)
    return lse.detach(), x.grad


def alternate(ways: dict, fn, repeats: int) -> dict[str, float]:
    """Median seconds of fn(value) per way, the ways alternating in order and in reverse."""
    times = {name: [] for name in ways}
    for r in range(repeats):
        for name in (ways if r % 2 == 0 else reversed(ways)):
            start = time.perf_counter()
            fn(ways[name])
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def training_steps(features: str, batches: int, repeats: int) -> float:
    """hass-cpu's module, forward + backward on real batches: one pass per chunk ÷ cache rows."""
    import yaml

    from draftsmith.data.modules import FeatureDataModule
    from draftsmith.train.drafter import DrafterModule

    recipe = yaml.safe_load(open(Path(__file__).parents[1] / "recipes/smollm2-135m/hass-cpu.yaml"))
    module = DrafterModule(**recipe["model"]["init_args"])
    module.configure_model()
    data = FeatureDataModule(**{**recipe["data"]["init_args"], "features_dir": features})
    data.setup("fit")
    loader = iter(data.train_dataloader())
    chosen = [next(loader) for _ in range(batches)]

    def steps(cache_floats: int) -> None:
        losses.CACHE_FLOATS = cache_floats
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for batch in chosen:
                module.alignment_forward(batch, with_metrics=False)["loss"].backward()

    default, vocab = losses.CACHE_FLOATS, module.drafter.lm_head.weight.shape[0]
    ways = {"cache rows": default, "one pass": losses.HEAD_CHUNK * vocab}
    steps(default)  # warm-up
    sec = alternate(ways, steps, repeats)
    losses.CACHE_FLOATS = default
    per = {name: s / batches for name, s in sec.items()}
    print(f"hass-cpu training step (V={vocab}, {batches} batches): cache rows {per['cache rows']:.2f} s, "
          f"one pass per chunk {per['one pass']:.2f} s, ratio {per['one pass'] / per['cache rows']:.2f}")
    return per["one pass"] / per["cache rows"]


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--rows", type=int, default=1440)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--vocabs", type=int, nargs="+", default=[49152, 8192])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--features", default="runs/smollm2-135m/features-sharegpt-800")
    ap.add_argument("--batches", type=int, default=6)
    args = ap.parse_args()
    default, chunk = losses.CACHE_FLOATS, losses.HEAD_CHUNK
    torch.manual_seed(0)
    results, identical = {}, True
    for vocab in args.vocabs:
        x = torch.randn(args.rows, args.hidden)
        weight = torch.randn(vocab, args.hidden) * args.hidden ** -0.5 * 4
        grad = torch.rand(args.rows)
        ways = {"cache rows": default, "one pass": chunk * vocab}
        outs = {name: fwd_bwd(x, weight, grad, floats) for name, floats in ways.items()}  # also the warm-up
        same = all(torch.equal(a, b) for a, b in zip(outs["cache rows"], outs["one pass"]))
        identical &= same
        sec = alternate(ways, lambda floats: fwd_bwd(x, weight, grad, floats), args.repeats)
        ms = {name: s * 1e3 for name, s in sec.items()}
        results[vocab] = ms["one pass"] / ms["cache rows"]
        losses.CACHE_FLOATS = default
        rows = losses.cache_rows(len(weight), weight.device)
        print(f"V={vocab:6d}: {rows} rows at a time {ms['cache rows']:7.1f} ms, one pass per "
              f"chunk of {chunk} {ms['one pass']:7.1f} ms, ratio {results[vocab]:.2f}, bit-identical {same}")
    keys = {f"ratio_{v}": f"{r:.3f}" for v, r in results.items()}
    if any(Path(args.features).glob("*.safetensors")):
        keys["ratio_step"] = f"{training_steps(args.features, args.batches, 3):.3f}"
    else:
        print(f"no feature shards in {args.features}: the training-step comparison is skipped (see hass-cpu.yaml)")
    print_result(f"identical={str(identical).lower()} " + " ".join(f"{k}={v}" for k, v in keys.items()))


if __name__ == "__main__":
    main()
