"""Linear layers on oneDNN's prepacked weights: the product a CPU decoding step spends its time in.

oneDNN can reorder a weight once into the blocked layout its kernels read
(`mkldnn._reorder_linear_weight`) and then run `mkldnn._linear_pointwise` on the blocked copy, so a
product of a few rows costs about the weight read. `runtime/kernels.py` switches a model's linears
onto these copies while it decodes; `models/precision.py` times them to choose a dtype.
"""

from __future__ import annotations

import torch

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


# The same product as an operator torch.compile can trace (`TargetRunner(compile="cached")`). Inductor lowers
# mkldnn's op only for weights it froze into the graph itself, and a frozen graph is never stored in its
# caches; this operator is opaque to it instead: the packed weight stays an input of the graph and the call
# runs the kernel above, so the compiled graph can be cached and reloaded by a later process. Defined with
# torch.library's low-level API, which adds less Python per call than a `custom_op` (docs/runtime.md).
_LIBRARY = torch.library.Library("draftsmith", "DEF")
_LIBRARY.define("packed_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor")
_LIBRARY.impl("packed_linear", lambda x, packed, bias, out_features: packed_linear(x, packed, bias),
              "CompositeExplicitAutograd")


@torch.library.register_fake("draftsmith::packed_linear")
def _packed_linear_shape(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)
