"""What a draft-length policy sees and answers (`runtime/policies.py` holds the policies): the draft so far
(`DraftStep`), a tree round before its next level (`TreeLevel`), and the `Policy` and `TreeStop` protocols."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch


@dataclass(frozen=True)
class DraftStep:
    """The draft so far, as a policy sees it before deciding on token `position` + 1.

    position: tokens drafted this round; token: the last of them (None at position 0);
    q_raw (V,): the drafter's untempered distribution that token was drawn from; hidden (H,): the
    drafter's hidden state that produced q_raw (at position 0, the state that will draft the first
    token, where the proposer has one); committed: tokens in the sequence before this round."""

    position: int
    token: int | None = None
    q_raw: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    committed: int = 0


@dataclass(frozen=True)
class TreeLevel:
    """A tree round before its next level, as a tree policy sees it: `levels` drafted so far, the
    scores (log path probabilities) of every node drafted so far and of the nodes the next level
    would expand (best first), and `path`: the best of those nodes and its ancestors, the root's
    child first, each as the DraftStep a chain policy would see after drafting it (position i, the
    node's token, the distribution it was drawn from and the hidden state that produced that)."""

    levels: int
    scores: list[float]
    expanding: list[float]
    path: Sequence[DraftStep] = ()


class Policy(Protocol):
    """How many tokens a round drafts."""

    name: str

    def max_tokens(self) -> int:
        """The most tokens a round may draft."""
        ...

    def keep_going(self, step: DraftStep) -> bool:
        """Draft one more token after `step`?"""
        ...

    def end_round(self, drafted: int, accepted: int) -> None:
        """What verification made of the round's draft."""
        ...


@runtime_checkable
class TreeStop(Protocol):
    """A policy that also decides how deep an EAGLE-2 tree goes."""

    def expand(self, level: TreeLevel) -> bool:
        """Draft level `level.levels` + 1?"""
        ...
