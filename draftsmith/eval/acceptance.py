"""Acceptance and speed, measured the way docs/metrics.md defines them, by driving the runtime.

τ = tokens committed per target forward, averaged over rounds = accepted + 1 (the bonus or
corrected token counted); "mean accepted" leaves that token out. α_j = rounds in which draft
position j was accepted / rounds that reached position j. Speed: batch 1, the same target,
dtype, prompts and max_new_tokens for both arms; a warm-up, then repeats with the arms
alternating; medians. Speedup = method tok/s / autoregressive tok/s from the same process.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from draftsmith.eval.breakdown import by_position, round_acceptance
from draftsmith.runtime.generate import GenerationResult, TargetRule, generate
from draftsmith.runtime.runner import TargetRunner
from draftsmith.runtime.steps import Policy
from draftsmith.runtime.proposers import NoProposer, Proposer
from draftsmith.runtime.sampling import SamplingConfig, seeded


def acceptance_stats(results: list[GenerationResult]) -> dict[str, Any]:
    rounds = [r for res in results for r in res.rounds]
    stats = round_acceptance(rounds)
    if not rounds:
        return stats
    tokens = sum(len(res.tokens) for res in results)
    return {
        **stats,
        "tokens": tokens,
        "target_forwards_per_token": sum(res.target_forwards for res in results) / max(tokens, 1),
        "drafted_rejected": stats["drafted"] - stats["accepted"],
        "drafter_forwards": sum(r.drafter_forwards for r in rounds),
        "mean_tree_size": statistics.fmean(r.drafted for r in rounds),
    }


def decode_all(runner: TargetRunner, proposer: Proposer, prompts: list[list[int]], max_new_tokens: int,
               make_policy: Callable[[list[int]], Policy], sampling: SamplingConfig, eos: tuple[int, ...],
               seed: int, on_prompt: Callable[[], None] | None = None, tree: Any = None,
               rule: TargetRule | None = None) -> list[GenerationResult]:
    g = seeded(seed, runner.device)
    out = []
    for ids in prompts:
        out.append(generate(runner, proposer, ids, max_new_tokens, make_policy(ids), sampling, rule=rule,
                            eos_token_ids=eos, generator=g, tree=tree))
        if on_prompt:
            on_prompt()
    return out


def draft_vocab_coverage(results: list[GenerationResult], draftable: torch.Tensor | None) -> float | None:
    """Share of the generated tokens inside the drafter's vocabulary (None: it drafts any token).

    A pruned draft vocabulary (EAGLE-3's d2t, a standalone drafter's ranked head) can never propose
    the others, so this bounds the acceptance rate at depth 1."""
    if draftable is None:
        return None
    tokens = torch.tensor([t for r in results for t in r.tokens], dtype=torch.long)
    if not len(tokens):
        return None
    return float(torch.isin(tokens, draftable.cpu()).float().mean())


def measure(runner: TargetRunner, proposer: Proposer, prompts: list[list[int]], groups: dict[str, list[str]],
            max_new_tokens: int, make_policy: Callable[[list[int]], Policy], sampling: SamplingConfig,
            eos: tuple[int, ...], repeats: int = 3, seed: int = 0,
            progress: Callable[[str], Callable[[], None]] | None = None, tree: Any = None,
            rule: TargetRule | None = None,
            model: Callable[[list[GenerationResult], list[GenerationResult]], dict[str, Any]] | None = None
            ) -> dict[str, Any]:
    """Both arms over the same prompts, alternating, `repeats` times after a warm-up; `rule` (a lossy or
    cascade target) applies to the drafting arm only: the other is the target alone. `groups`: breakdown
    name (category, set, turn) → each prompt's label, reported as `per_<name>` (τ, α_j, speed of each
    label's prompts); `per_position` breaks the rounds down by the context length they drafted at.
    `model`: the drafting arm's generations and the target alone's → its modelled speedups
    (`eval/profile.modelled_speedups`), filed as `modelled`."""
    baseline = NoProposer(runner.head.weight.shape[0])
    arms = {"autoregressive": baseline, "method": proposer}
    trees = {"autoregressive": None, "method": tree}  # the baseline drafts nothing
    rules = {"autoregressive": None, "method": rule}
    start = time.perf_counter()
    for name, arm in arms.items():  # warm-up: first calls allocate and compile
        decode_all(runner, arm, prompts[:1], min(16, max_new_tokens), make_policy, sampling, eos, seed, tree=trees[name],
                   rule=rules[name])
    warmup = time.perf_counter() - start
    runs: dict[str, list[list[GenerationResult]]] = {"autoregressive": [], "method": []}
    for r in range(repeats):
        for name, arm in arms.items():
            tick = progress(f"{name} {r + 1}/{repeats}") if progress else None
            runs[name].append(decode_all(runner, arm, prompts, max_new_tokens, make_policy, sampling, eos, seed + r, tick,
                                         tree=trees[name], rule=rules[name]))
    speed = {}
    for name, reps in runs.items():
        rates = [sum(len(x.tokens) for x in rep) / sum(x.seconds for x in rep) for rep in reps]
        speed[name] = {"tokens_per_second": statistics.median(rates), "spread": [min(rates), max(rates)]}
    breakdowns = {}
    for group, labels in groups.items():
        breakdowns[f"per_{group}"] = per = {}
        for label in dict.fromkeys(labels):
            idx = [i for i, c in enumerate(labels) if c == label]
            rate = {name: statistics.median(sum(len(rep[i].tokens) for i in idx) / sum(rep[i].seconds for i in idx)
                                            for rep in reps) for name, reps in runs.items()}
            stats = acceptance_stats([rep[i] for rep in runs["method"] for i in idx])
            kept = ("tau", "mean_accepted", "alpha", "rounds", "drafted", "accepted")
            per[label] = {**{k: stats[k] for k in kept},
                          "tokens_per_second": rate["method"],
                          "autoregressive_tokens_per_second": rate["autoregressive"],
                          "speedup": rate["method"] / rate["autoregressive"], "prompts": len(idx)}
    method_results = [x for rep in runs["method"] for x in rep]
    alone_results = [x for rep in runs["autoregressive"] for x in rep]
    return {
        "acceptance": {**acceptance_stats(method_results),
                       "draft_vocab_coverage": draft_vocab_coverage(runs["method"][0], proposer.draftable)},
        "speed": {**speed, "speedup": speed["method"]["tokens_per_second"] / speed["autoregressive"]["tokens_per_second"],
                  "repeats": repeats, "warmup_seconds": warmup},
        **breakdowns,
        "per_position": by_position(method_results, alone_results),
        "modelled": model(method_results, alone_results) if model else {},
        "identical_outputs": all(a.tokens == b.tokens for ra, rb in zip(runs["autoregressive"], runs["method"])
                                 for a, b in zip(ra, rb)),
        "samples": [{"category": c, "tokens": x.tokens}
                    for c, x in zip(groups.get("category", [""] * len(prompts)), runs["method"][0][:3])],
        "outputs": {name: [x.tokens for x in reps[0]] for name, reps in runs.items()},  # the first repeat's text
    }

