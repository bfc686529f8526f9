"""Pure loss functions. Each takes a boolean `mask` over positions and averages over it.

Notation: B batch, T positions, H hidden, V vocab. p is the target distribution, q the drafter's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _masked_mean(per_position: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(per_position.dtype)
    return (per_position * mask).sum() / mask.sum().clamp_min(1.0)


def feature_regression(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """EAGLE's smooth-L1 regression of the next feature: mean over H, then over masked positions."""
    per_position = F.smooth_l1_loss(pred.float(), target.float(), reduction="none").mean(-1)  # (B, T)
    return _masked_mean(per_position, mask)


def soft_cross_entropy(logits: torch.Tensor, p: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """-Σ_v p(v) log q(v), q = softmax(logits): EAGLE's classification loss."""
    per_position = -(p.float() * F.log_softmax(logits.float(), dim=-1)).sum(-1)  # (B, T)
    return _masked_mean(per_position, mask)


def topk_distillation(logits: torch.Tensor, p: torch.Tensor, k: int, mask: torch.Tensor) -> torch.Tensor:
    """HASS Top-K loss: -Σ_{x ∈ top-K of p} p(x) log q(x) (HASS eq. 5)."""
    top_p, top_idx = p.float().topk(k, dim=-1)  # (B, T, K)
    log_q = F.log_softmax(logits.float(), dim=-1).gather(-1, top_idx)
    return _masked_mean(-(top_p * log_q).sum(-1), mask)


def forward_kl(logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor, top_k: int | None = None) -> torch.Tensor:
    """KL(p || q) = Σ p (log p - log q); with `top_k`, p is restricted to its top-K and renormalized."""
    log_q = F.log_softmax(logits.float(), dim=-1)
    if top_k is None:
        log_p = F.log_softmax(target_logits.float(), dim=-1)
        per_position = (log_p.exp() * (log_p - log_q)).sum(-1)
    else:
        top_logits, top_idx = target_logits.float().topk(top_k, dim=-1)
        log_p = F.log_softmax(top_logits, dim=-1)
        per_position = (log_p.exp() * (log_p - log_q.gather(-1, top_idx))).sum(-1)
    return _masked_mean(per_position, mask)


def uniform_noise(features: torch.Tensor, scale: float) -> torch.Tensor:
    """EAGLE's feature noise: add U(-scale/2, scale/2) to every coordinate."""
    if scale <= 0:
        return features
    return features + (torch.rand_like(features) - 0.5) * scale


def step_weights(num_steps: int, decay: float) -> list[float]:
    """Per-step weights w_j = decay^j, j = 0..num_steps-1 (HASS weights later steps less)."""
    return [decay**j for j in range(num_steps)]
