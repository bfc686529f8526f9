"""The cost policies: draft a token only while it is expected to pay for what it costs, measured.

`CostAware` sizes chains, `TreeCost` trees (their depth, nodes and lookup branch), each from a meter
of the round times and acceptance it has seen this run (`--policy cost`, the default).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from draftsmith import DraftsmithError
from draftsmith.runtime.steps import DraftStep, Policy, TreeLevel, TreePlan


class CostMeter:
    """What a drafted token costs and how often drafts are accepted, measured while decoding.

    One meter serves every generation of a run (`policy_factory` shares it), so later prompts
    start from what earlier ones measured. A round's time is modelled as R(K) = R0 + K·b: R0 a
    round that drafts nothing (one target step and the bookkeeping), b what each drafted token
    adds (a drafter forward and one more verification row). A drafted token costs c = b / R0
    rounds. α̂ = accepted / reached over the drafted rounds: the acceptance rate of the drafted
    tokens verification got to (a geometric fit). Medians and sums over the last `window`
    rounds keep a drafter prefill or a busy neighbour from swinging either.
    """

    def __init__(self, window: int = 32):
        self.plain: deque[float] = deque(maxlen=window)  # seconds of rounds that drafted nothing
        self.drafted: deque[tuple[int, float]] = deque(maxlen=window)  # (K, seconds) after a drafted round
        self.resumed: deque[tuple[int, float]] = deque(maxlen=window)  # (K, seconds) after a plain one
        self.verified: deque[tuple[int, int]] = deque(maxlen=window)  # (accepted, reached)
        self.since_plain = 0  # drafted rounds since the last timed plain round
        self.probe_gap: int | None = None  # plain rounds between probes; None: the policy's `probe`

    def add(self, drafted: int, accepted: int, seconds: float | None, after_plain: bool = False) -> None:
        """One round: K drafted, n accepted, its wall time (None: untimed); `after_plain` when the
        round before drafted nothing, so this one also fed the drafter the tokens it skipped."""
        if drafted:
            self.verified.append((accepted, min(drafted, accepted + 1)))
        if seconds is None:
            return
        if drafted:
            (self.resumed if after_plain else self.drafted).append((drafted, seconds))
            self.since_plain += 1
        else:
            self.plain.append(seconds)
            self.since_plain = 0

    def cost(self) -> float | None:
        """c = b / R0, or None until a plain and a drafted round have been timed. b comes from rounds
        that follow a drafted round (steady drafting) where there are any: a round that resumes
        after plain ones also pays the drafter's catch-up, once."""
        rounds = self.drafted or self.resumed
        if not self.plain or not rounds:
            return None
        r0 = statistics.median(self.plain)
        return max(0.0, statistics.median((s - r0) / k for k, s in rounds)) / r0

    def alpha(self) -> float | None:
        reached = sum(r for _, r in self.verified)
        return sum(a for a, _ in self.verified) / reached if reached else None


