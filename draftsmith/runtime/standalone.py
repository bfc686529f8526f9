"""A standalone draft LM as a proposer: any transformers causal LM on the target's tokenizer.

Notation: K drafted tokens, V target vocab, H hidden.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from draftsmith import DraftsmithError
from draftsmith.models.common import cache_kwargs
from draftsmith.runtime.cache import decoding_cache
from draftsmith.runtime.kernels import PackedLinears, under_packed_linears
from draftsmith.runtime.chains import Pick, causal_lm_chains
from draftsmith.runtime.proposers import Draft, _empty, _in_target_vocab
from draftsmith.runtime.sampling import SamplingConfig, distributions, sample
from draftsmith.runtime.steps import DraftStep, Policy


class ModelProposer:
    """A standalone draft LM (any transformers causal LM on the target's tokenizer).

    `head_ids` (a frequency-ranked head, as FR-Spec does): the drafter's head runs over these
    target ids only and drafts among them (q is zero elsewhere, so verification stays exact).
    On a small drafter the full head is a large share of a drafted token's cost (49k rows
    against a few layers). Only for models whose logits are a plain linear head of the
    decoder's last hidden state: that is checked once here.
    """

    def __init__(self, model: Any, vocab_size: int, head_ids: torch.Tensor | None = None, fast: bool = True):
        self.drafts, self.needs_features, self.aux_layer_ids = True, False, []
        self.model = model.eval()
        self.fast = fast
        self.vocab_size = vocab_size
        # the catch-up feed of a round needs only its last row's logits (a large head costs per row)
        accepts = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.last_row = {"logits_to_keep": 1} if accepts else {}
        self.head_ids, self.head = None, None
        if head_ids is not None and len(head_ids) < vocab_size:
            self.head_ids, self.head = head_ids.long().to(self._device()), _ranked_head(model, head_ids)
        self.draftable = self.head_ids  # target ids it can draft (None: any)
        self.linears = PackedLinears(model, *([self.head] if self.head is not None else []), enabled=fast)
        self.reset()

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def reset(self) -> None:
        self.cache = decoding_cache(self.model.config, preallocated=self.fast)
        self.cached: list[int] = []  # committed tokens whose keys are in the cache
        self.fed: list[int] = []  # drafted tokens fed after them last round
        self.forwards = 0

    def observe(self, next_tokens: list[int], final: torch.Tensor, aux: torch.Tensor | None) -> None:
        pass

    def enable_graphs(self, capture: bool | None = None) -> bool:
        return False  # a transformers model with its own cache: drafted eagerly

    @under_packed_linears
    def _next_logits(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed tokens after the cache; the logits (V, or len(head_ids)) at the last of them and the
        decoder's last hidden state (H,) they come from."""
        feed = torch.tensor([tokens], device=self._device())
        self.forwards += 1
        if self.head is None:
            out = self.model(input_ids=feed, use_cache=True, output_hidden_states=True,
                             **cache_kwargs(self.model, self.cache), **self.last_row)
            return out.logits[0, -1], out.hidden_states[-1][0, -1]
        decoder = self.model.get_decoder()
        hidden = decoder(input_ids=feed, use_cache=True, **cache_kwargs(decoder, self.cache)).last_hidden_state
        return self.head(hidden[0, -1]), hidden[0, -1]

    def _to_target(self, probs: torch.Tensor) -> torch.Tensor:
        return _in_target_vocab(probs, self.head_ids, self.vocab_size)

    @torch.no_grad()
    def teacher_forced(self, ids: list[int], final: Any = None, aux: Any = None) -> torch.Tensor:
        """Logits (P−1, V), row t for ids[t+1] (−inf outside a ranked head). Resets the proposer."""
        self.reset()
        logits = self.model(input_ids=torch.tensor([ids[:-1]], device=self._device())).logits[0].float()
        if self.head_ids is not None:
            logits = torch.full_like(logits, float("-inf")).index_copy(1, self.head_ids, logits[:, self.head_ids])
        return logits

    @torch.no_grad()
    def chains(self, ids: list[int], anchors: list[int], depth: int, pick: Pick, final: Any = None,
               aux: Any = None) -> None:
        """Draft `depth` tokens after every anchor t of `ids` at once, each chain exactly as `propose`
        drafts after ids[:t+1]; `pick` chooses each depth's tokens. Resets the proposer."""
        self.reset()
        head = self.head if self.head is not None else self.model.get_output_embeddings()
        causal_lm_chains(self.model.get_decoder(), lambda h: head(h), ids, anchors, depth,
                         lambda d, q, h: pick(d, self._to_target(q), h), self.model.config)

    @torch.no_grad()
    def propose(self, sequence: list[int], policy: Policy, k: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        # keep the keys of last round's drafts that were accepted; drop the rest. The sequence's last token
        # is fed again even when its keys are there (BiLD's rollback may commit a rejected token anew):
        # its logits are what the next draft starts from
        start = len(self.cached)
        keep = 0
        while keep < len(self.fed) and start + keep < len(sequence) - 1 and sequence[start + keep] == self.fed[keep]:
            keep += 1
        extra = self.cache.get_seq_length() - start - keep
        if extra > 0:
            self.cache.crop(-extra)
        self.cached, self.fed = list(sequence[: start + keep]), []
        committed = len(sequence)
        if k <= 0 or not policy.keep_going(DraftStep(0, committed=committed)):
            return _empty(self.vocab_size)
        logits, hidden = self._next_logits(sequence[len(self.cached):])
        self.cached = list(sequence)
        tokens, scaled, raw = [], [], []
        while True:
            r, s = distributions(logits, sampling)
            r, s = self._to_target(r), self._to_target(s)
            x = int(s.argmax()) if sampling.greedy else int(sample(s, generator))
            tokens.append(x)
            scaled.append(s)
            raw.append(r)
            if len(tokens) >= k or not policy.keep_going(DraftStep(len(tokens), x, r, hidden, committed)):
                break
            logits, hidden = self._next_logits([x])
            self.fed.append(x)
        return tokens, torch.stack(scaled), torch.stack(raw)


def _ranked_head(model: Any, head_ids: torch.Tensor) -> torch.nn.Linear:
    """The rows `head_ids` of the model's output head, after checking that the model's logits
    are exactly that head applied to its decoder's last hidden state (no soft-capping or scaling)."""
    full = model.get_output_embeddings()
    if not isinstance(full, torch.nn.Linear) or not hasattr(model, "get_decoder"):
        raise DraftsmithError(f"{type(model).__name__}: a frequency-ranked head needs a linear output head and a decoder")
    device = full.weight.device
    ids = head_ids.long().to(device)
    head = torch.nn.Linear(full.in_features, len(ids), bias=full.bias is not None, device=device, dtype=full.weight.dtype)
    with torch.no_grad():
        head.weight.copy_(full.weight[ids])
        if full.bias is not None:
            head.bias.copy_(full.bias[ids])
        probe = torch.arange(min(8, model.config.vocab_size), device=device)[None]
        expected = model(input_ids=probe).logits[0, :, ids]
        got = head(model.get_decoder()(input_ids=probe).last_hidden_state[0])
    if not torch.allclose(expected.float(), got.float(), rtol=1e-3, atol=1e-3):
        raise DraftsmithError(f"{type(model).__name__}: its logits are not a plain linear head of the decoder's "
                              "output (soft-capping or scaling?); run it with the full head (head_vocab 0)")
    return head.eval()
