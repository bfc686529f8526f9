"""The decoding loop: propose → verify with the target → commit → roll caches back.

Batch size 1. The target's KV cache holds every committed token but the last (the pending
one); a round feeds [pending, d_1..d_K] in one forward, verification accepts n drafted tokens
and picks one more, and the cache drops the K − n rejected entries (no recomputation). The
same forward yields the hidden states feature drafters read next round.

Notation: P prompt length, K drafted tokens, V vocab, H hidden.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from draftsmith.runtime.sampling import SamplingConfig, distributions, sample
from draftsmith.runtime.verify import verify_chain, verify_greedy

# π = rule(q_raw, q_scaled, p_raw, p_scaled), each (K, V); None means exact (π = p)
TargetRule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class RoundStats:
    drafted: int
    accepted: int
    committed: int
    tree_size: int
    target_forwards: int
    drafter_forwards: int
    seconds: float


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


class TargetRunner:
    """A transformers causal LM with its KV cache: forward, read features, roll back."""

    def __init__(self, model: Any, aux_layer_ids: list[int] | None = None):
        self.model = model.eval()
        self.decoder = model.get_decoder()
        self.head = model.get_output_embeddings()
        self.aux_layer_ids = list(aux_layer_ids or [])
        self.cache = None

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)

    @torch.no_grad()
    def forward(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Logits (n, V), final features (n, H) and fused aux (n, k*H) for n new tokens."""
        ids = torch.tensor([tokens], device=self.device)
        out = self.decoder(input_ids=ids, past_key_values=self.cache, use_cache=True,
                           output_hidden_states=bool(self.aux_layer_ids))
        final = out.last_hidden_state[0]
        aux = torch.cat([out.hidden_states[i][0] for i in self.aux_layer_ids], -1) if self.aux_layer_ids else None
        return self.head(final), final, aux

    def rollback(self, remove: int) -> None:
        if remove > 0:
            self.cache.crop(-remove)

    def cached(self) -> int:
        return self.cache.get_seq_length()


@torch.no_grad()
def generate(runner: TargetRunner, proposer: Any, prompt: list[int], max_new_tokens: int, policy: Any,
             sampling: SamplingConfig = SamplingConfig(), rule: TargetRule | None = None,
             eos_token_ids: tuple[int, ...] = (), generator: torch.Generator | None = None) -> GenerationResult:
    """Speculative decoding of up to `max_new_tokens` after `prompt`; returns tokens and per-round stats."""
    start = time.perf_counter()
    runner.reset()
    proposer.reset()
    logits, final, aux = runner.forward(prompt)  # prefill: (P, V), (P, H)
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
        max_k = min(policy.max_tokens(), max_new_tokens - len(result.tokens) - 1)
        draft, q, q_raw = proposer.propose(sequence, policy, max_k, sampling, generator)
        k = len(draft)
        logits, final, aux = runner.forward([sequence[-1]] + draft)  # (K+1, V)
        if sampling.greedy and rule is None:
            accepted, token = verify_greedy(torch.tensor(draft, dtype=torch.long, device=logits.device), logits.argmax(-1))
        else:
            p_raw, p = distributions(logits, sampling)
            pi = p.clone()
            if rule is not None and k:
                pi[:k] = rule(q_raw.to(p.device), q.to(p.device), p_raw[:k], p[:k])
            accepted, token = verify_chain(torch.tensor(draft, dtype=torch.long, device=p.device), q.to(p.device), pi, generator)
        new = draft[:accepted] + [token]
        for i, x in enumerate(new):  # EOS inside the committed tokens ends the sequence there
            if x in eos_token_ids:
                new, result.stop = new[: i + 1], "eos"
                break
        new = new[: max_new_tokens - len(result.tokens)]
        runner.rollback(k - accepted)
        if proposer.needs_features and result.stop != "eos":
            proposer.observe(new, final[: len(new)], aux[: len(new)] if aux is not None else None)
        policy.end_round(k, accepted)
        result.tokens += new
        result.rounds.append(RoundStats(drafted=k, accepted=min(accepted, len(new) - 1 if new else 0),
                                        committed=len(new), tree_size=k, target_forwards=1,
                                        drafter_forwards=proposer.forwards - drafter_before,
                                        seconds=time.perf_counter() - t0))
    result.seconds = time.perf_counter() - start
    return result
