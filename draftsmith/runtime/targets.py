"""Target distributions π = T(q, p) for generalized verification (runtime/verify.py).

Verifying a draft x ~ q against π (accept with min(1, π(x)/q(x)), else draw from
norm(max(0, π − q))) makes the committed token follow π exactly; π = p is lossless decoding.

- **exact**: π = p.
- **lossy** speculative decoding (Leviathan et al. 2023, appendix; Tran-Thien 2023): accept x with
  min(1, p(x)/((1−α)·q(x))), on rejection draw from norm(max(0, p/β − q)). Its output law, for any
  β ≥ 1 − α, is π = min(q, p/(1−α)) + R·norm(max(0, p/β − q)) with R = 1 − Σ min(q, p/(1−α)) the
  rejection mass; for the β that makes the residual mass equal R (`tuned_beta`) this is the
  speculative-cascades paper's Lemma 2, π = max{min{q, p/(1−α)}, p/β}. α = 0 gives p; once
  p/(1−α) ≥ q everywhere, q.
- **mixture**: π = (1 − δ)·q + δ·p with a deferral weight δ per position: speculative cascades
  (Narasimhan et al. 2024, arXiv:2405.19261) with the Chow, Diff and OPT rules below. Its
  rejection rate is δ·TV(p, q): δ = 1 is exact decoding, δ = 0 returns the drafter's own samples.
- **token-specific** cascades: a deferral indicator r(v) per token (V1, V2, V3 below), π(v) =
  q(v)·(1 − r(v)) + p(v)·Σ_v' r(v')·q(v'). V3 at temperature 0 is Leviathan's greedy lossy variant
  (accept the drafted v when p(v) ≥ (1−α)·max p; the paper's Lemma 7).
- **BiLD** (Kim et al. 2023, arXiv:2302.07863): BiLD* is the mixture with δ = 1[TV(p, q) > α] (defer
  where the two models disagree by more than α); the original algorithm (`Rollback`, with the
  fallback drafting of runtime/proposers.py) rolls back at the first drafted token whose
  cross-entropy under the target exceeds −log(1 − α) and lets the target pick that token. Its
  output law is the token-specific π with r(v) = 1[p(v) < 1 − α], reached by a different,
  deterministic acceptance.

Deferral rules read the raw (temperature 1, untruncated) distributions; π mixes the scaled ones,
so the rules trade quality for speed even at temperature 0 (the paper's appendix C.1).
Notation: (..., V) distributions; δ (...,).
"""

from __future__ import annotations

import torch

from draftsmith.runtime.sampling import sample
from draftsmith.runtime.verify import first_true


