"""Who drafts: a feature drafter or nobody (autoregressive decoding); a standalone draft LM's proposer
is `runtime/standalone.py`.

Every proposer returns the drafted tokens with the distributions they were drawn from, in the
target's vocabulary: q_scaled (the sampling law, one-hot when greedy) for the acceptance
ratio and q_raw (softmax of the logits) for deferral rules and policies.

Notation: K drafted tokens, V target vocab, H hidden, n newly committed anchors.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import torch

from draftsmith.models.common import KVBuffer, grouped_query_sdpa
from draftsmith.runtime.cache import KVSlab
from draftsmith.runtime.chains import Pick, chain_mask
from draftsmith.runtime.kernels import PackedLinears, under_packed_linears
from draftsmith.runtime.steps import DraftStep, Policy, TreeLevel
from draftsmith.runtime.sampling import SamplingConfig, distributions, sample
from draftsmith.runtime.tree import DraftTree, TreeLevels, TreeShape, slot_tree

Draft = tuple[list[int], torch.Tensor, torch.Tensor]  # tokens, q_scaled (K, V), q_raw (K, V)


class Proposer(Protocol):
    """Who drafts. `drafts`: False for plain decoding (nothing is ever drafted), and then it has no
    `chains` or `teacher_forced` distribution; `needs_features`: fed the target's hidden states (`observe`) after every round;
    `aux_layer_ids`: the target layers it reads besides the final one; `draftable`: the target ids
    it can draft (None: any); `forwards`: drafter forward passes since `reset`."""

    drafts: bool
    needs_features: bool
    aux_layer_ids: list[int]
    draftable: torch.Tensor | None
    forwards: int

    def reset(self) -> None:
        """Forget the previous sequence (a new generation starts)."""
        ...

    def observe(self, next_tokens: list[int], final: torch.Tensor, aux: torch.Tensor | None) -> None:
        """The tokens committed last round with their target features (n, H) and fused aux (n, k*Ht)."""
        ...

    def propose(self, sequence: list[int], policy: Policy, k: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        """Draft up to k tokens after `sequence`, asking `policy` before each."""
        ...

    def enable_graphs(self, capture: bool | None = None) -> bool:
        """Replay the drafter's forwards from CUDA graphs (runtime/graphs.py) where this proposer can; whether
        it does (plain decoding, standalone, block and parallel drafters draft eagerly)."""
        ...


# expand(the tree so far) → whether to draft its next level (a tree plan's expand)
Expand = Callable[[TreeLevel], bool]


@runtime_checkable
class TreeProposer(Proposer, Protocol):
    """A proposer that can also draft EAGLE-2 trees."""

    def propose_tree(self, shape: TreeShape, expand: Expand | None = None) -> DraftTree:
        ...

    def asks_each_level(self) -> bool:
        """Whether `propose_tree` asks `expand` before each level after the first (a drafter forward a level);
        False where one forward gives every level (P-EAGLE, the block drafters): a stop rule cannot size
        those trees."""
        ...


def levels_asked(proposer: Proposer) -> bool:
    """Whether a stop rule can set the depth of `proposer`'s trees (`TreeProposer.asks_each_level`)."""
    return isinstance(proposer, TreeProposer) and proposer.asks_each_level()


def _empty(v: int) -> Draft:
    return [], torch.zeros(0, v), torch.zeros(0, v)


