"""The target in the decoding loop: a transformers causal LM with its KV cache, run forward over new
tokens (a chain, or a draft tree under its mask), its features read as it runs, rolled back after
verification.

Notation: n new tokens, V vocab, H hidden, k aux layers.
"""

from __future__ import annotations

from typing import Any

import torch

from draftsmith import DraftsmithError
from draftsmith.models.common import cache_kwargs, grouped_query_sdpa, logit_softcap, soft_cap
from draftsmith.models.target import capture_hidden_states
from draftsmith.runtime.cache import DEFAULT_CAPACITY, decoding_cache
from draftsmith.runtime.kernels import DecodeAttention, PackedLinears
from draftsmith.runtime.tree import DraftTree, tree_attention_masks


COMPILE_MODES = {True: "cached", "cached": "cached", "frozen": "frozen"}  # TargetRunner(compile=...)


class TargetRunner:
    """A transformers causal LM with its KV cache: forward, read features, roll back."""

    def __init__(self, model: Any, aux_layer_ids: list[int] | None = None, gqa: bool | None = None,
                 fast: bool = True, compile: bool | str = False, graphs: bool = False,
                 capacity: int = DEFAULT_CAPACITY, capture: bool | None = None, compile_blocks: bool = False):
        self.model = model.eval()
        self.decoder = model.get_decoder()
        self.head = model.get_output_embeddings()
        self.text_config = model.config.get_text_config()
        self.softcap = logit_softcap(self.text_config)  # Gemma 2's: the logits the target's own forward returns
        self.aux_layer_ids = list(aux_layer_ids or [])
        self.cache = None
        # grouped-query attention without copying K/V per head group (see grouped_query_sdpa); on a
        # GPU a masked GQA call would leave the fused kernels, so there transformers' default stands
        # (with `graphs`, folded into rows on a GPU too: below)
        self.gqa = (graphs or self.device.type == "cpu") if gqa is None else gqa
        # `fast`: preallocated KV slabs (runtime/cache.py) and, on a CPU, prepacked linear weights (runtime/kernels.py);
        # False gives transformers' DynamicCache and nn.Linear as they are (the reference the benchmarks time)
        self.fast = fast
        # `compile`: the decoder runs through torch.compile (inductor). Each kind of forward (a prefill, one
        # token, several, a tree under its mask) compiles at its first call, for any length.
        #   True or "cached": the decoder's own packed linears traced as an opaque operator (kernels.py), the
        #     weights inputs of the graph: inductor's caches keep the graphs, and a later process loads them.
        #   "frozen": the weights frozen into the graph, as the target never trains here; inductor packs them
        #     itself (the decoder's packed linears serve only eager forwards). Inductor never stores a frozen
        #     graph, so every process compiles anew. (The two modes' steps and compile times: docs/runtime.md.)
        self.compile_mode = COMPILE_MODES.get(compile) if compile else None
        if compile and self.compile_mode is None:
            raise DraftsmithError(f"compile must be true, false, frozen or cached, got {compile!r}")
        self.decoder_call = torch.compile(self.decoder.forward, dynamic=True) if self.compile_mode else self.decoder
        self.linears = PackedLinears(self.decoder, enabled=fast)
        self.head_linears = PackedLinears(self.head, enabled=fast)
        self.attention = DecodeAttention(model, enabled=fast and self.gqa)  # grouped query heads folded into rows
        self.bool_masks = getattr(model.config, "_attn_implementation", None) == "sdpa"
        # `graphs`: every forward over fixed-capacity KV slabs and, on a GPU (`capture`), replayed from a CUDA
        # graph per row count (runtime/graphs.py); `compile_blocks`: the decoder layers' norms and MLPs
        # compiled and recorded into those graphs as fused kernels. On a GPU a masked attention then folds the
        # query heads that share a key/value head into rows (`gqa`), sparing a copy of the slab per head.
        self.graphs = None
        if graphs:
            from draftsmith.runtime.graphs import FixedForwards, compile_blocks as compile_decoder_blocks

            if compile_blocks:
                compile_decoder_blocks(self.decoder)
            self.graphs = FixedForwards(self, capacity, capture)
        elif compile_blocks:
            raise DraftsmithError("compile_blocks compiles the blocks recorded into CUDA graphs: set graphs=True too")

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    def compiling(self) -> Any:
        """What a forward runs under: an eager or "cached" decoder its packed linears, a frozen one
        inductor's settings while it may compile (weights frozen into the graph)."""
        if self.compile_mode != "frozen":
            return self.linears
        import torch._inductor.config as inductor

        return inductor.patch(freezing=True)

    def reset(self) -> None:
        self.cache = self.graphs.reset() if self.graphs else decoding_cache(self.model.config, preallocated=self.fast)

    @torch.no_grad()
    def forward(self, tokens: list[int], tree: DraftTree | None = None,
                last_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Logits (n, V), final features (n, H) and fused aux (n, k*H) for n new tokens; with a
        tree, tokens = [root, nodes...] under the tree mask at positions cached + depth. With
        `last_logits` the head runs on the last row only (a prefill: logits (1, V))."""
        if self.graphs:
            return self.graphs.forward(tokens, tree, last_logits)
        ids = torch.tensor([tokens], device=self.device)
        extra = {}
        if tree is not None:
            cached = self.cached()
            depth = torch.cat([tree.depth.new_zeros(1), tree.depth]).to(self.device)
            mask = tree_attention_masks(tree, cached, self.text_config, None if self.bool_masks else self.head.weight.dtype)
            mask = {k: m.to(self.device) for k, m in mask.items()} if isinstance(mask, dict) else mask.to(self.device)
            extra = {"attention_mask": mask, "position_ids": (cached + depth)[None]}
        return self.decode(ids, last_logits, **extra)

    def decode(self, ids: torch.Tensor, last_logits: bool = False,
               **extra: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The decoder and head over ids (1, n) on the cache (`extra`: the decoder's mask and positions),
        with the aux layers read as it runs: logits, final features and fused aux, as `forward` returns."""
        with capture_hidden_states(self.decoder, self.aux_layer_ids) as captured, \
                grouped_query_sdpa(self.gqa and ids.shape[1] > 1 and not self.fast), self.attention, self.head_linears, \
                self.compiling():
            out = self.decoder_call(input_ids=ids, use_cache=True, **cache_kwargs(self.decoder, self.cache),
                                    output_hidden_states=captured.fallback, **extra)
            final = out.last_hidden_state[0]
            logits = self.logits(final[-1:] if last_logits else final)
        hidden = captured.collect(out)
        aux = torch.cat([hidden[i][0] for i in self.aux_layer_ids], -1) if self.aux_layer_ids else None
        return logits, final, aux

    def logits(self, final: torch.Tensor) -> torch.Tensor:
        """The target's logits from its final features: its head, then its logit soft-cap if it has one."""
        return soft_cap(self.head(final), self.softcap)

    def rollback(self, remove: int) -> None:
        if remove > 0:
            self.cache.crop(-remove)

    def keep_path(self, start: int, path: list[int]) -> None:
        """After a tree forward from `start` cached positions: keep the root and the accepted nodes.
        The path's entries move up to follow the root (a few rows per layer) and the rest is cropped;
        nothing else of the cache is copied."""
        if any(getattr(layer, "is_sliding", False) or not hasattr(layer, "keys") for layer in self.cache.layers):
            raise DraftsmithError("tree drafting needs a full-attention KV cache; use chain drafting for this target")
        nodes = self.cached() - start - 1
        if path != list(range(len(path))):  # node i sits at start + 1 + i
            source = torch.tensor([start + 1 + i for i in path], device=self.device)
            rows = slice(start + 1, start + 1 + len(path))
            for layer in self.cache.layers:
                layer.keys[..., rows, :] = layer.keys.index_select(-2, source)
                layer.values[..., rows, :] = layer.values.index_select(-2, source)
        self.rollback(nodes - len(path))

    def cached(self) -> int:
        return self.cache.get_seq_length()