@dataclass
class CostAware(Policy):
    """Draft a token only while it is expected to pay for itself.

    A drafted token costs c rounds (measured by `meter`, or fixed by `cost`) and saves one round
    if it and every token before it are accepted. Before the first token that chance is α̂, the
    running acceptance rate; after j tokens it is α̂ · Π_{i≤j} q_i, q_i the drafter's top
    probability for token i. The policy drafts while the chance is at least c, up to k; a
    round where not even the first token pays is a plain target step, so a drafter too weak or
    too slow for its target costs little against autoregressive decoding. After `probe` plain
    rounds in a row one round drafts anyway, so α̂ keeps up with the text; while probes find no
    pay the wait doubles, up to `max_probe` (the meter keeps it across prompts). With a measured
    cost, rounds are plain until one is timed, then one in every `refresh` drafted rounds, to time R0;
    and a round that resumes drafting after plain ones is always followed by one more drafted round.
    The resuming round also pays the drafter's catch-up over the tokens it skipped (on a
    generation's first draft, its prefill of the whole prompt), so only the round after it times
    what drafting costs in steady state; without it a slow catch-up would price drafting so high
    that no later round drafts again, and the probes, each one resuming, would never correct it.
    """

    k: int = 8
    cost: float | None = None
    probe: int = 8
    max_probe: int = 64
    refresh: int = 32
    meter: CostMeter = field(default_factory=CostMeter, repr=False)
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False)
    name: str = "cost"
    chance: float = field(default=1.0, repr=False)  # Π q_i of this round's draft so far
    plain_streak: int = field(default=0, repr=False)
    resumed: bool = field(default=False, repr=False)  # the last round drafted after plain ones
    _pay: tuple[float | None, float | None] = field(default=(None, None), repr=False)  # (c, α̂) this round
    _round_end: float | None = field(default=None, repr=False)  # when the previous round ended

    def max_tokens(self) -> int:
        return self.k

    def keep_going(self, step: DraftStep) -> bool:
        if step.position == 0:
            return self._draft_at_all()
        cost, alpha = self._pay  # the meter changes only between rounds
        if step.position >= self.k or cost is None or alpha is None:  # still measuring: one token a round
            return False
        self.chance *= float(step.q_raw.max())
        return alpha * self.chance >= cost

    def _draft_at_all(self) -> bool:
        self.chance = 1.0
        if self.cost is None and (not self.meter.plain or self.meter.since_plain >= self.refresh):
            return False  # time a plain round: R0 drifts as the context grows
        self._pay = cost, alpha = (self.cost if self.cost is not None else self.meter.cost()), self.meter.alpha()
        if cost is None or alpha is None or alpha >= cost:
            self.meter.probe_gap = None
            return True
        if self.cost is None and self.resumed:  # time a steady round after a resuming one
            return True
        gap = self.meter.probe_gap or self.probe
        if self.plain_streak < gap:
            return False
        self.meter.probe_gap = min(2 * gap, self.max_probe)  # each probe that finds no pay waits twice as long
        return True

    def end_round(self, drafted: int, accepted: int) -> None:
        # rounds are timed end to end; a generation's first round (after the prefill, with the
        # drafter's own prefill when it drafts) is left untimed
        now = self.clock()
        seconds = None if self._round_end is None else now - self._round_end
        self.meter.add(drafted, accepted, seconds, after_plain=self.plain_streak > 0)
        self.resumed = bool(drafted) and self.plain_streak > 0
        self._round_end = now
        self.plain_streak = 0 if drafted else self.plain_streak + 1


class TreeCostMeter:
    """What a tree round costs and how well the drafter's path probabilities predict what is
    accepted, measured while decoding; one meter serves every generation of a run.

    Verification: the seconds of one target forward over the root and n tree nodes, timed once
    for a grid of n (`calibrate`) and interpolated between. Drafting: the seconds of one tree level
    (a drafter forward over the expanded nodes), the median of the recent rounds. Acceptance: a
    node's chance of being accepted is modelled as β·e^score, e^score the product of the drafter's
    probabilities along its path (what EAGLE-2 ranks by) and β = accepted / Σ e^score over the
    recent rounds, which corrects a drafter that is over- or under-confident. A prompt-lookup
    branch has no drafter probabilities: its j-th grafted token is priced by how often the
    branches so far were accepted that far (starting from one in two).
    """

    def __init__(self, window: int = 32):
        self.verify: dict[int, float] = {}  # n nodes → seconds of the forward over root + n nodes
        self.levels: deque[float] = deque(maxlen=window)  # seconds of one drafted level
        self.predictions: deque[tuple[float, int]] = deque(maxlen=window)  # (Σ e^score of the kept nodes, accepted)
        self.lookup: list[list[int]] = []  # [reached, offered] per grafted depth j

    def calibrate(self, forward: Callable[[int], float], sizes: Sequence[int], repeats: int = 2) -> None:
        """Time `forward(n)` (seconds of a verification over n nodes) for each n; the fastest of `repeats`."""
        for n in sorted(set(sizes)):
            self.verify[n] = min(forward(n) for _ in range(repeats))

    def verify_seconds(self, n: int) -> float:
        """Seconds to verify n nodes, linear between the calibrated sizes and beyond the largest."""
        sizes = sorted(self.verify)
        if not sizes:
            raise DraftsmithError("TreeCostMeter.verify_seconds before calibrate")
        lo = max((m for m in sizes if m <= n), default=sizes[0])
        hi = min((m for m in sizes if m > lo), default=None)
        if hi is None:  # past the grid: the last slope
            below = [m for m in sizes if m < lo]
            if not below:
                return self.verify[lo]
            hi, lo = lo, below[-1]
        return self.verify[lo] + (self.verify[hi] - self.verify[lo]) * (n - lo) / (hi - lo)

    def level_seconds(self) -> float | None:
        return statistics.median(self.levels) if self.levels else None

    def beta(self) -> float:
        predicted = sum(p for p, _ in self.predictions)
        return min(2.0, max(0.05, sum(a for _, a in self.predictions) / predicted)) if predicted > 0 else 1.0

    def lookup_chance(self, j: int) -> float:
        reached, offered = self.lookup[j] if j < len(self.lookup) else (0, 0)
        return (reached + 1) / (offered + 2)

    def add_lookup(self, offered: int, reached: int) -> None:
        while len(self.lookup) < offered:
            self.lookup.append([0, 0])
        for j in range(offered):
            self.lookup[j][1] += 1
            self.lookup[j][0] += j < reached


