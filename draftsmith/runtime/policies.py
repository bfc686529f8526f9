"""Draft-length policies: asked before each drafted token whether to draft it.

A policy reads only the draft (`DraftStep`): how many tokens were drafted this round, the
last one, the drafter's raw distribution it was drawn from and the drafter's hidden state that
produced that distribution, so learned stop heads (SpecDec++, DISCO) plug in as policies and
decoding stays lossless whatever they decide. `end_round` tells it what was accepted.

Trees: a policy plans each EAGLE-2 tree round (`Policy.plan_tree`): the stop heads are asked before
each level after the first whether to draft it (`TreeLevel`), the cost policy also sizes the tree;
the others leave trees their full shape. The interface is `runtime/steps.py`; the cost policies,
which measure what a drafted token costs, are `runtime/cost.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

import torch

from draftsmith import DraftsmithError
from draftsmith.models.registry import DISCO, DSPARK, HEAD_KINDS, SPECDEC, HeadKind
from draftsmith.runtime.cost import CostAware, CostMeter, TreeCost, TreeCostMeter
from draftsmith.runtime.steps import DraftStep, FixedTree, Policy, TreeLevel, TreePlan


@dataclass
class Static(Policy):
    """Always K tokens."""

    k: int = 4
    name: str = "static"
    fixed_length = True

    def max_tokens(self) -> int:
        return self.k

    def keep_going(self, step: DraftStep) -> bool:
        return step.position < self.k


@dataclass
class Heuristic(Policy):
    """transformers' assisted-generation schedule: +2 after a fully accepted draft, −1 otherwise."""

    k: int = 5
    ceiling: int = 16  # the longest it grows to
    name: str = "heuristic"

    def max_tokens(self) -> int:
        return self.k

    def keep_going(self, step: DraftStep) -> bool:
        return step.position < self.k

    def end_round(self, drafted: int, accepted: int) -> None:
        self.k = min(self.ceiling, self.k + 2) if accepted == drafted else max(1, self.k - 1)


def sure(step: DraftStep, threshold: float) -> bool:
    """The drafter's top probability for the last drafted token is at least `threshold` (true before any)."""
    return step.position == 0 or float(step.q_raw.max()) >= threshold


@dataclass
class Confidence(Policy):
    """Draft while the drafter's top probability stays at or above `threshold` (at most k)."""

    threshold: float = 0.4
    k: int = 8
    name: str = "confidence"

    def max_tokens(self) -> int:
        return self.k

    def keep_going(self, step: DraftStep) -> bool:
        return step.position < self.k and sure(step, self.threshold)


@dataclass
class Fallback(Policy):
    """Another policy, stopped after the first drafted token whose top probability is below `threshold`
    (BiLD's fallback: the runtime then leaves that token to the target)."""

    inner: Policy
    threshold: float
    name: str = "fallback"

    def max_tokens(self) -> int:
        return self.inner.max_tokens()

    def keep_going(self, step: DraftStep) -> bool:
        return self.inner.keep_going(step) and sure(step, self.threshold)

    def end_round(self, drafted: int, accepted: int) -> None:
        self.inner.end_round(drafted, accepted)


@dataclass
class Oracle(Policy):
    """The oracle draft length, an upper bound for evaluation, not a policy a user can run.

    It knows the target's own greedy continuation (`reference`: prompt + continuation) and, after
    every prefix reference[:t+1], the drafter's own greedy chain (`drafts`: t → tokens, see
    `oracle_drafts`). It drafts exactly the tokens verification will accept, at most k: a
    perfect stop decision made before each drafter step, so it is charged only for what it keeps
    (its rounds reject nothing). Greedy only.
    """

    reference: Sequence[int] = ()
    drafts: dict[int, list[int]] = field(default_factory=dict)
    k: int = 8
    name: str = "oracle"

    def max_tokens(self) -> int:
        return self.k

    def keep_going(self, step: DraftStep) -> bool:
        chain = self.drafts.get(step.committed - 1, ())
        at = step.committed + step.position  # where the next drafted token would sit in the sequence
        return (step.position < min(self.k, len(chain)) and at < len(self.reference)
                and chain[step.position] == self.reference[at])


