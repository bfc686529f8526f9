"""The two kernels a decoding step spends its time in, laid out for the few rows it computes:
linear layers on prepacked weights (a CPU), and grouped-query attention with the query heads
that share a key head folded into rows (`DecodeAttention`, below).

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
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from draftsmith.models.common import additive_mask, grouped_query_sdpa
from draftsmith.models.packing import pack, packable, packed_linear
from draftsmith.models.switches import AttentionSwitch, Switch

MIN_PACKED_SIZE = 1 << 16  # weights per linear from which packing pays on the CPUs measured


def _forward(module: nn.Linear, packed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() or torch.is_autocast_enabled("cpu") or x.dtype != packed.dtype or x.device.type != "cpu":
        return nn.functional.linear(x, module.weight, module.bias)
    if torch.compiler.is_compiling():
        return torch.ops.draftsmith.packed_linear(x, packed, module.bias, module.out_features)
    return packed_linear(x, packed, module.bias)


class PackedLinears(Switch):
    """`with PackedLinears(model, ...):` every plain `nn.Linear` of the modules that oneDNN can
    pack and that holds at least `min_size` weights computes on its packed copy; nested uses are
    fine (the outermost one switches). oneDNN's call costs more than `F.linear`'s, which a small
    weight's product does not win back (`benchmarks/packed_linear.py` measures where it does).

    Off (a no-op) when `enabled` is False. Grad mode and autocast always get `F.linear` itself."""

    def __init__(self, *modules: nn.Module, enabled: bool = True, min_size: int | None = None):
        least = MIN_PACKED_SIZE if min_size is None else min_size
        linears = [m for module in modules for m in module.modules() if type(m) is nn.Linear]
        self.linears = [m for m in linears if m.weight.numel() >= least and packable(m.weight)] if enabled else []
        self.forwards: dict[nn.Linear, tuple[tuple[int, int], Callable]] = {}

    def forward_of(self, module: nn.Linear) -> Callable:
        """The module's forward on its packed weight, packed again if the weight was written since."""
        weight = module._parameters["weight"]
        version = (weight._version, weight.data_ptr())
        entry = self.forwards.get(module)
        if entry is None or entry[0] != version:
            with torch.no_grad():
                entry = self.forwards[module] = (version, partial(_forward, module, pack(weight)))
        return entry[1]

    # an instance attribute, as `m.forward = ...` makes it, without nn.Module's __setattr__ (this
    # runs for every linear of the model at every forward)
    def on(self) -> None:
        for m in self.linears:
            m.__dict__["forward"] = self.forward_of(m)

    def off(self) -> None:
        for m in self.linears:
            del m.__dict__["forward"]


def under_packed_linears(method: Callable) -> Callable:
    """Run a method with its object's `linears` (a PackedLinears) switched on."""

    @wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self.linears:
            return method(self, *args, **kwargs)

    return run


# Attention ------------------------------------------------------------------------------------------
#
# With grouped-query attention, transformers' SDPA path hands torch a query of H heads and keys of
# H/g heads with `enable_gqa` whenever it has no mask, which is every one-token decoding step. On a
# CPU, torch's bf16 kernel runs one query row per head poorly (several times what the same attention
# costs in fp32). The g query heads that share a key head can instead be folded into g rows of one
# head: the same attention, computed as H/g heads of g·R rows each, which the kernel runs well. A
# mask shared by all heads is repeated per folded row.

DECODE_ATTENTION = "draftsmith_decode"
FOLD_MAX_ROWS = 8  # from here on torch's own grouped-query mode costs the same as folding