def _in_target_vocab(probs: torch.Tensor, ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Distributions (..., n) over the target ids `ids` (None: already the full vocabulary) as (..., V), zero elsewhere."""
    if ids is None:
        return probs
    out = torch.zeros(*probs.shape[:-1], vocab_size, dtype=probs.dtype, device=probs.device)
    return out.index_copy(probs.dim() - 1, ids, probs)


class NoProposer:
    """Plain autoregressive decoding: nothing is drafted."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.drafts, self.needs_features, self.aux_layer_ids, self.draftable = False, False, [], None
        self.forwards = 0

    def reset(self) -> None:
        self.forwards = 0

    def observe(self, next_tokens: list[int], final: torch.Tensor, aux: torch.Tensor | None) -> None:
        pass

    def propose(self, sequence: list[int], policy: Policy, k: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        return _empty(self.vocab_size)

    def enable_graphs(self, capture: bool | None = None) -> bool:
        return False


class FeatureProposer:
    """EAGLE / HASS / EAGLE-3 drafters, fed the target hidden states verification produced.

    The drafter's KV buffer holds one entry per real anchor t (made from target features);
    drafted steps append speculative entries that `observe` crops away before feeding the
    anchors the last verification confirmed.
    """

    def __init__(self, drafter: Any, vocab_size: int, aux_layer_ids: list[int] | None = None, fast: bool = True):
        self.drafts, self.needs_features = True, True
        self.drafter = drafter.eval()
        self.fast = fast  # False: transformers' linears and a concatenating KV buffer (the reference the benchmarks time)
        self.linears = PackedLinears(drafter, enabled=fast)  # packed weights: runtime/kernels.py
        self.vocab_size = vocab_size
        self.aux_layer_ids = list(aux_layer_ids or [])
        self.to_target = drafter.draft_to_target  # None: the drafter speaks the full vocabulary
        self.draftable = self.to_target  # target ids it can draft (None: any)
        self.gqa = drafter.fc.weight.device.type == "cpu"  # see grouped_query_sdpa
        self.parallel = drafter.parallel  # P-EAGLE: tokens 2..K from one forward on mask inputs
        self.graphs = None  # DrafterGraphs once enable_graphs is called
        self.reset()

    @property
    def forward(self) -> Callable[..., torch.Tensor]:
        """What each drafter forward calls: the drafter, or its graphs once enabled."""
        return self.drafter if self.graphs is None else self.graphs

    def asks_each_level(self) -> bool:
        return not self.parallel

    def enable_graphs(self, capture: bool | None = None) -> bool:
        """Run the drafter's forwards on a fixed-capacity KV slab, replayed from CUDA graphs on a GPU
        (runtime/graphs.py); on a CPU the same fixed-shape forwards run eagerly. P-EAGLE's parallel steps
        draft eagerly: nothing to switch (False)."""
        from draftsmith.runtime.graphs import DrafterGraphs

        if self.parallel:
            return False
        self.graphs = DrafterGraphs(self.drafter, capture=capture)
        self.reset()
        return True

    def reset(self) -> None:
        if self.graphs is not None:
            self.graphs.reset()
            cache = self.graphs.cache
        else:
            cache = KVSlab() if self.fast else KVBuffer()
        self.cache, self.anchors, self.hidden, self.forwards = cache, 0, None, 0

    @torch.no_grad()
    @under_packed_linears
    def observe(self, next_tokens: list[int], final: torch.Tensor, aux: torch.Tensor | None) -> None:
        """Feed n real anchors: tokens x_{t+1} (n,), their target features (n, H) and (n, k*Ht)."""
        self.cache.crop(self.anchors)
        n = len(next_tokens)
        dtype = self.drafter.fc.weight.dtype
        feature = self.drafter.project(final[None].to(dtype), aux[None].to(dtype) if aux is not None else None)
        positions = torch.arange(self.anchors, self.anchors + n, device=final.device)[None]
        tokens = torch.tensor([next_tokens], device=final.device)
        with grouped_query_sdpa(self.gqa and n > 1):
            out = self.forward(tokens, feature, positions, self._after_anchors(n, final.device), self.cache)  # (1, n, H)
        self.anchors += n
        self.hidden = out[:, -1:]
        self.forwards += 1
        return out

    def _after_anchors(self, n: int, device: torch.device) -> torch.Tensor:
        """(1, 1, n, anchors + n): n new entries see every real anchor and, causally, each other."""
        mask = torch.ones(n, self.anchors + n, dtype=torch.bool, device=device)
        mask[:, self.anchors:] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        return mask[None, None]

    @torch.no_grad()
    def teacher_forced(self, ids: list[int], final: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        """Logits (P−1, V), row t for ids[t+1], with the target's features of `ids` (P, H) as anchors (row 0,
        which no anchor predicts, is NaN; −inf where the drafter cannot draft). Resets the proposer."""
        self.reset()
        out = self.observe(ids[1:-1], final[:-2], aux[:-2] if aux is not None else None)  # anchor t predicts ids[t+2]
        logits = self.drafter.logits(out)[0].float()
        if self.to_target is not None:
            logits = torch.full((len(logits), self.vocab_size), float("-inf"), device=logits.device).index_copy(
                1, self.to_target, logits)
        return torch.cat([torch.full((1, logits.shape[1]), float("nan"), device=logits.device), logits])

    @torch.no_grad()
    @under_packed_linears
    def chains(self, ids: list[int], anchors: list[int], depth: int, pick: Pick, final: torch.Tensor,
               aux: torch.Tensor | None) -> None:
        """Draft `depth` tokens after every anchor t ≥ 1 of `ids` at once, each chain exactly as `propose`
        drafts after ids[:t+1] (its later tokens read the drafter's own hidden states), with the target's
        features of `ids` (P, H) as the real anchors. `pick` chooses each depth's tokens. Resets the proposer."""
        self.reset()
        out = self.observe(ids[1:], final[:-1], aux[:-1] if aux is not None else None)[0]  # row r predicts ids[r+2]
        at = torch.tensor(anchors, device=out.device)
        if len(at) and int(at.min()) < 1:
            raise ValueError("a feature drafter's chains start after at least one anchor (t >= 1)")
        hidden, prefix = out[at - 1], self.anchors  # the state that drafts the token after ids[t]
        for d in range(1, depth + 1):
            tokens = pick(d, self._to_target(torch.softmax(self.drafter.logits(hidden[None])[0].float(), dim=-1)), hidden)
            if d == depth:
                break
            mask = chain_mask(at - 1, prefix, d)[None, None]
            inputs = self.drafter.mask_inputs(1, len(at)) if self.parallel else (tokens[None].to(out.device), hidden[None])
            with grouped_query_sdpa(self.gqa and len(at) > 1):
                hidden = self.forward(*inputs, (at - 1 + d)[None], mask, self.cache)[0]
        self.reset()

    def _to_target(self, probs: torch.Tensor) -> torch.Tensor:
        return _in_target_vocab(probs, self.to_target, self.vocab_size)

    @torch.no_grad()
    @under_packed_linears
    def propose(self, sequence: list[int], policy: Policy, k: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        if self.parallel:
            return self._parallel(sequence, policy, k, sampling, generator)
        if self.graphs is not None and policy.fixed_length:
            if min(k, policy.max_tokens()) <= 0:
                return _empty(self.vocab_size)
            tokens, scaled, raw = self._fixed_chain(min(k, policy.max_tokens()), sampling, generator)
            return tokens.tolist(), scaled, raw
        tokens, scaled, raw = [], [], []
        hidden, committed = self.hidden, len(sequence)  # hidden (1, 1, H): the state that drafts the next token
        step = DraftStep(0, hidden=hidden[0, 0], committed=committed)
        while len(tokens) < k and policy.keep_going(step):
            r, s = self._next(hidden, sampling)
            x = int(s.argmax()) if sampling.greedy else int(sample(s, generator))
            tokens.append(x)
            scaled.append(s)
            raw.append(r)
            step = DraftStep(len(tokens), x, r, hidden[0, 0], committed)
            if len(tokens) < k:  # the next step reads (embed(x), own hidden) one position on
                position = torch.tensor([[self.anchors - 1 + len(tokens)]], device=hidden.device)
                keys = self.cache.get_seq_length() + 1
                mask = torch.ones(1, 1, 1, keys, dtype=torch.bool, device=hidden.device)
                hidden = self.forward(torch.tensor([[x]], device=hidden.device), hidden, position, mask, self.cache)
                self.forwards += 1
        if not tokens:
            return _empty(self.vocab_size)
        return tokens, torch.stack(scaled), torch.stack(raw)

    def _parallel(self, sequence: list[int], policy: Policy, k: int, sampling: SamplingConfig,
                  generator: torch.Generator | None) -> Draft:
        """P-EAGLE: token 1 from the last anchor's state, tokens 2..k from one forward over k − 1 mask positions
        (`_after_anchors`); none reads a drafted token, so each token's law is fixed before any is drawn."""
        tokens, scaled, raw, committed, hidden = [], [], [], len(sequence), self.hidden[0]  # (1, H): drafts token 1
        step = DraftStep(0, hidden=hidden[0], committed=committed)
        while len(tokens) < k and policy.keep_going(step):
            if len(tokens) == 1:  # the rest of the draft, in one forward
                hidden = self._parallel_states(k)
            r, s = self._next(hidden[len(tokens)][None, None], sampling)
            x = int(s.argmax()) if sampling.greedy else int(sample(s, generator))
            tokens.append(x)
            scaled.append(s)
            raw.append(r)
            step = DraftStep(len(tokens), x, r, hidden[len(tokens) - 1], committed)
        if not tokens:
            return _empty(self.vocab_size)
        return tokens, torch.stack(scaled), torch.stack(raw)

    def _parallel_states(self, k: int) -> torch.Tensor:
        """P-EAGLE: the states (k, H) that draft tokens 1..k — the last anchor's, then those of one forward over
        k − 1 mask positions after the anchors (their keys go to the buffer; `observe` crops them away)."""
        hidden = self.hidden[0]  # (1, H)
        if k > 1:
            inputs, m = self.drafter.mask_inputs(1, k - 1), k - 1
            positions = self.anchors + torch.arange(m, device=hidden.device)[None]
            with grouped_query_sdpa(self.gqa and m > 1):
                rest = self.forward(*inputs, positions, self._after_anchors(m, hidden.device), self.cache)[0]
            self.forwards += 1
            hidden = torch.cat([hidden, rest])
        return hidden

    def _next(self, hidden: torch.Tensor, sampling: SamplingConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """The raw and scaled distributions (V,) over the target's vocabulary that the state (1, 1, H) gives
        the next drafted token."""
        r, s = distributions(self.drafter.logits(hidden)[0, 0], sampling)
        return self._to_target(r), self._to_target(s)

    def _fixed_chain(self, k: int, sampling: SamplingConfig, generator: torch.Generator | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`propose`'s chain of k ≥ 1 tokens (a static policy) at fixed shapes: each token is taken (greedy) or
        drawn (`sample`, which reads nothing back) on the device, so the whole chain is one CUDA graph on a
        GPU (DrafterGraphs.fixed). Run eagerly it draws what `propose` draws from the same generator. Tokens
        (k,) on the device, q_scaled and q_raw (k, V)."""
        draws = None if sampling.greedy else self.graphs.draws(generator)

        def chain(anchors: torch.Tensor, root: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], int]:
            hidden, tokens, scaled, raw = root[None], [], [], []
            for drafted in range(1, k + 1):
                r, s = self._next(hidden, sampling)
                tokens.append(s.argmax() if sampling.greedy else sample(s, draws))  # kept on the device
                scaled.append(s)
                raw.append(r)
                if drafted < k:  # the next step reads (embed(x), own hidden) one position on
                    hidden = self.graphs.chain_step(tokens[-1].view(1, 1), hidden, anchors, drafted)
            return (torch.stack(tokens), torch.stack(scaled), torch.stack(raw)), k - 1

        drafted = self.graphs.fixed(("chain", k, sampling), self.anchors, self.hidden[0], k - 1, chain, draws)
        self.forwards += k - 1
        return drafted

    @torch.no_grad()
    @under_packed_linears
    def propose_tree(self, shape: TreeShape, expand: Expand | None = None) -> DraftTree:
        """An EAGLE-2 dynamic tree: expand the `topk` best frontier nodes per level in one drafter
        forward each; every expanded node's keys go to the buffer after the real anchors and are
        seen only by its descendants. `observe` crops them away next round. `expand`, asked before
        each level after the first, may stop the tree short of `shape.depth`.

        The tree is built on the drafter's device: candidates, scores and which expanded nodes are
        each candidate's ancestors are tensors, so no level waits for the host; only `expand` reads
        values. With graphs enabled and no `expand`, the whole tree is drafted at fixed shapes, and on
        a GPU recorded once per tree shape and replayed as one CUDA graph (DrafterGraphs.fixed).

        P-EAGLE draws every level from one forward (`_parallel_states`, `slot_tree`): its later tokens do not
        read the tokens before them, so every node of a level has the same children's law, and `expand` is
        not asked (a level costs nothing; the plan's `keep` sizes the tree)."""
        if self.parallel:
            logp = self._tree_logp(self._parallel_states(shape.depth))  # (depth, V or Vd)
            return slot_tree(logp[0], lambda j, parents: logp[j].expand(len(parents), -1), shape, self.to_target)
        if self.graphs is not None and expand is None:
            def fixed_levels(anchors: torch.Tensor, root: torch.Tensor) -> tuple[tuple[DraftTree, int], int]:
                def level(tokens, hidden, seen, expanded, depth):
                    with grouped_query_sdpa(self.gqa and tokens.shape[1] > 1):
                        return self.graphs.tree_level(tokens, hidden, anchors, seen, expanded, depth)
                tree, expanded, levels = self._draft_tree(shape, None, root, level)
                return (tree, levels), expanded

            tree, levels = self.graphs.fixed(shape, self.anchors, self.hidden[0], (shape.depth - 1) * shape.topk,
                                             fixed_levels)
            self.forwards += levels
            return tree
        anchors, device = self.anchors, self.hidden.device

        def level(tokens, hidden, seen, expanded, depth):
            m = tokens.shape[1]
            mask = torch.cat([torch.ones(m, anchors, dtype=torch.bool, device=device), seen[:, : expanded + m]], 1)
            positions = torch.full((1, m), anchors - 2 + depth, device=device)  # a node at depth d sits at anchors-1+d
            with grouped_query_sdpa(self.gqa and m > 1):
                return self.forward(tokens, hidden, positions, mask[None, None], self.cache)[0]

        tree, _, levels = self._draft_tree(shape, expand, self.hidden[0], level)
        self.forwards += levels
        return tree

    def _draft_tree(self, shape: TreeShape, expand: Expand | None, root: torch.Tensor,
                    level: Callable[..., torch.Tensor]) -> tuple[DraftTree, int, int]:
        """The tree's levels from the state `root` (1, H) that predicts the root's children; `level(tokens
        (1, m), parent states (1, m, H), seen (m, E_max), expanded, depth)` runs the drafter on m expanded
        nodes (seen: which expanded nodes each one sees, itself included, as buffer entries after the
        anchors) and returns their states (m, H). Returns the tree, the nodes expanded, the levels run."""
        levels = TreeLevels(root, (shape.depth - 1) * shape.topk)
        frontier = levels.add_children(self._tree_logp(root), shape.topk, None, self.to_target)
        run = 0
        for depth in range(2, shape.depth + 1):
            order = torch.sort(frontier.scores, descending=True, stable=True).indices[: shape.topk]
            if expand is not None and not expand(levels.level(depth - 1, frontier, order)):
                break
            m, e = order.shape[0], levels.expanded
            seen = frontier.ancestors[order]  # (m, E_max): the expanded nodes each new row sees ...
            # ... itself too. A device tensor, not `= True`: PyTorch writes a Python scalar into a CUDA tensor
            # by a copy from the host, which a CUDA graph cannot record (and the meta device does not show)
            seen[:, e: e + m] = torch.eye(m, dtype=torch.bool, device=seen.device)
            out = level(frontier.tokens[order][None], frontier.states[frontier.rows[order]][None], seen, e, depth)
            run += 1
            levels.expand(order, out)
            frontier = levels.add_children(self._tree_logp(out), shape.topk, (frontier, order, seen), self.to_target)
        return levels.tree(shape.total_tokens), levels.expanded, run

    def _tree_logp(self, hidden: torch.Tensor) -> torch.Tensor:
        """(m, H) drafter states → the log-distributions (m, V or Vd) they give the next tokens."""
        return torch.log_softmax(self.drafter.logits(hidden[None])[0].float(), dim=-1)
