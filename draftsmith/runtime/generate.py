"""The decoding loop: propose → verify with the target → commit → roll caches back.

Batch size 1. The target's KV cache holds every committed token but the last (the pending
one); a round feeds [pending, d_1..d_K] in one forward, verification accepts n drafted tokens
and picks one more, and the cache drops the K − n rejected entries (no recomputation). The
same forward yields the hidden states feature drafters read next round.

Notation: P prompt length, K drafted tokens, V vocab, H hidden.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from draftsmith import DraftsmithError
from draftsmith.runtime.policies import Fallback
from draftsmith.runtime.steps import Policy
from draftsmith.runtime.proposers import Proposer, TreeProposer
from draftsmith.runtime.runner import TargetRunner
from draftsmith.runtime.sampling import SamplingConfig, distributions, greedy_tokens, sample
from draftsmith.runtime.targets import Rollback
from draftsmith.runtime.tree import DraftTree, TreeShape, graft, lookup_continuation, prune, verify_tree, verify_tree_greedy
from draftsmith.runtime.verify import verify_chain, verify_greedy

# π = rule(q_raw, q_scaled, p_raw, p_scaled), each (K, V); None means exact (π = p); a targets.Rollback
# (BiLD) is verified its own way
TargetRule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class RoundStats:
    drafted: int
    accepted: int
    committed: int
    depth: int  # deepest drafted position (= drafted for a chain); drafted: a tree's nodes
    target_forwards: int
    drafter_forwards: int
    seconds: float
    draft_seconds: float = 0.0  # of `seconds`, drafting: the proposer's forwards and draws, and its catch-up
    # forward over the committed tokens (a feature drafter's `observe`, counted in drafter_forwards too)


@dataclass
class GenerationResult:
    tokens: list[int]
    prompt_length: int
    rounds: list[RoundStats] = field(default_factory=list)
    seconds: float = 0.0
    stop: str = "max_new_tokens"

    @property
    def target_forwards(self) -> int:
        return 1 + sum(r.target_forwards for r in self.rounds)  # the prefill included


def _chain_round(runner: TargetRunner, proposer: Proposer, sequence: list[int], policy: Policy, k: int,
                 sampling: SamplingConfig, rule: TargetRule | None, generator: torch.Generator | None):
    """Draft a chain, verify it in one target forward. Returns accepted draft tokens, the next
    token, the forward's outputs, and (drafted, depth, drafting seconds)."""
    bild = isinstance(rule, Rollback)
    if bild and rule.fallback is not None:
        policy = Fallback(policy, rule.fallback)  # stops after the first unsure token; dropped below
    t0 = time.perf_counter()
    draft, q, q_raw = proposer.propose(sequence, policy, k, sampling, generator)
    seconds = time.perf_counter() - t0
    if bild and len(draft):
        kept = rule.confident(q_raw)
        draft, q, q_raw = draft[:kept], q[:kept], q_raw[:kept]
    n = len(draft)
    logits, final, aux = runner.forward([sequence[-1]] + draft)  # (K+1, V)
    if sampling.greedy and rule is None:
        accepted, token = verify_greedy(torch.tensor(draft, dtype=torch.long, device=logits.device), greedy_tokens(logits))
    elif bild:
        p_raw, p = distributions(logits, sampling)
        accepted, token = rule.verify(torch.tensor(draft, dtype=torch.long, device=p.device), p_raw[:n], p, generator)
    else:
        p_raw, p = distributions(logits, sampling)
        pi = p.clone()
        if rule is not None and n:
            pi[:n] = rule(q_raw.to(p.device), q.to(p.device), p_raw[:n], p[:n])
        accepted, token = verify_chain(torch.tensor(draft, dtype=torch.long, device=p.device), q.to(p.device), pi, generator)
    runner.rollback(n - accepted)
    return draft[:accepted], token, (final, aux), (n, n, seconds)


def _tree_round(runner: TargetRunner, proposer: TreeProposer, sequence: list[int], shape: TreeShape, room: int,
                sampling: SamplingConfig, generator: torch.Generator | None, policy: Policy):
    """Draft an EAGLE-2 tree (with a prompt-lookup branch grafted on when the shape asks), verify it
    in one target forward under the tree mask, keep the accepted path's cache entries. Same returns
    as `_chain_round`, features of the path rows. `room`: drafted tokens that can still be committed.
    The policy's plan of the round (`Policy.plan_tree`) decides the depth within the shape, the nodes
    verified and the lookup tokens grafted."""
    start = runner.cached()
    shape = replace(shape, depth=min(shape.depth, room))
    plan = policy.plan_tree(shape.total_tokens + shape.lookup, lambda n: verify_seconds(runner, sequence[-1], n))
    t0 = time.perf_counter()
    tree = proposer.propose_tree(shape, plan.expand if plan.decides_depth else None)
    seconds = time.perf_counter() - t0
    tree = prune(tree, plan.keep(tree, seconds))
    drafted = len(tree)  # the drafter's nodes; a lookup branch grafted after them
    if shape.lookup:
        branch = lookup_continuation(sequence, min(shape.lookup, room))
        tree = graft(tree, branch[: plan.lookup_length(len(tree), len(branch), seconds)] if branch else branch)
    logits, final, aux = runner.forward([sequence[-1]] + tree.tokens.tolist(), tree)  # (n+1, V)
    if sampling.greedy:
        path, token = verify_tree_greedy(tree, greedy_tokens(logits))
    else:
        path, token = verify_tree(tree, distributions(logits, sampling)[1], generator)
    runner.keep_path(start, path)
    plan.verified(sum(i < drafted for i in path), len(tree) - drafted, sum(i >= drafted for i in path))
    rows = torch.tensor([0] + [1 + i for i in path], device=final.device)
    features = (final[rows], aux[rows] if aux is not None else None)
    return tree.tokens[path].tolist(), token, features, (len(tree), tree.max_depth, seconds)


