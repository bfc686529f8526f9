"""Generalized speculative sampling: one verification routine for every acceptance rule.

Leviathan et al. 2023 (arXiv:2211.17192), Chen et al. 2023 (arXiv:2302.01318), generalized to
a target distribution π = T(q, p) as in speculative cascades (Narasimhan et al. 2024,
arXiv:2405.19261): draft token x_i ~ q_i is accepted with probability min(1, π_i(x)/q_i(x));
at the first rejection the token is drawn from norm(max(0, π_i − q_i)); after a fully
accepted draft a bonus token is drawn from π_K. The committed tokens then follow π exactly.
Lossless decoding is π = p. A deterministic draft (greedy, a tree node) has q = one-hot.

Notation: K draft length, V vocab.
"""

from __future__ import annotations

import torch

from draftsmith.runtime.sampling import sample


def first_true(mask: torch.Tensor) -> int:
    """The index of the first True in a 1-D mask, or its length when there is none (one host sync)."""
    return int(mask.int().argmax()) if bool(mask.any()) else len(mask)


def verify_chain(draft: torch.Tensor, q: torch.Tensor, pi: torch.Tensor,
                 generator: torch.Generator | None = None) -> tuple[int, int]:
    """draft (K,) tokens, q (K, V) the distributions they were drawn from, pi (K+1, V) the target
    distribution at each draft position and after the last. Returns (accepted count, next token)."""
    k = draft.shape[0]
    accepted = k
    if k:
        rows = torch.arange(k, device=draft.device)
        ratio = (pi[rows, draft] / q[rows, draft]).clamp(max=1.0)  # q(x) > 0: x was drawn from q
        u = torch.rand(k, generator=generator, device=draft.device)
        accepted = first_true(u >= ratio)  # the first rejection
    if accepted == k:
        return k, int(sample(pi[k], generator))
    residual = (pi[accepted] - q[accepted]).clamp(min=0.0)
    mass = residual.sum()
    # zero residual mass happens only when π = q up to rounding; then π itself is the law
    dist = residual / mass if mass > 1e-12 else pi[accepted]
    return accepted, int(sample(dist, generator))


def verify_greedy(draft: torch.Tensor, target_argmax: torch.Tensor) -> tuple[int, int]:
    """The exact greedy path: accept while the draft equals the target's argmax (K+1,)."""
    k = draft.shape[0]
    accepted = first_true(draft != target_argmax[:k])
    return accepted, int(target_argmax[accepted])
