"""Linear layers for the few rows a decoding step multiplies, on a CPU.

At batch 1 a decoding step multiplies 1 to ~32 rows by every weight matrix of the model, and the
time is the time it takes to stream the weights from memory. `torch.nn.functional.linear`
computes x·Wᵀ; for a few rows the CPU BLAS takes that as a general matrix product with a
transposed weight, which it first repacks (reads and writes the whole weight once more), and for
one row it takes a matrix-vector path that streams the weight at a fraction of the memory
bandwidth. Computing the same product the other way round, (W·xᵀ)ᵀ, with x contiguous, keeps
the weight in its stored layout and the small operand is the one that gets packed (one row is
padded to two, so that the matrix-vector path is not taken). Above eight rows the product is
compute-bound on a CPU without bf16 units, and oneDNN's linear (the kernel inductor calls) on
the weight as stored is the fastest of the three. `benchmarks/round_cost.py` times both ways side by side (figures: docs/benchmarks.md).

The result equals `F.linear` up to floating-point summation order. The switch is made per
forward by `SkinnyLinears`, on the model's own `nn.Linear` modules (their forward is replaced for
the duration of one call and restored after), so the model is not changed and training never
sees it.

Notation: R rows (tokens), I in-features, O out-features.
"""

from __future__ import annotations

from functools import partial, wraps
from typing import Any, Callable

import torch
from torch import nn

MAX_ROWS = 64  # beyond this the ordinary GEMM path is as good (a prefill is never skinny)


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """oneDNN's linear on the weight as stored (what inductor calls on a CPU); None where this
    torch build lacks it."""
    global _ONEDNN
    if _ONEDNN:
        try:
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        except (AttributeError, RuntimeError, NotImplementedError):
            _ONEDNN = False
    return None


_ONEDNN = torch.backends.mkldnn.is_available()
SWAPPED_MAX_ROWS = 8  # above this oneDNN's kernels do better than the swapped product


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x (..., I) with few rows; (..., O)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows == 0 or rows > MAX_ROWS or torch.is_grad_enabled():
        return nn.functional.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1]).contiguous()
    out = _onednn_linear(flat, weight, bias) if rows > SWAPPED_MAX_ROWS else None
    if out is None:
        if rows == 1:
            flat = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])
        out = torch.mm(weight, flat.t()).t()[:rows].contiguous()  # (R, O)
        if bias is not None:
            out += bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return skinny_linear(x, module.weight, module.bias)


class SkinnyLinears:
    """`with SkinnyLinears(model, ...):` every plain `nn.Linear` of the modules computes as
    `skinny_linear`; nested uses are fine (the outermost one switches).

    Off (a no-op) when `enabled` is False or the modules are not on a CPU (GPU BLAS libraries pick
    good kernels for skinny products themselves)."""

    def __init__(self, *modules: nn.Module, enabled: bool = True):
        linears = [m for module in modules for m in module.modules() if type(m) is nn.Linear]
        on_cpu = all(m.weight.device.type == "cpu" for m in linears)
        self.linears = linears if enabled and on_cpu else []
        self.depth = 0

    def __enter__(self) -> "SkinnyLinears":
        if self.depth == 0:
            for m in self.linears:
                m.forward = partial(_forward, m)
        self.depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self.depth -= 1
        if self.depth == 0:
            for m in self.linears:
                del m.forward


def under_skinny_linears(method: Callable) -> Callable:
    """Run a method with its object's `skinny` (a SkinnyLinears) switched on."""

    @wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self.skinny:
            return method(self, *args, **kwargs)

    return run
