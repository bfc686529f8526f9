"""Linear layers with prepacked weights, for the few rows a decoding step multiplies on a CPU.

At batch 1 a decoding step multiplies 1 to a few dozen rows by every weight matrix of the model,
so its time is the time it takes to stream the weights from memory. `F.linear` hands the CPU
BLAS a weight in PyTorch's layout, and for so few rows the BLAS spends much of its time
reordering that weight into the blocked layout its kernels read, on every call. oneDNN can
reorder a weight once (`mkldnn._reorder_linear_weight`, what inductor does to a frozen model's
weights) and then run `mkldnn._linear_pointwise` on the blocked copy: the product then costs
about the weight read, and verifying a dozen rows costs about what one row does (figures:
docs/runtime.md, "What a round costs").

`PackedLinears` switches the model's own `nn.Linear` modules to their packed copies for the
duration of one call and restores them after, so the model is not changed and training never
sees it. A copy is packed the first time it is needed and packed again when its weight has been
written since (an optimizer step, `load_state_dict`), so a drafter validated while it trains is
never run with stale weights. The copies cost memory: one more copy of every linear weight.

The result equals `F.linear` up to floating-point summation order. Where oneDNN cannot pack a
weight (no oneDNN in this build, a dtype it has no kernel for on this CPU, a GPU tensor),
`F.linear` runs as before.
"""

from __future__ import annotations

from functools import partial, wraps
from typing import Any, Callable

import torch
from torch import nn

ROWS_HINT = 16  # the row count oneDNN tunes the blocked layout for; any count runs on it


def packable(weight: torch.Tensor) -> bool:
    """Whether oneDNN can pack this weight here."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight.dtype == torch.float32


def pack(weight: torch.Tensor, rows_hint: int = ROWS_HINT) -> torch.Tensor:
    """oneDNN's blocked copy of an (O, I) weight."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) on pack(weight); x (..., I) → (..., O)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _forward(module: nn.Linear, packed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() or torch.is_autocast_enabled("cpu") or x.dtype != packed.dtype or x.device.type != "cpu":
        return nn.functional.linear(x, module.weight, module.bias)
    return packed_linear(x, packed, module.bias)


class PackedLinears:
    """`with PackedLinears(model, ...):` every plain `nn.Linear` of the modules that oneDNN can
    pack computes on its packed copy; nested uses are fine (the outermost one switches).

    Off (a no-op) when `enabled` is False. Grad mode and autocast always get `F.linear` itself."""

    def __init__(self, *modules: nn.Module, enabled: bool = True):
        linears = [m for module in modules for m in module.modules() if type(m) is nn.Linear]
        self.linears = [m for m in linears if packable(m.weight)] if enabled else []
        self.copies: dict[nn.Linear, tuple[tuple[int, int], torch.Tensor]] = {}
        self.depth = 0

    def packed(self, module: nn.Linear) -> torch.Tensor:
        """The module's packed weight, packed again if the weight was written since."""
        version = (module.weight._version, module.weight.data_ptr())
        copy = self.copies.get(module)
        if copy is None or copy[0] != version:
            with torch.no_grad():
                copy = self.copies[module] = (version, pack(module.weight))
        return copy[1]

    def __enter__(self) -> "PackedLinears":
        if self.depth == 0:
            for m in self.linears:
                m.forward = partial(_forward, m, self.packed(m))
        self.depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self.depth -= 1
        if self.depth == 0:
            for m in self.linears:
                del m.forward


def under_packed_linears(method: Callable) -> Callable:
    """Run a method with its object's `linears` (a PackedLinears) switched on."""

    @wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self.linears:
            return method(self, *args, **kwargs)

    return run