@dataclass
class AcceptanceStop(Policy):
    """SpecDec++: stop once the predicted chance that some drafted token is rejected exceeds `threshold`.

    The acceptance head reads the drafter's hidden state that drafted token i and predicts a_i, its
    chance of acceptance; after token j the chance that some token so far is rejected is
    1 − Π_{i≤j} a_i. The first token is always drafted, at most k. A larger threshold, longer drafts.
    """

    head: Any
    threshold: float = 0.5
    k: int = 8
    name: str = SPECDEC.name
    accepted: float = field(default=1.0, repr=False)  # Π a_i of this round's draft so far
    nodes: dict[tuple[int, ...], float] = field(default_factory=dict, repr=False)  # a tree round's a_i by path

    def max_tokens(self) -> int:
        return self.k

    def plan_tree(self, most: int, verify_seconds: Callable[[int], float]) -> TreePlan:
        """Trees: the head decides each round's depth (`expand`); every node drafted is verified."""
        return FixedTree(self.expand)

    @torch.no_grad()
    def keep_going(self, step: DraftStep) -> bool:
        if step.position == 0:
            self.accepted = 1.0
            return self.k > 0
        if step.position >= self.k:
            return False
        self.accepted *= self.head.acceptance(step.hidden, step.q_raw, step.position)
        return 1 - self.accepted <= self.threshold

    @torch.no_grad()
    def expand(self, level: TreeLevel) -> bool:
        """Trees: draft the next level while the chain's rule holds for the best node it would expand,
        Π a_i over that node's path (so a tree of top-k 1 is as deep as the chain is long). Each node's
        a_i is computed once a round."""
        if level.levels == 1:
            self.nodes = {}
        if level.levels >= self.k:
            return False
        accepted, tokens = 1.0, ()
        for step in level.path:
            tokens += (step.token,)
            if tokens not in self.nodes:
                self.nodes[tokens] = self.head.acceptance(step.hidden, step.q_raw, step.position)
            accepted *= self.nodes[tokens]
        return 1 - accepted <= self.threshold


@dataclass
class ClassifierStop(Policy):
    """DISCO: keep drafting while the stop classifier's confidence in the last drafted token stays at or
    above `threshold`, at most k (SL_max) tokens. The classifier reads the distribution the token was
    drawn from (its top-k probabilities and entropy) and the token's position in the round."""

    head: Any
    threshold: float = 0.5
    k: int = 8
    name: str = DISCO.name

    def max_tokens(self) -> int:
        return self.k

    def plan_tree(self, most: int, verify_seconds: Callable[[int], float]) -> TreePlan:
        """Trees: the classifier decides each round's depth (`expand`); every node drafted is verified."""
        return FixedTree(self.expand)

    @torch.no_grad()
    def keep_going(self, step: DraftStep) -> bool:
        if step.position == 0:
            return self.k > 0
        return step.position < self.k and self.head.confidence(step.q_raw, step.position) >= self.threshold

    def expand(self, level: TreeLevel) -> bool:
        """Trees: draft the next level while the best node it would expand passes the chain's rule (the
        node sits at position `level.levels` ≥ 1 of its path)."""
        return self.keep_going(level.path[-1])


@dataclass
class BlockConfidence(Policy):
    """DSpark's adaptive block: draft the next token while the confidence head's predicted chance that it
    and every token before it are accepted, Π c_i, stays at or above `threshold`, at most k. Each c_i is
    read before its token is drawn (`DraftStep.confidence`), so a round may draft nothing."""

    head: Any = None  # the confidence head is the drafter's own: nothing to hold
    threshold: float = 0.3
    k: int = 8
    name: str = DSPARK.name  # the policy is named after the drafter kind whose head it reads
    accepted: float = field(default=1.0, repr=False)

    def max_tokens(self) -> int:
        return self.k

    def keep_going(self, step: DraftStep) -> bool:
        if step.confidence is None:
            raise DraftsmithError("--policy dspark reads a DSpark drafter's confidence head: give a dspark export "
                                  "trained with confidence_head: true")
        if step.position >= self.k:
            return False
        self.accepted = step.confidence * (self.accepted if step.position else 1.0)
        return self.accepted >= self.threshold


@dataclass(frozen=True)
class PolicySettings:
    """What a run's policies are built from: the decode options they read and what the run loaded for them.

    k: the draft length (static), starting length (heuristic) or most (the others); threshold: the
    policy's threshold where it has one (the confidence rule's, a stop head's h or τ, DSpark's bound on
    Π c_i); tree: the run drafts trees (the cost policy then sizes them); head: the stop head read from
    the export; references: each prompt's ids → (the target's greedy text, the drafter's greedy chains),
    for the oracle."""

    k: int = 4
    threshold: float | None = None
    tree: bool = False
    head: Any = None
    references: dict[tuple[int, ...], tuple[list[int], dict[int, list[int]]]] | None = None


