"""Chains drafted after every anchor of a known sequence at once, one forward per depth for all of them
(what stop-head labels and their features are made of: `jobs/labels.py`, `FeatureProposer.chains`,
`ModelProposer.chains`).

Notation: n chains, H hidden, V vocab.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from draftsmith.models.common import additive_mask, cache_kwargs, grouped_query_sdpa

# Chains drafted after every anchor of a known sequence at once (labels for stop heads):
# pick(d, q_raw (n, V), hidden (n, H)) → the n tokens drafted at depth d, given the distributions they are
# drawn from and the hidden states that produced them (what a policy's DraftStep holds at position d)
Pick = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


def chain_mask(anchors: torch.Tensor, prefix: int, fed: int) -> torch.Tensor:
    """Which keys the n chains' newest tokens see, (n, prefix + n·fed) bool, when `fed` tokens of every
    chain follow a prefix block of `prefix` keys: chain a (anchored after prefix key anchors[a]) sees
    prefix keys up to its anchor and its own tokens, which sit at prefix + n·(e−1) + a for e = 1..fed."""
    n = len(anchors)
    allowed = torch.zeros(n, prefix + n * fed, dtype=torch.bool, device=anchors.device)
    allowed[:, :prefix] = torch.arange(prefix, device=anchors.device)[None] <= anchors[:, None]
    rows = torch.arange(n, device=anchors.device)
    for e in range(fed):
        allowed[rows, prefix + n * e + rows] = True
    return allowed


def feed_chains(decoder: Any, cache: Any, tokens: torch.Tensor, anchors: torch.Tensor, prefix: int, fed: int,
                gqa: bool = False) -> torch.Tensor:
    """Feed token number `fed` of every chain (n,) to a transformers decoder whose `cache` holds the
    prefix (`prefix` keys) and the chains' earlier tokens; returns its last hidden states (n, H)."""
    device = anchors.device
    allowed = chain_mask(anchors, prefix, fed)
    dtype = next(decoder.parameters()).dtype
    mask = additive_mask(allowed, dtype)
    with grouped_query_sdpa(gqa):
        return decoder(input_ids=tokens[None].to(device), position_ids=(anchors + fed)[None], attention_mask=mask[None, None],
                       use_cache=True, **cache_kwargs(decoder, cache)).last_hidden_state[0]


@torch.no_grad()
def causal_lm_chains(decoder: Any, head: Callable[[torch.Tensor], torch.Tensor], ids: list[int], anchors: list[int],
                     depth: int, pick: Pick, config: Any, gqa: bool = False) -> None:
    """Draft `depth` tokens after every anchor t of `ids` (the sequence ids[:t+1]) through a transformers
    decoder and its head, one forward per depth for all chains: the same distributions as depth
    sequential drafting steps after each prefix. `head` maps hidden states to draft logits."""
    from transformers import DynamicCache

    device = next(decoder.parameters()).device
    cache = DynamicCache(config=config)
    at = torch.tensor(anchors, device=device)
    hidden = decoder(input_ids=torch.tensor([ids], device=device), use_cache=True,
                     **cache_kwargs(decoder, cache)).last_hidden_state[0, at]  # (n, H)
    for d in range(1, depth + 1):
        tokens = pick(d, torch.softmax(head(hidden).float(), dim=-1), hidden)
        if d < depth:
            hidden = feed_chains(decoder, cache, tokens, at, len(ids), d, gqa)
