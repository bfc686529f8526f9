"""Target distributions π = T(q, p) for generalized verification (runtime/verify.py).

- exact: π = p, lossless speculative decoding;
- mixture: π = (1 − δ)·q + δ·p with a deferral weight δ per position: speculative cascades
  (Narasimhan et al. 2024, arXiv:2405.19261) with the rules below, or lossy decoding with a
  constant δ. Its rejection rate is δ·TV(p, q), so δ = 1 is exact decoding and δ = 0 returns
  the drafter's own samples;
- token_specific: π(x) = q(x)·keep(x) + p(x)·Σ_{y not kept} q(y), the token-level cascade.

Deferral rules read the raw (unscaled) distributions; the mixture uses the scaled ones.
Notation: (..., V) distributions; δ (...,).
"""

from __future__ import annotations

import torch


def exact(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return p


def mixture(q: torch.Tensor, p: torch.Tensor, defer: torch.Tensor | float) -> torch.Tensor:
    defer = torch.as_tensor(defer, dtype=q.dtype, device=q.device)
    if defer.dim():
        defer = defer[..., None]
    return (1 - defer) * q + defer * p


def total_variation(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return 0.5 * (p - q).abs().sum(-1)


def chow(q_raw: torch.Tensor, p_raw: torch.Tensor, alpha: float) -> torch.Tensor:
    """Defer to the target when the drafter is unsure: max q < 1 − α."""
    return (q_raw.max(-1).values < 1 - alpha).float()


def diff(q_raw: torch.Tensor, p_raw: torch.Tensor, alpha: float) -> torch.Tensor:
    """Defer when the target is more confident by a margin: max q < max p − α."""
    return (q_raw.max(-1).values < p_raw.max(-1).values - alpha).float()


def opt(q_raw: torch.Tensor, p_raw: torch.Tensor, alpha: float) -> torch.Tensor:
    """The cost-aware rule: max q < max p − α·TV(p, q)."""
    return (q_raw.max(-1).values < p_raw.max(-1).values - alpha * total_variation(p_raw, q_raw)).float()


def token_keep(q_raw: torch.Tensor, p_raw: torch.Tensor, alpha: float) -> torch.Tensor:
    """Token-level Diff rule: keep the drafter's x when q(x) >= max p − α, (..., V) in {0, 1}."""
    return (q_raw >= p_raw.max(-1, keepdim=True).values - alpha).float()


def token_specific(q: torch.Tensor, p: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    deferred_mass = (q * (1 - keep)).sum(-1, keepdim=True)
    return q * keep + p * deferred_mass