@dataclass(frozen=True)
class PolicyKind:
    """One draft-length policy, as `--policy NAME` names it: everything eval and tune need to know of it.

    Attributes:
        name: its `--policy` name, and the key of its section in an export's `stop_heads` (tuned settings).
        title: what a message calls it.
        build: settings → a function giving a fresh policy for each generation (given its prompt ids);
            the policies of one run may share state (the cost policies' meter).
        head: where its head comes from: "stop" (a stop head trained apart and exported with the drafter:
            the head kind of the same name), "drafter" (the drafter's own confidence head, DSpark), or None.
        tuned: it reads the settings `draftsmith tune` filed in the export, where the command gives none.
        tune: how `draftsmith tune` chooses its settings: "decode" (decoding held-out prompts over `grid` ×
            `ks`, the fastest kept) or "labels" (transformers' ROC rule on labelled drafts); None: not tuned.
        grid, ks: the thresholds and most lengths `draftsmith tune` tries ("decode").
        static_at: the threshold at which it never stops early: every round drafts its k, a static draft
            length. `draftsmith tune` tries it at every k up to the grid's most, so what it files never
            loses to the best static length on the prompts it tunes on (the fallback where the costs leave
            nothing to adapt).
        references: it reads each prompt's greedy continuation by the target, and the drafter's greedy chains,
            computed before decoding (the oracle): so it decodes greedily only.
        trees: what it does with --tree: "sized" (it sizes each tree round itself: depth, nodes, lookup
            tokens), "whole" (every level and node of the shape), "depth" (its head sets each round's depth,
            level by level: for drafters that draft a level a forward), or None (it sizes chains only: --tree
            is refused).
    """

    name: str
    title: str
    build: Callable[[PolicySettings], Callable[[list[int]], Policy]]
    head: str | None = None
    tuned: bool = False
    tune: str | None = None
    grid: tuple[float, ...] = ()
    ks: tuple[int, ...] = ()
    static_at: float | None = None
    references: bool = False
    trees: Literal["sized", "whole", "depth"] | None = None

    @property
    def sizes_trees(self) -> bool:
        return self.trees == "sized"

    @property
    def head_kind(self) -> HeadKind | None:
        """The stop-head kind it decodes with (head "stop"), else None."""
        return HEAD_KINDS[self.name] if self.head == "stop" else None


def _cost(s: PolicySettings) -> Callable[[list[int]], Policy]:
    """The cost policies of one run share a meter, so later prompts start from what earlier ones measured."""
    if s.tree:
        tree_meter = TreeCostMeter()
        return lambda prompt: TreeCost(meter=tree_meter)
    meter = CostMeter()
    return lambda prompt: CostAware(k=s.k, meter=meter)


def _oracle(s: PolicySettings) -> Callable[[list[int]], Policy]:
    if s.references is None:
        raise DraftsmithError("the oracle policy needs the target's greedy continuations (evaluate computes them)")
    return lambda prompt: Oracle(reference=s.references[tuple(prompt)][0], drafts=s.references[tuple(prompt)][1], k=s.k)


def _stop(policy: type) -> Callable[[PolicySettings], Callable[[list[int]], Policy]]:
    return lambda s: (lambda prompt: policy(head=s.head, threshold=s.threshold, k=s.k))


def _head_policy(head: HeadKind, policy: type, static_at: float) -> PolicyKind:
    return PolicyKind(head.name, head.title, _stop(policy), head="stop", tuned=True, tune="decode", grid=head.grid,
                      ks=head.ks, static_at=static_at, trees="depth")


CONFIDENCE_GRID = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)  # DSpark's bounds on Π c_i tried by tune

POLICY_KINDS: dict[str, PolicyKind] = {k.name: k for k in (
    PolicyKind("cost", "the cost policy", _cost, trees="sized"),
    PolicyKind("static", "a static draft length", lambda s: (lambda prompt: Static(k=s.k)), trees="whole"),
    PolicyKind("heuristic", "transformers' heuristic schedule", lambda s: (lambda prompt: Heuristic(k=s.k))),
    PolicyKind("confidence", "the confidence rule", lambda s: (lambda prompt: Confidence(threshold=s.threshold, k=s.k)),
               tuned=True, tune="labels"),
    PolicyKind("oracle", "the oracle draft length", _oracle, references=True),
    _head_policy(SPECDEC, AcceptanceStop, static_at=1.0),  # 1 − Π a_i never exceeds 1
    _head_policy(DISCO, ClassifierStop, static_at=0.0),  # a confidence is never below 0
    PolicyKind(DSPARK.name, "DSpark's confidence head", _stop(BlockConfidence), head="drafter", tuned=True,
               tune="decode", grid=CONFIDENCE_GRID, ks=(8,), static_at=0.0),
)}


def policy_kind(name: str) -> PolicyKind:
    if name not in POLICY_KINDS:
        raise DraftsmithError(f"unknown draft-length policy {name!r}; choose one of {', '.join(POLICY_KINDS)}")
    return POLICY_KINDS[name]


def check_tree_policy(kind: PolicyKind, levels_asked: bool = True) -> None:
    """Refuse --tree with a policy that does nothing with trees, or whose head would set the depth of trees
    drawn whole from one forward (`levels_asked` False: the loaded proposer's `asks_each_level`)."""
    works = " or ".join(k.name for k in POLICY_KINDS.values() if k.trees in ("sized", "whole"))
    if kind.trees is None:
        raise DraftsmithError(f"--policy {kind.name}: {kind.title} sizes chains only; with --tree use --policy "
                              f"{works}, or drop --tree")
    if kind.trees == "depth" and not levels_asked:
        raise DraftsmithError(f"--policy {kind.name} sets a tree's depth level by level, but this drafter draws every "
                              f"level of a tree from one forward: with --tree use --policy {works}, or drop --tree")


def make_policy(name: str, **kwargs) -> Policy:
    """One policy of kind `name`, built from PolicySettings' fields given as keywords."""
    return policy_kind(name).build(PolicySettings(**kwargs))([])
