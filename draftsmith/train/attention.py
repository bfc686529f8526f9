"""Training-time-test attention without its dense mask.

`models.common.alignment_mask` spells out what a query of alignment step j sees: the step-0 keys at
positions s ≤ t, and the keys of its own chain's steps 1..j at its anchor t. As a boolean mask over the
T + j·T keys it costs a masked attention's T × (j+1)·T scores, on a CPU as much time as the draft layer's
products. `alignment_attention` runs the same attention as one causal flash attention over the step-0 keys
plus j diagonal scores, merged by their log-sum-exps (`MergedAttention`); its backward pass runs the flash
kernel's own backward against the merged output and log-sum-exp, which are those of the whole softmax, and
adds the diagonal keys' terms. At real anchors the output is the dense mask's within rounding; after a
row's real tokens (right padding) a query sees padding keys the dense mask hides, and carries no loss.

`with AlignmentAttention(drafter):` the drafter's SDPA attention runs as `alignment_attention`, which takes
a `StepMask` the fast way (on a CPU, rows padded on the right, no dropout) and anything else, a `StepMask`
made dense included, through transformers' SDPA attention.

Notation: B batch, h query heads, T anchors, d head dim, j the alignment step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.models.common import alignment_mask
from draftsmith.models.switches import AttentionSwitch

ALIGNMENT_ATTENTION = "draftsmith_alignment"


class StepMask(NamedTuple):
    """Alignment step `step`'s attention over every anchor, valid (B, T) the real tokens: what
    `alignment_mask(valid, step)` spells out densely."""

    valid: torch.Tensor
    step: int

    def dense(self) -> torch.Tensor:
        return alignment_mask(self.valid, self.step)

    def right_padded(self) -> bool:
        """Whether each row's real tokens come first (`data.modules.pad_collate`'s batches)."""
        v = self.valid
        return bool((v[:, 1:] <= v[:, :-1]).all())


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class MergedAttention(torch.autograd.Function):
    """softmax attention of q (B, h, T, d) over causal keys k0/v0 (B, h, T, d) and, for each query, its own
    j keys kd/vd (B, h, j, T, d) at the same position; scale the scores' factor. CPU flash kernels."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, kd: torch.Tensor, vd: torch.Tensor,
                scale: float) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            o0, lse0 = _flash(q, k0, v0, 0.0, True, scale=scale)  # (B, h, T, d), (B, h, T)
            diag = (q.float()[:, :, None] * kd.float()).sum(-1) * scale  # (B, h, j, T)
            lse = torch.logaddexp(lse0, torch.logsumexp(diag, 2))
            p = torch.exp(diag - lse[:, :, None])
            out = torch.exp(lse0 - lse)[..., None] * o0.float() + (p[..., None] * vd.float()).sum(2)
            out = out.to(q.dtype)
        ctx.save_for_backward(q, k0, v0, kd, vd, out, lse, p)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k0, v0, kd, vd, out, lse, p = ctx.saved_tensors
        with torch.autocast("cpu", enabled=False):
            grad = grad.to(q.dtype).contiguous()
            # the flash backward rebuilds the causal probabilities as exp(s − lse) with the whole softmax's lse
            # and takes D = Σ dO·O from the merged output: exactly the full attention's gradients for k0, v0
            dq, dk0, dv0 = _flash_backward(grad, q, k0, v0, out, lse, 0.0, True, scale=ctx.scale)
            g = grad.float()
            delta = (g * out.float()).sum(-1)  # (B, h, T)
            dvd = p[..., None] * g[:, :, None]  # (B, h, j, T, d)
            ds = p * ((g[:, :, None] * vd.float()).sum(-1) - delta[:, :, None]) * ctx.scale
            dq = dq.float() + (ds[..., None] * kd.float()).sum(2)
            dkd = ds[..., None] * q.float()[:, :, None]
        return dq.to(q.dtype), dk0, dv0, dkd.to(kd.dtype), dvd.to(vd.dtype), None


def merged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, step: int,
                     scale: float) -> torch.Tensor:
    """Step `step`'s attention, query (B, h, T, d) over key/value (B, kv, (step+1)·T, d) as the step-0 block
    followed by one block a step: (B, h, T, d)."""
    b, h, t, d = query.shape
    groups = h // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    if step == 0:
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale)
    own = (b, h, step, t, d)
    kd = key[:, :, t:].reshape(own)
    vd = value[:, :, t:].reshape(own)
    return MergedAttention.apply(query, key[:, :, :t], value[:, :, :t], kd, vd, scale)


def alignment_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                        **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention (same arguments, same result at real anchors), a `StepMask` run as
    `merged_attention` where it can be."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if isinstance(attention_mask, StepMask):
        mask = attention_mask
        t = query.shape[2]
        plain = dropout == 0.0 and all(kwargs.get(k) is None for k in ("softcap", "position_bias", "s_aux"))
        if (plain and query.device.type == "cpu" and key.shape[2] == (mask.step + 1) * t
                and mask.valid.shape[1] == t and mask.right_padded()):
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            out = merged_attention(query, key, value, mask.step, scale)
            return out.transpose(1, 2).contiguous(), None
        attention_mask = mask.dense()
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


class AlignmentAttention(AttentionSwitch):
    """`with AlignmentAttention(drafter):` the drafter's SDPA attention runs as `alignment_attention` (its
    config names it for the duration); nested uses are fine."""

    def __init__(self, module: nn.Module):
        super().__init__(ALIGNMENT_ATTENTION, alignment_attention, module)
