"""`--dtype auto` and a recipe's `precision: auto`: the floating-point type that computes fastest here.

bf16 halves the bytes of every weight, and where the hardware multiplies bf16 fast (a GPU, a CPU
with AMX, most CPUs with AVX512-BF16) it is the fast choice. Not everywhere: a CPU without bf16
units multiplies it far slower than float32, and one with AVX512-BF16 but no AMX can run a
512-row bf16 product slower than float32 while a one-row product, which only streams the weights,
is faster in bf16 (docs/benchmarks.md, "Machines"). Which type wins depends on the machine and on
the work, so `auto` measures rather than guesses: once per process, per device and kind of work, it
times the same products in both types. For bulk work it takes bf16 unless float32 is clearly faster
(`FLOAT32_MARGIN`); for decoding, float32 unless bf16 is clearly faster (`BF16_MARGIN`): a bf16 target
decodes another text than the float32 one (the eval table flags it, with the measured agreement),
which only a real speedup pays for.

Two kinds of work, timed differently:

- `bulk` (extraction, training): hundreds of rows through each weight, so the arithmetic decides.
  Timed: one 512-row product.
- `decode` (eval, tune, regenerate, and label extraction, whose labels stand for decoding's
  decisions): one to a few dozen rows through every weight of the model, so reading the weights
  decides. Timed: a 1-row and an 8-row product through ~85 MB of weights (more than a core's
  cache), on the prepacked weights the runtime decodes with.

On a GPU `auto` is bf16 where the GPU supports it, else float32; elsewhere bf16. A choice is
printed, and handed to the processes this one starts (Lightning's DDP ranks, `extract --devices`)
through the environment (`DRAFTSMITH_DTYPE_<DEVICE>_<WORK>`), so that they agree with it.
"""

from __future__ import annotations

import os
import sys
import time
from functools import cache
from typing import Any, Literal

Work = Literal["bulk", "decode"]

FLOAT32_MARGIN = 1.15  # bulk work: float32 must run this many times faster than bf16 to be chosen
BF16_MARGIN = 1.15  # decoding: bf16 must run this many times faster than float32 to be chosen
WEIGHT_SHAPE = (1536, 576)  # outputs, inputs: one MLP projection of SmolLM2
BULK_ROWS = 512  # a 512-token batch through it
DECODE_ROWS = (1, 8)
DECODE_WEIGHTS = 48  # that many weights: 85 MB in bf16
GIVE_UP = 4.0  # a timed bf16 call this many times slower than float32's settles it without more timing


def device_type(device: Any) -> str:
    """"cpu", "cuda", ... for "cuda:1", a torch.device, or a Lightning accelerator name ("gpu", "auto")."""
    import torch

    name = str(getattr(device, "type", device)).split(":")[0].lower()
    if name == "gpu":
        return "cuda"
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def resolve_dtype(dtype: str, device: Any = "cpu", work: Work = "decode", recorded: str | None = None) -> str:
    """`dtype` itself, or for "auto" the type that runs `work` fastest on `device`: "bfloat16" or "float32".

    `recorded` is the type an interrupted run already used (a feature or label directory being
    resumed): "auto" keeps it, so a resumed run never mixes types."""
    if dtype != "auto":
        return dtype
    if recorded is not None:
        return recorded
    return _choose(device_type(device), work)


def resolve_precision(precision: Any, accelerator: Any = "auto") -> Any:
    """A Lightning precision: `precision` itself, or for "auto" "bf16-mixed" / "32-true" by `resolve_dtype`."""
    if precision != "auto":
        return precision
    return "bf16-mixed" if _choose(device_type(accelerator), "bulk") == "bfloat16" else "32-true"


@cache
def _choose(device: str, work: Work) -> str:
    import torch

    inherited = os.environ.get(env_name(device, work))
    if inherited in ("bfloat16", "float32"):
        return inherited
    if device == "cuda":
        choice = "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
        reason = "the GPU " + ("supports" if choice == "bfloat16" else "does not support") + " bf16"
    elif device != "cpu":
        choice, reason = "bfloat16", f"the default on {device}"
    else:
        speed = bf16_speed(work)
        choice = "bfloat16" if prefers_bf16(speed, work) else "float32"
        what = "a 512-row product" if work == "bulk" else "a decoding step's products"
        reason = f"in bf16 {what} ran at {speed:.2f}x float32's speed on this CPU"
    print(f"dtype auto: {choice} for {'training and extraction' if work == 'bulk' else 'decoding'} ({reason})",
          file=sys.stderr)
    os.environ[env_name(device, work)] = choice
    return choice


def prefers_bf16(speed: float, work: Work) -> bool:
    """Whether `auto` takes bf16 for `work` on a CPU where it runs at `speed` times float32's speed."""
    return speed >= BF16_MARGIN if work == "decode" else speed * FLOAT32_MARGIN >= 1


def env_name(device: str, work: Work) -> str:
    return f"DRAFTSMITH_DTYPE_{device}_{work}".upper()


def bf16_speed(work: Work) -> float:
    """bf16's speed on this CPU relative to float32's for `work` (> 1: bf16 is faster)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    if work == "bulk":
        x = torch.randn(BULK_ROWS, WEIGHT_SHAPE[1], generator=generator)
        w = torch.randn(*WEIGHT_SHAPE, generator=generator)
        runs = {dtype: _bulk_run(x.to(dtype), w.to(dtype)) for dtype in (torch.float32, torch.bfloat16)}
    else:
        w = [torch.randn(*WEIGHT_SHAPE, generator=generator) for _ in range(DECODE_WEIGHTS)]
        runs = {dtype: _decode_run([m.to(dtype) for m in w]) for dtype in (torch.float32, torch.bfloat16)}
    float32 = _time(runs[torch.float32])
    return float32 / _time(runs[torch.bfloat16], against=float32)


def _bulk_run(x: Any, w: Any) -> Any:
    import torch

    return lambda: torch.nn.functional.linear(x, w)


def _decode_run(weights: list[Any]) -> Any:
    """One pass of 1 row and one of 8 rows through every weight, on the runtime's packed weights when it packs."""
    import torch

    from draftsmith.models.packing import pack, packable, packed_linear

    dtype = weights[0].dtype
    xs = [torch.ones(rows, weights[0].shape[1], dtype=dtype) for rows in DECODE_ROWS]
    if packable(weights[0]):
        packed = [pack(w) for w in weights]
        return lambda: [packed_linear(x, p, None) for x in xs for p in packed]
    return lambda: [torch.nn.functional.linear(x, w) for x in xs for w in weights]


def _time(run: Any, against: float | None = None, repeats: int = 3) -> float:
    """The fastest of `repeats` timed calls after an untimed one (the first call of a kernel also
    generates it); a call `GIVE_UP` times slower than `against` ends the timing (a type the CPU has
    no fast kernels for can take a second a call)."""
    import torch

    with torch.no_grad():
        run()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - start)
            if against is not None and best > GIVE_UP * against:
                break
    return best
