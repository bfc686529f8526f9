"""Target and drafter forwards replayed from CUDA graphs.

At batch 1 on a GPU a decoding step is short (an 8B model's weights stream in milliseconds) and made of
hundreds of small kernels, about fifteen a layer; launched one by one from Python, the launches
take longer than the GPU's work. A CUDA graph records a forward's kernels once and replays them
with one launch. A graph fixes every shape and address, so here:

- each layer's keys and values live in a zeroed slab of fixed capacity (runtime/cache.py's `KVSlab`,
  owned by the forwards), written at the slots the runner puts in a device tensor; attention reads
  the whole slab under a mask that hides the positions not in the sequence (stale rows after a
  rollback, unwritten ones);
- each row count n (1 for a plain step, K + 1 for a chain, nodes + 1 for a tree) has its own graph,
  captured at its first use; its inputs (token ids, positions, write slots, the mask) are buffers
  the runner fills before a replay, and its outputs (logits, final and fused aux features) are
  buffers copied out after. A chain and a tree of the same row count share one graph: the mask is
  an input;
- rollback moves a length and keeping a tree path copies a few rows per layer, as with the slab
  cache of runtime/cache.py; only the prefill runs eagerly (its length differs per prompt).

The feature drafter's forwards get the same treatment (`DrafterGraphs`, which `FeatureProposer.
enable_graphs` switches on): its KV buffer is a fixed slab too, and each row count it is fed (the
accepted anchors, one drafted token, a tree level's expanded nodes) has its own graph; a prompt's
anchors (more than `MAX_GRAPH_ROWS`) run eagerly on the same slab.

When a sequence outgrows the capacity the slabs are reallocated at twice the size and the graphs
captured again. Where CUDA graphs are not available (a CPU) the same fixed-shape forwards run
eagerly; that is what the tests compare against the plain runtime and against recomputation.

Notation: n rows in a forward, C slab capacity, S cached positions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from draftsmith import DraftsmithError
from draftsmith.models.common import additive_mask
from draftsmith.runtime.cache import DEFAULT_CAPACITY, KVSlab
from draftsmith.runtime.tree import DraftTree, tree_attention_mask

ALIGN = 64  # capacities are multiples of this (attention kernels want aligned mask rows)
MAX_GRAPH_ROWS = 128  # a drafter fed more rows at once (a prompt's anchors) runs eagerly


class Recorded:
    """CUDA graphs by key (a row count), sharing one memory pool."""

    def __init__(self, device: torch.device):
        self.device, self.graphs, self.pool = device, {}, None

    def clear(self) -> None:
        self.graphs.clear()
        self.pool = None

    def replay(self, key: Any, run: Callable[[], Any], generator: torch.Generator | None = None) -> Any:
        """Replay `key`'s graph and return its output buffers; the first time, record `run` (after one
        eager warm-up on a side stream, which writes the same cache rows the replay does). `generator`:
        a CUDA generator `run` draws from, registered with the graph so that every replay draws anew
        from it (torch's default generator needs no registering)."""
        entry = self.graphs.get(key)
        if entry is None:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                run()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            if generator is not None:
                graph.register_generator_state(generator)
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = run()
            self.pool = graph.pool()
            entry = self.graphs[key] = (graph, outputs)
        entry[0].replay()
        return entry[1]


def _reserve(owner: Any, length: int, layers: list[KVSlab]) -> None:
    """Room for `length` positions in `owner`'s slabs: when outgrown, twice the size (or `length`), and
    the input buffers and graphs, which hold the old slabs' addresses and mask width, made again."""
    if length <= owner.capacity:
        return
    owner.capacity = _aligned(max(length, 2 * owner.capacity))
    for layer in layers:
        layer.grow(owner.capacity)
    owner.inputs.clear()
    owner.recorded.clear()


def _check_capture(capture: bool | None, device: torch.device) -> bool:
    capture = device.type == "cuda" if capture is None else capture
    if capture and device.type != "cuda":
        raise DraftsmithError(f"CUDA graphs need the model on a GPU; it is on {device}")
    return capture


@dataclass
class Inputs:
    """One row count's input buffers: ids (1, n), positions (1, n), slots (n,), mask (1, 1, n, C)."""

    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor


class FixedForwards:
    """A target's forwards over fixed-capacity KV slabs and, on a GPU, every forward but the prefill
    replayed from a CUDA graph per row count: what `TargetRunner(graphs=True)` runs. The same results as
    the runner's own forwards (up to floating-point summation order). `capture`: record and replay graphs
    (default: on a GPU)."""

    def __init__(self, runner: Any, capacity: int = DEFAULT_CAPACITY, capture: bool | None = None):
        self.runner = runner
        self.capture = _check_capture(capture, runner.device)
        self.capacity = _aligned(capacity)
        self.slots: torch.Tensor | None = None  # where the KV slabs write a forward's rows, set per forward
        self.inputs: dict[int, Inputs] = {}
        self.recorded = Recorded(runner.device)
        self.cache = None

    def reset(self) -> Any:
        """An empty sequence; the slabs (and so the graphs) are kept. Returns the runner's cache."""
        if self.cache is None:
            cache = DynamicCache(config=self.runner.model.config)
            if any(type(layer) is not DynamicLayer for layer in cache.layers) or not cache.layers:
                raise DraftsmithError("CUDA graphs need a target whose layers all use full attention "
                                      "(sliding-window or recurrent layers have no fixed-shape cache here)")
            cache.layers = [KVSlab(owner=self) for _ in cache.layers]
            cache.layer_class_to_replicate = None
            self.cache = cache
        for layer in self.cache.layers:
            layer.reset()
        return self.cache

    def _buffers(self, n: int, keep: bool) -> Inputs:
        inputs = self.inputs.get(n)
        if inputs is None:
            device, long = self.runner.device, torch.long
            inputs = Inputs(torch.zeros(1, n, dtype=long, device=device), torch.zeros(1, n, dtype=long, device=device),
                            torch.zeros(n, dtype=long, device=device),
                            torch.zeros(1, 1, n, self.capacity, dtype=self._mask_dtype(), device=device))
            if keep:
                self.inputs[n] = inputs
        return inputs

    def _mask_dtype(self) -> torch.dtype:
        return torch.bool if self.runner.bool_masks else self.runner.head.weight.dtype

    def _allowed(self, start: int, n: int, tree: DraftTree | None) -> torch.Tensor:
        """Which slab positions each of the n new rows attends to (n, C)."""
        device = self.runner.device
        columns = torch.arange(self.capacity, device=device)
        if tree is None:  # a chain: everything up to and including its own slot
            return columns[None, :] <= (start + torch.arange(n, device=device))[:, None]
        allowed = torch.zeros(n, self.capacity, dtype=torch.bool, device=device)
        allowed[:, : start + n] = tree_attention_mask(tree, start)[0, 0].to(device)
        return allowed

    @torch.no_grad()
    def forward(self, tokens: list[int], tree: DraftTree | None = None,
                last_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """TargetRunner.forward on the fixed slabs; a replayed graph unless this is the prefill."""
        device = self.runner.device
        n, start = len(tokens), self.runner.cached()
        _reserve(self, start + n, self.cache.layers)
        replay = self.capture and not last_logits
        inputs = self._buffers(n, keep=replay)
        depth = torch.arange(n, device=device)
        if tree is not None:
            depth[1:] = tree.depth.to(device)
        inputs.ids[0].copy_(torch.tensor(tokens))
        inputs.positions[0].copy_(start + depth)
        inputs.slots.copy_(start + torch.arange(n, device=device))
        allowed = self._allowed(start, n, tree)[None, None]
        if self.runner.bool_masks:
            inputs.mask.copy_(allowed)
        else:
            inputs.mask.copy_(additive_mask(allowed, inputs.mask.dtype))
        outputs = self.recorded.replay(n, lambda: self._run(inputs, False)) if replay else self._run(inputs, last_logits)
        for layer in self.cache.layers:
            layer.length = start + n
        logits, final, aux = outputs
        if replay:  # the buffers are the graph's: the next replay overwrites them
            logits, final = logits.clone(), final.clone()
            aux = aux.clone() if aux is not None else None
        return logits, final, aux

    def _run(self, inputs: Inputs, last_logits: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The fixed-shape forward itself: what a graph records. No host sync, no shape that depends
        on the sequence (the decoder takes the 4D mask as it is)."""
        self.slots = inputs.slots
        return self.runner.decode(inputs.ids, last_logits, attention_mask=inputs.mask, position_ids=inputs.positions)


class DrafterGraphs:
    """A feature drafter's forward, called as the drafter is (tokens, feature, positions, mask, cache),
    over a fixed-capacity KV slab (`cache`, a KVSlab it owns) and, on a GPU, replayed from a CUDA graph
    per row count. The mask it is given covers the cached positions and the new rows; it is padded
    to the slab. `capture`: record graphs (default: on a GPU)."""

    def __init__(self, drafter: Any, capacity: int = DEFAULT_CAPACITY, capture: bool | None = None):
        self.drafter = drafter
        self.device = drafter.lm_head.weight.device
        self.capture = _check_capture(capture, self.device)
        self.capacity = _aligned(capacity)
        self.slots: torch.Tensor | None = None
        self.cache = KVSlab(owner=self)
        self.inputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self.recorded = Recorded(self.device)
        self.generator: torch.Generator | None = None  # what recorded sampled drafts draw from (`draws`)

    def reset(self) -> None:
        self.cache.reset()

    def draws(self, generator: torch.Generator | None) -> torch.Generator | None:
        """The generator a sampled whole draft (`fixed`) draws from. Run eagerly: the caller's own. Recorded:
        the graphs' own CUDA generator, seeded once from the caller's and registered with every graph that
        samples (a graph keeps the generator it was recorded with, while the caller may bring a new one per
        run); torch's default generator where the caller has none, or where this torch cannot register one."""
        if not self.capture or generator is None:
            return generator
        if not hasattr(torch.cuda.CUDAGraph, "register_generator_state"):
            return None
        if self.generator is None:
            seed = torch.randint(2**62, (1,), generator=generator, device=generator.device)
            self.generator = torch.Generator(self.device).manual_seed(int(seed))
        return self.generator

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor,
                 mask: torch.Tensor, cache: Any = None) -> torch.Tensor:
        """(1, m) tokens, (1, m, H) features, (1, m) positions, (1, 1, m, S + m) boolean mask → (1, m, H)."""
        if cache is not None and cache is not self.cache:
            raise DraftsmithError("DrafterGraphs runs the drafter on its own cache (`.cache`)")
        m, start = tokens.shape[1], self.cache.length
        _reserve(self, start + m, [self.cache])
        replay = self.capture and m <= MAX_GRAPH_ROWS
        buffers = self.inputs.get(m)
        if buffers is None:
            buffers = (torch.zeros_like(tokens), torch.zeros_like(feature), torch.zeros_like(positions),
                       torch.zeros(1, 1, m, self.capacity, dtype=torch.bool, device=self.device),
                       torch.zeros(m, dtype=torch.long, device=self.device))
            if replay:
                self.inputs[m] = buffers
        ids, features, where, full_mask, slots = buffers
        ids.copy_(tokens)
        features.copy_(feature)
        where.copy_(positions)
        full_mask.zero_()
        full_mask[..., : mask.shape[-1]] = mask
        slots.copy_(start + torch.arange(m, device=self.device))

        def run() -> torch.Tensor:
            self.slots = slots
            return self.drafter(ids, features, where, full_mask, self.cache)

        out = self.recorded.replay(m, run).clone() if replay else run()
        self.cache.length = start + m
        return out

    def fixed(self, key: Any, anchors: int, root: torch.Tensor, most: int,
              draft: Callable[[torch.Tensor, torch.Tensor], tuple[Any, int]],
              generator: torch.Generator | None = None) -> Any:
        """A whole draft (a chain or a tree) at fixed shapes: `draft(anchors, root)`, given the anchors' count
        as a device scalar and the state (1, H) that drafts the first token, runs every drafter forward
        through `chain_step` or `tree_level` and returns (its result, the rows it wrote after the anchors).
        On a GPU it is recorded once per `key` (the draft's shape and sampling) and replayed: one launch for
        the whole draft. `most`: the most rows it may write. `generator`: what a sampled draft draws from
        (`draws`). Returns the result (its tensors copied out)."""
        _reserve(self, anchors + most, [self.cache])
        buffers = self.inputs.get(key)
        if buffers is None:
            buffers = self.inputs[key] = (torch.zeros((), dtype=torch.long, device=self.device), torch.zeros_like(root))
        count, state = buffers
        count.fill_(anchors)
        state.copy_(root)
        if self.capture:  # the buffers are the graph's: the next replay overwrites them
            result, written = self.recorded.replay(key, lambda: draft(count, state), generator)
            result = _copied(result)
        else:
            result, written = draft(count, state)
        self.cache.length = anchors + written
        return result

    def chain_step(self, token: torch.Tensor, feature: torch.Tensor, anchors: torch.Tensor, drafted: int) -> torch.Tensor:
        """One chain step inside `fixed`: the drafter on the `drafted`-th token (1, 1) with the state that drew
        it (1, 1, H), written after the anchors and the tokens before it, which it sees. → (1, 1, H)."""
        slot = anchors + (drafted - 1)
        mask = torch.arange(self.capacity, device=self.device) <= slot
        self.slots = slot.view(1)
        return self.drafter(token, feature, slot.view(1, 1), mask[None, None, None], self.cache)

    def tree_level(self, tokens: torch.Tensor, feature: torch.Tensor, anchors: torch.Tensor, seen: torch.Tensor,
                   expanded: int, depth: int) -> torch.Tensor:
        """One tree level inside `fixed`: the drafter on m expanded nodes (tokens (1, m), their parents' states
        (1, m, H)) written at slots anchors + expanded + r, each seeing the anchors and the expanded nodes
        `seen` (m, E_max) marks (entries anchors + j), at position anchors - 2 + depth. → states (m, H)."""
        m, device = tokens.shape[1], self.device
        mask = (torch.arange(self.capacity, device=device) < anchors).expand(m, -1).contiguous()
        mask.index_copy_(1, anchors + torch.arange(seen.shape[1], device=device), seen)
        self.slots = anchors + expanded + torch.arange(m, device=device)
        positions = (anchors + (depth - 2)).expand(1, m)
        return self.drafter(tokens, feature, positions, mask[None, None], self.cache)[0]


def _copied(value: Any) -> Any:
    """`value` with every tensor in it (in tuples, lists and dataclasses) cloned."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_copied(v) for v in value)
    if dataclasses.is_dataclass(value):
        return dataclasses.replace(value, **{f.name: _copied(getattr(value, f.name)) for f in dataclasses.fields(value)})
    return value


def compile_blocks(decoder: Any, enabled: bool = True) -> list[torch.nn.Module]:
    """Compile (torch.compile, inductor, in place) the stateless blocks of each decoder layer: its
    children other than the attention (the norms and the MLP), which eagerly are a dozen small
    kernels each (an RMSNorm alone is six). The attention and its cache stay eager (its layer index
    would recompile it per layer). Identical blocks share one compiled graph per shape (their
    weights are inputs): a prefill, one row, then any row count. `enabled=False` undoes it.
    Returns the blocks."""
    blocks = [child for layer in _decoder_layers(decoder) for child in layer.children()
              if not any(hasattr(m, "layer_idx") for m in child.modules())]
    final = getattr(decoder, "norm", None)
    blocks += [final] if isinstance(final, torch.nn.Module) else []
    for block in blocks:
        if enabled:
            block.compile()
        else:
            block._compiled_call_impl = None
    return blocks


def _decoder_layers(decoder: Any) -> list[torch.nn.Module]:
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise DraftsmithError(f"{type(decoder).__name__} has no `layers` list: its blocks cannot be compiled")
    return list(layers)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