class _LayerMask:
    """One forward's mask as SDPA takes it, built once for all the layers: every layer gets the same
    boolean mask object, and torch would turn it into an additive one (and a folded one into rows) in
    each layer. Keyed by that object and its version, so a buffer written in place is built again.

    Not kept while torch.compile traces (the graph fuses the conversion itself), for inference tensors
    (no version counter), or while a CUDA graph is captured: a runner with graphs captures right after an eager
    warm-up on the same, unchanged mask buffer, and a kept mask would leave the build out of the graph,
    so every replay would read the warm-up's mask."""

    source: tuple[torch.Tensor, int, tuple] | None = None
    built: torch.Tensor | None = None

    @classmethod
    def get(cls, mask: torch.Tensor, groups: int, columns: int, dtype: torch.dtype) -> torch.Tensor:
        """`mask` (B, 1, R, ≥ columns) as an additive mask (B, 1, groups·R, columns), row r of group j at j·R + r."""
        if torch.compiler.is_compiling() or mask.is_inference() or _capturing(mask):
            return cls.build(mask, groups, columns, dtype)
        key = (groups, columns, dtype)
        if cls.source is None or cls.source[0] is not mask or cls.source[1:] != (mask._version, key):
            cls.source, cls.built = (mask, mask._version, key), cls.build(mask, groups, columns, dtype)
        return cls.built

    @staticmethod
    def build(mask: torch.Tensor, groups: int, columns: int, dtype: torch.dtype) -> torch.Tensor:
        mask = mask[..., :columns]
        if groups > 1:
            mask = _fold_rows(mask, groups)
        return additive_mask(mask, dtype)


def _fold_rows(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """A mask (B, 1, R, S) for the folded query: (B, 1, g·R, S), row r of group j at j·R + r."""
    batch, _, rows, columns = mask.shape
    return mask[:, :, None].expand(batch, 1, groups, rows, columns).reshape(batch, 1, groups * rows, columns)


def _capturing(tensor: torch.Tensor) -> bool:
    """Whether a CUDA graph is being recorded on the current stream of this tensor's GPU."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def decode_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention (same arguments, same result) with the query heads that share a
    key/value head folded into rows when a few rows attend; otherwise torch's grouped-query mode."""
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, rows, dim = query.shape
    plain = dropout == 0.0 and all(kwargs.get(k) is None for k in ("softcap", "position_bias", "s_aux"))
    if attention_mask is None:
        foldable = rows == 1 and query.dtype != torch.float32  # one fp32 row: torch's own kernel runs it well
    else:
        # one mask for every head; on a GPU folding also spares the copy of K/V per query head that
        # transformers makes under a mask (torch's masked grouped-query mode leaves the fused kernels there)
        foldable = attention_mask.shape[1] == 1 and (rows <= FOLD_MAX_ROWS or query.is_cuda)
    boolean = attention_mask is not None and attention_mask.dtype == torch.bool
    if groups > 1 and plain and not foldable and attention_mask is not None:
        # torch's grouped-query mode under the mask, called directly: transformers reaches it only through an
        # environment switch (grouped_query_sdpa), which torch.compile cannot trace (a tree forward broke into
        # a graph per layer and ran slower compiled than eager)
        columns = key.shape[-2]
        mask = _LayerMask.get(attention_mask, 1, columns, query.dtype) if boolean else attention_mask[..., :columns]
        out = nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    if groups == 1 or not plain or not foldable:
        with grouped_query_sdpa(groups > 1 and attention_mask is not None):
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    folded = query.reshape(batch, heads // groups, groups * rows, dim)
    mask = attention_mask
    if boolean:  # (B, 1, R, S) → (B, 1, g·R, S), row order as in the folded query
        mask = _LayerMask.get(mask, groups, mask.shape[-1], query.dtype)
    elif mask is not None:
        mask = _fold_rows(mask, groups)
    out = nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, rows, dim).transpose(1, 2).contiguous(), None


class DecodeAttention(AttentionSwitch):
    """`with DecodeAttention(model, ...):` the modules' SDPA attention runs as `decode_attention`
    (their configs name it for the duration of the call); nested uses are fine. Off when `enabled`
    is False or no config of the modules uses transformers' SDPA attention."""

    def __init__(self, *modules: nn.Module, enabled: bool = True):
        super().__init__(DECODE_ATTENTION, decode_attention, *modules, enabled=enabled)
