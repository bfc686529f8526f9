"""The oracle's drafts: what a drafter would draft greedily at every prefix of a reference text, for
`--policy oracle` (the greedy bound: drafting exactly the tokens the target will accept)."""

from __future__ import annotations

from typing import Any

import torch


def oracle_drafts(runner: Any, proposer: Any, reference: list[int], start: int, k: int) -> dict[int, list[int]]:
    """The drafter's greedy chain of k tokens after every prefix reference[:t+1], t ≥ start − 1: what it
    would draft in a round starting there (`Proposer.chains`, all prefixes at once). {} for no drafter."""
    if not proposer.drafts or len(reference) - 1 <= start - 1:
        return {}
    anchors = list(range(max(start - 1, 1 if proposer.needs_features else 0), len(reference) - 1))
    final = aux = None
    if proposer.needs_features:  # the target's features of the reference are the drafter's anchors
        runner.reset()
        _, final, aux = runner.forward(reference, last_logits=True)
    chosen: list[torch.Tensor] = []

    def pick(d: int, q: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        chosen.append(q.argmax(-1))
        return chosen[-1]

    proposer.chains(reference, anchors, k, pick, final, aux)
    return dict(zip(anchors, torch.stack(chosen, 1).tolist()))


def oracle_references(runner: Any, proposer: Any, ids: list[list[int]], max_new_tokens: int, k: int,
                      eos: tuple[int, ...]) -> dict[tuple[int, ...], tuple[list[int], dict[int, list[int]]]]:
    """What the oracle knows of every prompt in advance: the target's greedy text and the drafter's greedy
    chain after each of its prefixes."""
    from draftsmith.runtime.generate import generate
    from draftsmith.runtime.policies import Static
    from draftsmith.runtime.proposers import NoProposer
    from draftsmith.runtime.sampling import SamplingConfig

    out = {}
    for x in ids:
        reference = x + generate(runner, NoProposer(runner.head.weight.shape[0]), x, max_new_tokens, Static(0),
                                 SamplingConfig(), eos_token_ids=eos).tokens
        out[tuple(x)] = (reference, oracle_drafts(runner, proposer, reference, len(x), k))
    return out
