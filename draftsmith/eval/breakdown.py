"""Where τ is lost: a run's rounds broken down by the position in the context at which each drafted (the
breakdowns by prompt set, category and turn are `acceptance.measure`'s).

Every breakdown partitions the same rounds: summed over its groups, rounds, drafted and accepted tokens
are the run's own. A group's τ and α_j are computed as the whole run's are (`round_acceptance`).
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

POSITION_EDGES = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)  # context lengths, in tokens


def round_acceptance(rounds: list[Any]) -> dict[str, Any]:
    """τ, mean accepted, α_j by draft position and the counts of a set of rounds (`RoundStats`)."""
    if not rounds:
        return {"rounds": 0, "tau": 1.0, "mean_accepted": 0.0, "alpha": [], "histogram": {}, "drafted": 0,
                "accepted": 0, "committed": 0, "seconds": 0.0}
    depth = max(r.depth for r in rounds)
    reached, accepted_at = [0] * depth, [0] * depth
    for r in rounds:  # a tree's position j is its depth j+1: judged when the path reached depth j
        for j in range(min(r.depth, r.accepted + 1)):  # position j is judged when all before it passed
            reached[j] += 1
            accepted_at[j] += j < r.accepted
    return {
        "rounds": len(rounds),
        "tau": statistics.fmean(r.accepted + 1 for r in rounds),
        "mean_accepted": statistics.fmean(r.accepted for r in rounds),
        "alpha": [a / n if n else None for a, n in zip(accepted_at, reached)],
        "histogram": {str(k): v for k, v in sorted(Counter(r.accepted for r in rounds).items())},
        "drafted": sum(r.drafted for r in rounds),
        "accepted": sum(r.accepted for r in rounds),
        "committed": sum(r.committed for r in rounds),
        "seconds": sum(r.seconds for r in rounds),
    }


def _size(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens >= 1024 else str(tokens)


def position_bucket(position: int) -> str:
    """The context-length bucket of a position: <512, 512–1k, 1k–2k, 2k–4k, ... ≥128k."""
    low = 0
    for edge in POSITION_EDGES:
        if position < edge:
            return f"<{_size(edge)}" if low == 0 else f"{_size(low)}–{_size(edge)}"
        low = edge
    return f"≥{_size(low)}"


def round_positions(result: Any) -> list[int]:
    """The context length at which each round of a generation (`GenerationResult`) drafted: its prompt, the
    token the prefill chose and every token committed before the round."""
    at = result.prompt_length + len(result.tokens) - sum(r.committed for r in result.rounds)
    out = []
    for r in result.rounds:
        out.append(at)
        at += r.committed
    return out


def by_position(results: list[Any], alone: list[Any] = ()) -> dict[str, dict[str, Any]]:
    """Each context-length bucket that holds rounds → their acceptance, the buckets in order of length. With
    `alone` (the target alone's generations of the same prompts), each bucket's decoding speedup too: tokens
    committed a second by its rounds against the target alone's rounds in the same bucket (prefills left out,
    which both arms pay)."""
    groups: dict[int, list[Any]] = {}
    for result in results:
        for at, r in zip(round_positions(result), result.rounds):
            groups.setdefault(at, []).append(r)
    buckets: dict[str, list[Any]] = {}
    for at in sorted(groups):
        buckets.setdefault(position_bucket(at), []).extend(groups[at])
    out = {name: round_acceptance(rounds) for name, rounds in buckets.items()}
    base = by_position(alone) if alone else {}
    for name, g in out.items():
        if name in base and g["seconds"] and base[name]["seconds"]:
            g["speedup"] = (g["committed"] / g["seconds"]) / (base[name]["committed"] / base[name]["seconds"])
    return out