def verify_seconds(runner: TargetRunner, root: int, n: int) -> float:
    """Seconds of one verification forward over `root` and a chain of n nodes under a tree mask,
    rolled back after (what the cost policy prices a tree's rows by, and a measured cost profile's rows)."""
    start, device = runner.cached(), runner.device
    chain = DraftTree(tokens=torch.full((n,), root, dtype=torch.long, device=device),
                      parents=torch.arange(-1, n - 1, device=device), depth=torch.arange(1, n + 1, device=device),
                      scores=torch.zeros(n, device=device)) if n else None
    t0 = time.perf_counter()
    logits, _, _ = runner.forward([root] * (n + 1), chain)
    float(logits[-1, 0])  # waits for a GPU to finish
    seconds = time.perf_counter() - t0
    runner.rollback(runner.cached() - start)
    return seconds


@torch.no_grad()
def generate(runner: TargetRunner, proposer: Proposer, prompt: list[int], max_new_tokens: int, policy: Policy,
             sampling: SamplingConfig = SamplingConfig(), rule: TargetRule | None = None,
             eos_token_ids: tuple[int, ...] = (), generator: torch.Generator | None = None,
             tree: TreeShape | None = None) -> GenerationResult:
    """Speculative decoding of up to `max_new_tokens` after `prompt`; returns tokens and per-round stats.

    With `tree`, each round drafts an EAGLE-2 dynamic tree (feature and block drafters) instead of
    asking `policy` for a chain; the policy's plan of each tree round (cost, specdec, disco) decides
    how deep it goes, any other drafts the full shape. Deferral rules (`rule`) apply to chain drafts.
    """
    if tree is not None and not isinstance(proposer, TreeProposer):
        raise DraftsmithError(f"tree drafting needs a feature or block drafter; {type(proposer).__name__} drafts "
                              "chains: drop --tree")
    if tree is not None and rule is not None:
        raise DraftsmithError("deferral rules (lossy verification, cascades) run on chain drafts; drop --tree")
    start = time.perf_counter()
    runner.reset()
    proposer.reset()
    logits, final, aux = runner.forward(prompt, last_logits=True)  # prefill: (1, V), (P, H)
    _, p = distributions(logits[-1], sampling)
    first = int(p.argmax()) if sampling.greedy else int(sample(p, generator))
    result = GenerationResult(tokens=[first], prompt_length=len(prompt))
    if proposer.needs_features:
        proposer.observe(prompt[1:] + [first], final, aux)
    if first in eos_token_ids:
        result.stop = "eos"
    while len(result.tokens) < max_new_tokens and result.stop != "eos":
        t0, drafter_before = time.perf_counter(), proposer.forwards
        sequence = prompt + result.tokens
        room = max_new_tokens - len(result.tokens) - 1  # drafted tokens that can still be committed
        if tree is None or room < 1:  # no room left for a draft: a chain of 0 is one plain step
            accepted, token, (final, aux), (k, depth, drafting) = _chain_round(
                runner, proposer, sequence, policy, min(policy.max_tokens(), room), sampling, rule, generator)
        else:
            accepted, token, (final, aux), (k, depth, drafting) = _tree_round(
                runner, proposer, sequence, tree, room, sampling, generator, policy)
        new = accepted + [token]
        for i, x in enumerate(new):  # EOS inside the committed tokens ends the sequence there
            if x in eos_token_ids:
                new, result.stop = new[: i + 1], "eos"
                break
        new = new[: max_new_tokens - len(result.tokens)]
        if proposer.needs_features and result.stop != "eos":  # the drafter's catch-up forward: drafting too
            t1 = time.perf_counter()
            proposer.observe(new, final[: len(new)], aux[: len(new)] if aux is not None else None)
            drafting += time.perf_counter() - t1
        policy.end_round(depth, len(accepted))
        result.tokens += new
        result.rounds.append(RoundStats(drafted=k, accepted=min(len(accepted), len(new) - 1 if new else 0),
                                        committed=len(new), depth=depth, target_forwards=1,
                                        drafter_forwards=proposer.forwards - drafter_before,
                                        seconds=time.perf_counter() - t0, draft_seconds=drafting))
    result.seconds = time.perf_counter() - start
    return result
