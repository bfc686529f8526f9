"""Pure loss functions, as the papers write them. Each takes a boolean `mask` over positions and
averages over it. The chunked logsumexp over a large head lives in `head_kernel.py`.

Notation: B batch, T positions, H hidden, V vocab. p is the target distribution, q the drafter's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith.train.head_kernel import blocks, cache_rows, head_logsumexp, matmul_dtype


def loss_tokens(batch: dict) -> int:
    """Real assistant tokens in a batch: the weight Lightning gives its logged per-token losses."""
    return int((batch["loss_mask"].bool() & batch["attention_mask"].bool()).sum())


def _masked_mean(per_position: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(per_position.dtype)
    return (per_position * mask).sum() / mask.sum().clamp_min(1.0)


def feature_regression(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """EAGLE's smooth-L1 regression of the next feature: mean over H, then over masked positions."""
    per_position = F.smooth_l1_loss(pred.float(), target.float(), reduction="none").mean(-1)  # (B, T)
    return _masked_mean(per_position, mask)


def weighted_mean(per_position: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Σ w·l / Σ w over positions (block drafters weight each slot by its place in the block)."""
    return (per_position * weight).sum() / weight.sum().clamp_min(1e-12)


def soft_cross_entropy_per_position(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """-Σ_v p(v) log q(v) at every position, q = softmax(logits), computed as logsumexp(z)·Σp − Σ p·z,
    which never materializes log q over the vocabulary."""
    z = logits.float()
    return torch.logsumexp(z, -1) * p.sum(-1) - (p * z).sum(-1)


def soft_cross_entropy(logits: torch.Tensor, p: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """-Σ_v p(v) log q(v), q = softmax(logits): EAGLE's classification loss, averaged over `mask`."""
    return _masked_mean(soft_cross_entropy_per_position(logits, p), mask)


def topk_distillation(logits: torch.Tensor, p: torch.Tensor, k: int, mask: torch.Tensor) -> torch.Tensor:
    """HASS Top-K loss: -Σ_{x ∈ top-K of p} p(x) log q(x) (HASS eq. 5), as lse(z)·Σ_K p − Σ_K p·z."""
    z = logits.float()
    top_p, top_idx = p.float().topk(k, dim=-1)  # (B, T, K)
    per_position = torch.logsumexp(z, -1) * top_p.sum(-1) - (top_p * z.gather(-1, top_idx)).sum(-1)
    return _masked_mean(per_position, mask)


def sharpen(p: torch.Tensor, temperature: float) -> torch.Tensor:
    """p^(1/T) renormalised over the last dim: the target law at temperature T relative to p's own
    (softmax(z)'s is softmax(z/T)). T < 1 moves the distillation target's mass onto its top tokens, the ones
    greedy verification accepts; T = 1 returns p itself."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if temperature == 1.0:
        return p
    return torch.softmax(p.float().log() / temperature, dim=-1).to(p.dtype)


def target_mix(p: torch.Tensor, weight: torch.Tensor, ce_weight: float, topk_weight: float, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target side of `head_distillation` for ce_weight·soft CE + topk_weight·Top-K.

    p (M, V) target distributions, weight (V, H) the drafter's head. Returns mass (M,) =
    Σ_j w_j Σ_{v∈S_j} p(v) and mix (M, H) = Σ_j w_j Σ_{v∈S_j} p(v) W_v, with S = every token
    for the soft CE and S = the top-K of p for the Top-K loss.
    """
    mass = ce_weight * p.sum(-1)
    mix = ce_weight * (p.to(weight.dtype) @ weight) if ce_weight else 0.0
    if topk_weight:
        top_p, top_idx = p.topk(k, dim=-1)  # (M, K)
        mass = mass + topk_weight * top_p.sum(-1)
        mix = mix + topk_weight * torch.einsum("mk,mkh->mh", top_p.to(weight.dtype), weight[top_idx])
    return mass, mix


def head_distillation(x: torch.Tensor, weight: torch.Tensor, mass: torch.Tensor, mix: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
    """Weighted −Σ p(v) log q(v) terms for q = softmax(x Wᵀ), without forming log q.

    With z = x Wᵀ and −log q(v) = logsumexp(z) − x·W_v, any weighted sum of such terms is
    logsumexp(z)·mass − x·mix (`target_mix` builds mass and mix). Equal to soft_cross_entropy /
    topk_distillation of the logits (a test checks), at the cost of one chunked logsumexp over V.
    """
    return _masked_mean(head_logsumexp(x, weight) * mass - (x.float() * mix.float()).sum(-1), mask)


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


def head_forward_kl(x: torch.Tensor, weight: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`forward_kl(x Wᵀ, target_logits, mask)` (full vocabulary) without forming the student's (N, V) logits.

    KL(p ‖ q) = −Σ p log q + Σ p log p: the cross-entropy is `head_distillation` with mass 1 and mix = p W,
    and Σ p log p needs only the target. p is built a few cache-sized rows at a time, in the autocast
    dtype when autocast is on (the dtype its product with W runs in).
    """
    dtype = matmul_dtype(x, weight)
    p = torch.empty(target_logits.shape, dtype=dtype, device=target_logits.device)
    neg_entropy = torch.empty(len(p), dtype=torch.promote_types(dtype, torch.float32), device=p.device)
    with torch.no_grad():
        for a, b in blocks(len(p), cache_rows(target_logits.shape[-1], target_logits.device)):
            log_p = torch.log_softmax(target_logits[a:b].to(neg_entropy.dtype), -1)
            probs = log_p.exp()
            neg_entropy[a:b] = (probs * log_p).sum(-1)
            p[a:b] = probs
    mix = p @ weight.to(dtype)  # (N, H); carries the gradient into W
    return head_distillation(x, weight, mix.new_ones(len(p)), mix, mask) + _masked_mean(neg_entropy, mask)


ACCEPTANCE_LOSSES = ("tv", "log", "hybrid")


def acceptance_loss(logits: torch.Tensor, p: torch.Tensor, mask: torch.Tensor, form: str = "hybrid",
                    eta: float = 3.0) -> torch.Tensor:
    """`acceptance_per_position` averaged over `mask`."""
    return _masked_mean(acceptance_per_position(logits, p, form, eta), mask)


def acceptance_per_position(logits: torch.Tensor, p: torch.Tensor, form: str = "hybrid",
                            eta: float = 3.0) -> torch.Tensor:
    """A loss on speculative sampling's acceptance rate itself. A drafted token is accepted with
    probability α = Σ_v min(p(v), q(v)) = 1 − TV(p, q) (Leviathan et al. 2023, §3.5), q = softmax(logits);
    the LK losses (Samarin et al. 2026, arXiv:2602.23881) train on α directly, where KL and cross-entropy
    only bound it (Pinsker):

    - `tv`: 1 − α;
    - `log`: −log α (α floored at 1e-5), whose gradient is TV's scaled by 1/α, so a drafter far from
      the target still learns; a one-hot p makes it the cross-entropy;
    - `hybrid`: λ·KL(p ‖ q) + (1 − λ)·(1 − α) with λ = exp(−η·α) and α held constant in λ: KL's
      gradient while the two laws barely overlap, TV's as they come to agree.

    p (..., V) target probabilities over the same vocabulary as the logits."""
    if form not in ACCEPTANCE_LOSSES:
        raise ValueError(f"acceptance loss must be one of {ACCEPTANCE_LOSSES}, got {form!r}")
    log_q = F.log_softmax(logits.float(), dim=-1)
    p = p.float()
    alpha = torch.minimum(p, log_q.exp()).sum(-1)  # (...,)
    if form == "tv":
        per_position = 1 - alpha
    elif form == "log":
        per_position = -alpha.clamp_min(1e-5).log()
    else:
        kl = (p * (p.clamp_min(1e-30).log() - log_q)).sum(-1)  # 0·log 0 = 0
        lam = torch.exp(-eta * alpha.detach())
        per_position = lam * kl + (1 - lam) * (1 - alpha)
    return per_position


def uniform_noise(features: torch.Tensor, scale: float) -> torch.Tensor:
    """EAGLE's feature noise: add U(-scale/2, scale/2) to every coordinate."""
    if scale <= 0:
        return features
    return features + (torch.rand_like(features) - 0.5) * scale


def step_weights(num_steps: int, decay: float) -> list[float]:
    """Per-step weights w_j = decay^j, j = 0..num_steps-1 (HASS weights later steps less)."""
    return [decay**j for j in range(num_steps)]