@dataclass
class TreeCost(Policy):
    """`--policy cost` with `--tree`: every round's tree is sized by what its nodes are expected to
    buy. The tree shape gives the most it may draft (depth, top-k, nodes); within it a round

    - drafts one more level only while the most the level can add, β·Σ e^score over the nodes
      it expands (a parent's children share at most its probability), pays for what the level
      costs at the round's best rate so far: a drafter forward plus verifying top-k more nodes;
    - keeps the n best nodes that maximise the expected tokens per second,
      (1 + β·Σ_{i≤n} e^score_i) / (draft seconds + verify seconds(n));
    - keeps a grafted prompt-lookup token while its chance of being reached pays for its row.

    EAGLE-2's fixed tree is the special case of one fixed n and depth. The stop decisions read
    only the draft, so decoding stays exactly lossless."""

    meter: TreeCostMeter = field(default_factory=TreeCostMeter, repr=False)
    name: str = "cost"
    predicted: float = field(default=0.0, repr=False)  # Σ e^score of this round's kept drafter nodes
    decides_depth = True  # it is its own tree plan (`TreePlan`): depth, nodes and lookup tokens by cost

    def max_tokens(self) -> int:  # a round with no room for a tree is a plain step
        return 0

    def keep_going(self, step: DraftStep) -> bool:
        return False

    def plan_tree(self, most: int, verify_seconds: Callable[[int], float]) -> TreePlan:
        """This policy, its verification forwards timed at the first round (rows 0 to `most`)."""
        if not self.meter.verify:
            self.meter.calibrate(verify_seconds, [n for n in (0, 1, 2, 4, 8, 12, 16, 24, 32, 48, 64) if n < most] + [most])
        return self

    def _best(self, values: list[float], draft_seconds: float) -> tuple[int, float]:
        """(n, rate) for the n ≥ 1 best of `values` (sorted, largest first) with the highest expected
        tokens per second."""
        best, gained = (0, 1.0 / (draft_seconds + self.meter.verify_seconds(0))), 1.0
        for n, v in enumerate(values, 1):
            gained += v
            rate = gained / (draft_seconds + self.meter.verify_seconds(n))
            if n == 1 or rate > best[1]:
                best = (n, rate)
        return best

    def expand(self, level: TreeLevel) -> bool:
        seconds = self.meter.level_seconds()
        if seconds is None:  # not timed yet: the full shape
            return True
        beta = self.meter.beta()
        values = sorted((beta * math.exp(s) for s in level.scores), reverse=True)
        n, rate = self._best(values, level.levels * seconds)
        added = seconds + self.meter.verify_seconds(n + len(level.expanding)) - self.meter.verify_seconds(n)
        return beta * sum(math.exp(s) for s in level.expanding) >= rate * added

    def keep(self, tree: Any, draft_seconds: float) -> int:
        self.meter.levels.append(draft_seconds / max(1, tree.max_depth))
        return self.size(tree.scores, draft_seconds)

    def size(self, scores: torch.Tensor, draft_seconds: float) -> int:
        """How many of a drafted tree's best nodes (scores (n,)) to verify."""
        beta = self.meter.beta()
        values = sorted((beta * math.exp(s) for s in scores.tolist()), reverse=True)
        n, _ = self._best(values, draft_seconds)
        self.predicted = sum(values[:n]) / beta
        return n

    def lookup_length(self, nodes: int, offered: int, draft_seconds: float) -> int:
        """How many of `offered` grafted lookup tokens to keep on the tree `size` chose (`nodes` nodes,
        β·`predicted` tokens expected from them)."""
        gained, seconds = 1.0 + self.predicted * self.meter.beta(), draft_seconds + self.meter.verify_seconds(nodes)
        keep = 0
        for j in range(offered):
            row = self.meter.verify_seconds(nodes + j + 1) - self.meter.verify_seconds(nodes + j)
            if self.meter.lookup_chance(j) < (gained / seconds) * row:
                break
            gained, seconds, keep = gained + self.meter.lookup_chance(j), seconds + row, j + 1
        return keep

    def verified(self, accepted: int, lookup_offered: int, lookup_reached: int) -> None:
        """What verification kept: `accepted` of the drafter's nodes, and how far down the
        `lookup_offered` grafted tokens it got."""
        self.meter.predictions.append((self.predicted, accepted))
        self.meter.add_lookup(lookup_offered, lookup_reached)

