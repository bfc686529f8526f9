"""Draft-length policies: asked after each drafted token whether to draft another.

A policy sees the position j (tokens drafted so far this round), the drafter's raw
distribution for the token just drafted, and the drafter's hidden state, so learned stop
heads (SpecDec++, DISCO) plug in as policies. `end_round` tells it what was accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftsmith import DraftsmithError


@dataclass
class Static:
    """Always K tokens."""

    k: int = 4
    name: str = "static"

    def max_tokens(self) -> int:
        return self.k

    def keep_going(self, position: int, q_raw: torch.Tensor, hidden: torch.Tensor | None) -> bool:
        return position < self.k

    def end_round(self, drafted: int, accepted: int) -> None:
        pass


@dataclass
class Heuristic:
    """transformers' assisted-generation schedule: +2 after a fully accepted draft, −1 otherwise."""

    k: int = 5
    max_k: int = 16
    name: str = "heuristic"

    def max_tokens(self) -> int:
        return self.k

    def keep_going(self, position: int, q_raw: torch.Tensor, hidden: torch.Tensor | None) -> bool:
        return position < self.k

    def end_round(self, drafted: int, accepted: int) -> None:
        self.k = min(self.max_k, self.k + 2) if accepted == drafted else max(1, self.k - 1)


@dataclass
class Confidence:
    """Draft while the drafter's top probability stays at or above `threshold` (at most max_k)."""

    threshold: float = 0.4
    max_k: int = 8
    name: str = "confidence"

    def max_tokens(self) -> int:
        return self.max_k

    def keep_going(self, position: int, q_raw: torch.Tensor, hidden: torch.Tensor | None) -> bool:
        return position < self.max_k and (position == 0 or float(q_raw.max()) >= self.threshold)

    def end_round(self, drafted: int, accepted: int) -> None:
        pass


@dataclass
class Oracle:
    """Drafts max_k, but is charged only up to the first rejected token: an upper bound for evaluation."""

    max_k: int = 8
    name: str = "oracle"
    charged: list[int] = field(default_factory=list)

    def max_tokens(self) -> int:
        return self.max_k

    def keep_going(self, position: int, q_raw: torch.Tensor, hidden: torch.Tensor | None) -> bool:
        return position < self.max_k

    def end_round(self, drafted: int, accepted: int) -> None:
        self.charged.append(min(drafted, accepted + 1))


POLICIES = {"static": Static, "heuristic": Heuristic, "confidence": Confidence, "oracle": Oracle}


def make_policy(name: str, **kwargs) -> object:
    if name not in POLICIES:
        raise DraftsmithError(f"unknown draft-length policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name](**kwargs)
