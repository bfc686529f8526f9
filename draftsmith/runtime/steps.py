"""What a draft-length policy sees and answers (`runtime/policies.py` holds the policies): the draft so far
(`DraftStep`), a tree round before its next level (`TreeLevel`), the `Policy` base class, and the plan of a
tree round (`TreePlan`, a Protocol: `FixedTree` is EAGLE-2's, or a stop rule's; the cost policy is its own)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch


@dataclass(frozen=True)
class DraftStep:
    """The draft so far, as a policy sees it before deciding on token `position` + 1.

    position: tokens drafted this round; token: the last of them (None at position 0);
    q_raw (V,): the drafter's untempered distribution that token was drawn from; hidden (H,): the
    drafter's hidden state that produced q_raw (at position 0, the state that will draft the first
    token, where the proposer has one); committed: tokens in the sequence before this round;
    confidence: a block drafter's predicted chance that the next token would be accepted (DSpark's
    confidence head), where it has one."""

    position: int
    token: int | None = None
    q_raw: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    committed: int = 0
    confidence: float | None = None


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


class TreePlan(Protocol):
    """One EAGLE-2 tree round as a policy decides it; what `Policy.plan_tree` returns, and what the decoding
    loop asks in the round: whether to draft each level after the first (`expand`, asked only where
    `decides_depth`; else the proposer drafts the shape's every level, at fixed shapes where it can), how many
    of the drafted nodes to verify (`keep`: the best by path score), how many grafted prompt-lookup tokens
    (`lookup_length`), and what verification kept (`verified`)."""

    decides_depth: bool

    def expand(self, level: TreeLevel) -> bool:
        """Draft level `level.levels` + 1?"""
        ...

    def keep(self, tree: Any, draft_seconds: float) -> int:
        """How many of a drafted tree's best nodes to verify (it took `draft_seconds` to draft)."""
        ...

    def lookup_length(self, nodes: int, offered: int, draft_seconds: float) -> int:
        """How many of `offered` lookup tokens to graft on the `nodes` kept."""
        ...

    def verified(self, accepted: int, lookup_offered: int, lookup_reached: int) -> None:
        """`accepted` of the drafter's nodes were accepted, the lookup branch reached `lookup_reached` deep."""
        ...


@dataclass(frozen=True)
class FixedTree:
    """A tree plan that verifies every node and lookup token drafted: EAGLE-2's fixed tree (every level of the
    shape), or, with `stop`, a tree whose depth a stop rule decides level by level (the stop heads')."""

    stop: Callable[[TreeLevel], bool] | None = None

    @property
    def decides_depth(self) -> bool:
        return self.stop is not None

    def expand(self, level: TreeLevel) -> bool:
        return True if self.stop is None else self.stop(level)

    def keep(self, tree: Any, draft_seconds: float) -> int:
        return len(tree)

    def lookup_length(self, nodes: int, offered: int, draft_seconds: float) -> int:
        return offered

    def verified(self, accepted: int, lookup_offered: int, lookup_reached: int) -> None:
        pass


WHOLE_TREE = FixedTree()


class Policy:
    """How many tokens a round drafts: a chain token by token (`keep_going`, at most `max_tokens`), a
    tree through the plan `plan_tree` returns; `end_round` tells it what was accepted. `fixed_length`:
    the policy drafts `max_tokens()` whatever the draft holds, so a proposer may draft them in one go."""

    name: str
    fixed_length = False

    def max_tokens(self) -> int:
        """The most tokens a round may draft."""
        raise NotImplementedError

    def keep_going(self, step: DraftStep) -> bool:
        """Draft one more token after `step`?"""
        raise NotImplementedError

    def end_round(self, drafted: int, accepted: int) -> None:
        """What verification made of the round's draft."""

    def plan_tree(self, most: int, verify_seconds: Callable[[int], float]) -> TreePlan:
        """The plan of a tree round of at most `most` rows; `verify_seconds(n)` times a verification
        forward of n rows (for a policy that prices them)."""
        return WHOLE_TREE