def total_variation(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return 0.5 * (p - q).abs().sum(-1)


# --- lossy speculative decoding -------------------------------------------------------------------------
def lossy(q: torch.Tensor, p: torch.Tensor, alpha: float, beta: torch.Tensor | float = 1.0) -> torch.Tensor:
    """The output law of lossy speculative decoding with leniency α and residual scale β (≥ 1 − α)."""
    if not 0 <= alpha < 1:
        raise ValueError(f"lossy decoding needs 0 <= alpha < 1, got {alpha}")
    beta = torch.as_tensor(beta, dtype=p.dtype, device=p.device)
    if beta.dim():
        beta = beta[..., None]
    kept = torch.minimum(q, p / (1 - alpha))  # what acceptance lets through
    rejected = (1 - kept.sum(-1, keepdim=True)).clamp(min=0)
    residual = (p / beta - q).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    # no residual mass: p/β ≤ q everywhere, so acceptance lets everything through (up to rounding)
    spread = torch.where(mass > 1e-12, residual / mass.clamp(min=1e-12), kept / kept.sum(-1, keepdim=True))
    return kept + rejected * spread


def tuned_beta(q: torch.Tensor, p: torch.Tensor, alpha: float, iterations: int = 80) -> torch.Tensor:
    """The β ≥ 1 − α with Σ max(0, p/β − q) = 1 − Σ min(q, p/(1−α)) (...,), by geometric bisection:
    then lossy(q, p, α, β) = max{min{q, p/(1−α)}, p/β} (Lemma 2). At β = 1 − α the residual mass is at
    least the rejection mass and it falls to 0 as β grows, so the root lies above 1 − α (and may exceed 1)."""
    target = 1 - torch.minimum(q, p / (1 - alpha)).sum(-1)
    low = torch.full(target.shape, 1 - alpha, dtype=p.dtype, device=p.device)
    high = (p / q.clamp(min=1e-12)).max(-1).values.clamp(min=1.0) * 2  # no residual mass left up here
    for _ in range(iterations):
        mid = (low * high).sqrt()
        too_much = (p / mid[..., None] - q).clamp(min=0).sum(-1) > target
        low, high = torch.where(too_much, mid, low), torch.where(too_much, high, mid)
    return (low * high).sqrt()


# --- speculative cascades: deferral weights δ for a mixture ------------------------------------------------
def mixture(q: torch.Tensor, p: torch.Tensor, defer: torch.Tensor | float) -> torch.Tensor:
    defer = torch.as_tensor(defer, dtype=q.dtype, device=q.device)
    if defer.dim():
        defer = defer[..., None]
    return (1 - defer) * q + defer * p


def chow(q_raw: torch.Tensor, p_raw: torch.Tensor, alpha: float) -> torch.Tensor:
    """Defer to the target when the drafter is unsure: max q < 1 − α."""
    return (q_raw.max(-1).values < 1 - alpha).float()


def diff(q_raw: torch.Tensor, p_raw: torch.Tensor, alpha: float) -> torch.Tensor:
    """Defer when the target is more confident by a margin: max q < max p − α."""
    return (q_raw.max(-1).values < p_raw.max(-1).values - alpha).float()


def opt(q_raw: torch.Tensor, p_raw: torch.Tensor, alpha: float) -> torch.Tensor:
    """The cost-aware rule: max q < max p − α·TV(p, q)."""
    return (q_raw.max(-1).values < p_raw.max(-1).values - alpha * total_variation(p_raw, q_raw)).float()


def bild_star(q_raw: torch.Tensor, p_raw: torch.Tensor, alpha: float) -> torch.Tensor:
    """BiLD*: defer where the models disagree, TV(p, q) > α."""
    return (total_variation(p_raw, q_raw) > alpha).float()


# --- token-specific cascades: a deferral indicator per token -----------------------------------------------
def token_defer(rule: str, q_raw: torch.Tensor, p_raw: torch.Tensor, alpha: float) -> torch.Tensor:
    """r(v) in {0, 1} (..., V): V1 q(v) < max p − α; V2 p(v) < max p − α; V3 p(v) < (1 − α)·max p."""
    top = p_raw.max(-1, keepdim=True).values
    if rule == "v1":
        return (q_raw < top - alpha).float()
    if rule == "v2":
        return (p_raw < top - alpha).float()
    if rule == "v3":
        return (p_raw < (1 - alpha) * top).float()
    raise ValueError(f"unknown token-specific rule {rule!r}; choose v1, v2 or v3")


def token_specific(q: torch.Tensor, p: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """π(v) = q(v)·keep(v) + p(v)·Σ_{v' deferred} q(v')."""
    deferred_mass = (q * (1 - keep)).sum(-1, keepdim=True)
    return q * keep + p * deferred_mass


# --- BiLD's rollback: a deterministic acceptance with a token-specific law ------------------------------
class Rollback:
    """BiLD's rollback rule (chains): accept drafted tokens while the target's raw probability of each is at
    least 1 − α (its cross-entropy at most −log(1 − α) nats); at the first that falls short, and after a
    fully accepted draft, the target samples the next token from its own (scaled) law. As a target
    distribution (`__call__`, for measurement) it is token_specific with keep(v) = 1[p(v) ≥ 1 − α].

    `fallback`: BiLD's drafting: the drafter drafts while its top probability stays at or above this,
    and the token where it falls below is left to the target (the runtime applies it; None: off)."""

    def __init__(self, alpha: float, fallback: float | None = None):
        self.alpha, self.fallback = alpha, fallback
        self.floor = 1 - alpha

    def confident(self, q_raw: torch.Tensor) -> int:
        """How many leading drafted tokens (q_raw (K, V)) the fallback keeps."""
        if self.fallback is None:
            return len(q_raw)
        return first_true(q_raw.max(-1).values < self.fallback)

    def keep(self, p_raw: torch.Tensor) -> torch.Tensor:
        return (p_raw >= self.floor).float()

    def __call__(self, q_raw, q, p_raw, p):
        return token_specific(q, p, self.keep(p_raw))

    def deferral(self, q_raw, q, p_raw, p):
        return (q * (1 - self.keep(p_raw))).sum(-1)

    def verify(self, draft: torch.Tensor, p_raw: torch.Tensor, p: torch.Tensor,
               generator: torch.Generator | None = None) -> tuple[int, int]:
        """draft (K,), p_raw (K, V) the target's raw law at the drafted positions, p (K+1, V) its scaled law
        there and after the last. Returns (accepted count, next token)."""
        accepted = first_true(p_raw[torch.arange(draft.shape[0], device=draft.device), draft] < self.floor)
        return accepted, int(sample(p[accepted], generator))


# --- decoding modes: a TargetRule for the runtime ------------------------------------------------------------
MODES = {"exact": (None,), "lossy": ("beta1", "tuned"), "cascade": ("chow", "diff", "opt"), "token": ("v1", "v2", "v3"),
         "bild": ("rollback", "star")}


class TargetLaw:
    """A decoding mode's π = law(q_raw, q, p_raw, p) (K, V), with `deferral`: the share of it handed to
    the target (K,): δ for a mixture, the deferred mass Σ r(v)·q(v) for a token-specific rule, the
    rejection mass for lossy decoding."""

    def __init__(self, law, deferral):
        self.law, self.deferral = law, deferral

    def __call__(self, q_raw, q, p_raw, p):
        return self.law(q_raw, q, p_raw, p)


def target_rule(mode: str, rule: str | None, alpha: float, greedy: bool, fallback: float | None = None):
    """The runtime's rule for a decoding mode: a TargetLaw, called as rule(q_raw, q_scaled, p_raw, p_scaled)
    → π (K, V), or None for exact decoding. Deferral rules read the raw distributions, π mixes the scaled
    ones. Lossy decoding at temperature 0 is Leviathan's greedy variant, which is V3 on the raw target
    law (Lemma 7). BiLD's rollback is a `Rollback` (its own acceptance; the runtime calls its `verify`)
    with BiLD's `fallback` drafting threshold."""
    rules = MODES.get(mode)
    if rules is None:
        raise ValueError(f"unknown decoding mode {mode!r}; choose one of {sorted(MODES)}")
    rule = rule or rules[0]
    if rule not in rules:
        raise ValueError(f"--mode {mode} takes --rule {' or '.join(map(str, rules))}, got {rule!r}")
    if mode == "exact":
        return None
    if mode == "lossy" and greedy:
        mode, rule = "token", "v3"
    if mode == "lossy":
        def lossy_law(q_raw, q, p_raw, p):
            return lossy(q, p, alpha, tuned_beta(q, p, alpha) if rule == "tuned" else 1.0)
        return TargetLaw(lossy_law, lambda q_raw, q, p_raw, p: 1 - torch.minimum(q, p / (1 - alpha)).sum(-1))
    if mode == "bild" and rule == "rollback":
        return Rollback(alpha, fallback)
    if mode in ("cascade", "bild"):
        defer_of = {"chow": chow, "diff": diff, "opt": opt, "star": bild_star}[rule]
        return TargetLaw(lambda q_raw, q, p_raw, p: mixture(q, p, defer_of(q_raw, p_raw, alpha)),
                         lambda q_raw, q, p_raw, p: defer_of(q_raw, p_raw, alpha))
    return TargetLaw(lambda q_raw, q, p_raw, p: token_specific(q, p, 1 - token_defer(rule, q_raw, p_raw, alpha)),
                     lambda q_raw, q, p_raw, p: (q * token_defer(rule, q_raw, p_raw, alpha)).sum(-1))
