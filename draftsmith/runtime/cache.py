"""KV caches for decoding that never grow by concatenation.

A speculative round appends a few keys per layer, then drops the rejected ones (a chain) or
moves the accepted path's rows up (a tree). transformers' DynamicCache appends with `torch.cat`,
which copies every layer's whole cache on every forward. Here each layer holds a preallocated
slab (B, kv, capacity, hd) and a length (`KVSlab`): appending writes into the slab, rolling back
moves the length, and keeping a tree path (TargetRunner.keep_path writing through the views)
copies only the path's rows. The keys and values a layer hands to attention are views of the
slab's first `length` positions. When a sequence outgrows the slab, it is reallocated at twice the
size (amortized: a few times per generation at most). The same slab, written at given slots and
read whole, is what runtime/graphs.py's fixed-shape forwards run on.

Notation: B batch, kv key/value heads, S cached positions, hd head dim, n new positions.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

DEFAULT_CAPACITY = 1024


class KVSlab(DynamicLayer):
    """One layer's keys and values in preallocated slabs (B, kv, C, hd) and a length: the KV cache every
    decoding forward uses, the target's (a transformers cache layer) and a drafter's (its buffer).

    Appending, the default: `update` writes the n new rows after the first `length` and hands attention
    views of the first length + n positions (`keys`, `values`); a full slab is reallocated at twice the
    size. With an `owner` (runtime/graphs.py's fixed-shape forwards, which CUDA graphs replay), the new
    rows go to the slots the owner holds (`owner.slots`, a device tensor), attention reads the whole
    slab under a mask, and the owner sets the length and the capacity (`grow`): a recorded graph's
    shapes and addresses never change, and the slabs start zeroed: a masked position still enters
    attention's products (0 · NaN would be NaN).

    `crop(n)`: n ≥ 0 keeps the first n positions (a drafter's rollback), n < 0 removes the last −n
    (transformers' convention)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, owner: Any = None) -> None:
        super().__init__()
        self.capacity, self.owner, self.length = capacity, owner, 0
        self.slab_k: torch.Tensor | None = None
        self.slab_v: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.is_initialized = key_states.device, True

    def _allocate(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        """Slabs of `capacity` positions shaped like `keys`/`values`, holding the live rows of the old ones;
        zeroed under an owner, whose attention reads the whole slab."""
        new = torch.zeros if self.owner is not None else torch.empty
        slab_k = new(*keys.shape[:2], capacity, keys.shape[-1], dtype=keys.dtype, device=keys.device)
        slab_v = new(*values.shape[:2], capacity, values.shape[-1], dtype=values.dtype, device=values.device)
        if self.slab_k is not None and self.length:
            slab_k[:, :, : self.length] = self.slab_k[:, :, : self.length]
            slab_v[:, :, : self.length] = self.slab_v[:, :, : self.length]
        self.slab_k, self.slab_v = slab_k, slab_v
        self._expose()

    def _expose(self) -> None:
        """What attention reads: the live rows, or under an owner the whole slab."""
        if self.slab_k is None:
            self.keys = self.values = None
        elif self.owner is not None:
            self.keys, self.values = self.slab_k, self.slab_v
        else:
            self.keys, self.values = self.slab_k[:, :, : self.length], self.slab_v[:, :, : self.length]

    def grow(self, capacity: int) -> None:
        """Room for `capacity` positions (the owner's call)."""
        if self.slab_k is not None:
            self._allocate(self.slab_k, self.slab_v, capacity)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write n new positions (B, kv, n, hd); returns the keys and values attention reads."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.owner is not None:
            if self.slab_k is None:
                self._allocate(key_states, value_states, self.owner.capacity)
            self.slab_k.index_copy_(2, self.owner.slots, key_states)
            self.slab_v.index_copy_(2, self.owner.slots, value_states)
            return self.keys, self.values
        end = self.length + key_states.shape[2]
        if self.slab_k is None or end > self.slab_k.shape[2]:
            grown = 2 * self.slab_k.shape[2] if self.slab_k is not None else 0
            self._allocate(key_states, value_states, max(self.capacity, end, grown))
        self.slab_k[:, :, self.length: end] = key_states
        self.slab_v[:, :, self.length: end] = value_states
        self.length = end
        self._expose()
        return self.keys, self.values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def crop(self, length: int) -> None:
        self.length = max(0, self.length + length if length < 0 else min(length, self.length))
        self._expose()

    def reset(self) -> None:
        self.crop(0)


def decoding_cache(config: Any, preallocated: bool = True, capacity: int = DEFAULT_CAPACITY) -> DynamicCache:
    """A transformers DynamicCache for `config` whose attention layers, sliding-window ones included,
    keep every position: `KVSlab`s (`preallocated`), else transformers' own DynamicLayer. A sliding
    window is then the attention mask's business alone (the model's own masks for chains,
    runtime/tree.py's windowed masks for trees): transformers' sliding layers drop what falls out of the
    window and cannot roll a rejected draft back past it. Other special layers (recurrent states) stay
    as transformers makes them."""
    cache = DynamicCache(config=config)
    full = (lambda: KVSlab(capacity)) if preallocated else DynamicLayer
    cache.layers = [full() if isinstance(layer, DynamicLayer) else layer for layer in cache.layers]
    if cache.layer_class_to_replicate is DynamicLayer:  # no config: layers are made as the model asks
        cache.layer_class_to_replicate = KVSlab if preallocated else DynamicLayer
    return cache
