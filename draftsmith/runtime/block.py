"""The block proposer: DFlash and DSpark drafters draft a round's tokens in one forward.

The drafter's context keys and values (every layer's, made from the target's fused features) are
kept for every committed position but the newest: `observe` appends those of the tokens the last
round committed. A round runs one forward over the block — the pending token, then mask tokens —
and draws the drafted tokens from its slots in order: each slot's law is fixed by that forward
(DFlash), or also by the token drawn before it through DSpark's Markov bias. Each drafted token is
drawn from the distribution returned with it, so verification (a chain) is lossless as for any
proposer. A policy is asked before each token (`DraftStep.confidence`: DSpark's predicted chance that
the next token is accepted, read by the `dspark` policy). Trees: `propose_tree` grows an EAGLE-2-shaped
tree from the same one forward, each slot's top tokens under the best nodes of the slot before.

Notation: B block size, D tokens a block drafts (B − 1 or B), T context positions, H hidden, V vocab.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from draftsmith.runtime.cache import KVSlab
from draftsmith.runtime.proposers import Draft, Expand, _empty, _in_target_vocab
from draftsmith.runtime.sampling import SamplingConfig, distributions, sample
from draftsmith.runtime.steps import DraftStep, Policy
from draftsmith.runtime.tree import DraftTree, TreeShape, slot_tree


class ContextCache:
    """Every drafter layer's context keys and values: one `KVSlab` a layer (the runtime's one decoding cache),
    appended to as rounds commit tokens, never rolled back (the context holds committed tokens only)."""

    def __init__(self) -> None:
        self.layers: list[KVSlab] = []

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    def append(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The n new positions' keys and values of every layer, (1, kv, n, hd) each."""
        if not self.layers:
            self.layers = [KVSlab() for _ in layers]
        for slab, (k, v) in zip(self.layers, layers):
            slab.update(k, v)

    def view(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(slab.keys, slab.values) for slab in self.layers]


class BlockProposer:
    """Drafts with a block drafter (`models/block.py`), fed the target features verification produced."""

    def __init__(self, drafter: Any, vocab_size: int, aux_layer_ids: list[int] | None = None):
        self.drafts, self.needs_features = True, True
        self.drafter = drafter.eval()
        self.vocab_size = vocab_size
        self.aux_layer_ids = list(aux_layer_ids or [])
        self.to_target = drafter.draft_to_target
        self.draftable = self.to_target
        self.reset()

    def reset(self) -> None:
        self.cache, self.pending, self.forwards = ContextCache(), None, 0

    def enable_graphs(self, capture: bool | None = None) -> bool:
        return False  # one forward a block: drafted eagerly

    def asks_each_level(self) -> bool:
        return False  # every level of a tree comes from the block's one forward

    @torch.no_grad()
    def observe(self, next_tokens: list[int], final: torch.Tensor, aux: torch.Tensor | None) -> None:
        """The n committed tokens' features (n, k·Ht) join the context; the last token is the next anchor."""
        drafter = self.drafter
        n = len(next_tokens)
        positions = torch.arange(self.cache.length, self.cache.length + n, device=aux.device)[None]
        self.cache.append(drafter.context(drafter.project(None, aux[None].to(drafter.fc.weight.dtype)), positions))
        self.pending = next_tokens[-1]

    @torch.no_grad()
    def block(self, anchor: int) -> torch.Tensor:
        """The normed hidden states (B, H) of the block after the context, anchored at `anchor`."""
        drafter, device = self.drafter, self.drafter.fc.weight.device
        tokens = drafter.block_tokens(torch.tensor([anchor], device=device))  # (1, B)
        positions = self.cache.length + torch.arange(drafter.block_size, device=device)[None]
        visible = torch.ones(1, 1, self.cache.length, dtype=torch.bool, device=device)
        self.forwards += 1
        return drafter(tokens, positions, self.cache.view(), visible)[0]

    @torch.no_grad()
    def propose(self, sequence: list[int], policy: Policy, k: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        drafter = self.drafter
        k = min(k, drafter.drafts_per_block)
        committed, prev = len(sequence), sequence[-1]
        if k <= 0:
            return _empty(self.vocab_size)
        # DSpark's confidence in the first token comes from the block's forward, run before the policy's
        # first question (and wasted when it drafts nothing); DFlash's policies ask before running it
        hidden = self.block(prev)[drafter.first_slot:] if drafter.confidence_head is not None else None
        first = self._slot(hidden[0], prev)[1] if hidden is not None else None
        if not policy.keep_going(DraftStep(0, committed=committed, confidence=first)):
            return _empty(self.vocab_size)
        if hidden is None:
            hidden = self.block(prev)[drafter.first_slot:]  # (D, H): row j drafts token j + 1
        base = drafter.logits(hidden).float()
        tokens, scaled, raw = [], [], []
        for j in range(k):
            bias, confidence = self._slot(hidden[j], prev)
            logits = base[j] if bias is None else base[j] + bias.float()
            if j and not policy.keep_going(DraftStep(j, tokens[-1], raw[-1], hidden[j - 1], committed, confidence)):
                break
            r, s = distributions(logits, sampling)
            r, s = _in_target_vocab(r, self.to_target, self.vocab_size), _in_target_vocab(s, self.to_target, self.vocab_size)
            prev = int(s.argmax()) if sampling.greedy else int(sample(s, generator))
            tokens.append(prev)
            scaled.append(s)
            raw.append(r)
        return tokens, torch.stack(scaled), torch.stack(raw)

    @torch.no_grad()
    def propose_tree(self, shape: TreeShape, expand: Expand | None = None) -> DraftTree:
        """A tree from one block forward (`slot_tree`): slot j's law gives depth j + 1's children, DSpark's
        biased by each parent through its Markov head. `expand` is not asked: every level comes from the
        one forward, so only the nodes kept cost anything (the plan's `keep` sizes the tree)."""
        drafter = self.drafter
        shape = replace(shape, depth=min(shape.depth, drafter.drafts_per_block))
        base = drafter.logits(self.block(self.pending)[drafter.first_slot:]).float()  # (D, Vd)
        unbiased = torch.log_softmax(base, -1)  # each slot's law where no parent biases it (DFlash)

        def law(j: int, parents: torch.Tensor) -> torch.Tensor:  # (m, Vd): slot j's log-law after each parent
            bias = drafter.markov(parents)[0]
            return unbiased[j].expand(len(parents), -1) if bias is None else torch.log_softmax(base[j] + bias.float(), -1)

        return slot_tree(law(0, torch.tensor([self.pending], device=base.device))[0], law, shape, self.to_target)

    def _slot(self, hidden: torch.Tensor, prev: int) -> tuple[torch.Tensor | None, float | None]:
        """DSpark's Markov bias (Vd,) for a slot from the token before it, and the slot's confidence (the
        predicted chance that its token is accepted); None where the drafter has neither head."""
        bias, embedding = self.drafter.markov(torch.tensor(prev, device=hidden.device))
        if self.drafter.confidence_head is None:
            return bias, None
        return bias, float(torch.sigmoid(self.drafter.confidence(hidden, embedding)))
