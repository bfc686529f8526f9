"""KV caches for decoding that never grow by concatenation.

A speculative round appends a few keys per layer, then drops the rejected ones (a chain) or
moves the accepted path's rows up (a tree). transformers' DynamicCache appends with `torch.cat`,
which copies every layer's whole cache on every forward. Here each layer holds a preallocated
slab (B, kv, capacity, hd) and a length: appending writes into the slab, rolling back moves the
length, and keeping a tree path (TargetRunner.keep_path writing through the views) copies only
the path's rows. The keys and values a layer hands
to attention are views of the slab's first `length` positions. When a sequence outgrows the
slab, it is reallocated at twice the size (amortized: a few times per generation at most).

Notation: B batch, kv key/value heads, S cached positions, hd head dim, n new positions.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

DEFAULT_CAPACITY = 1024


class StaticKV:
    """One layer's keys and values in a preallocated slab; the KV-buffer interface the drafters use
    (`update`, `get_seq_length`, `crop(length)`) and views `keys`, `values` (B, kv, S, hd)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self.capacity, self.length = capacity, 0
        self.slab_k: torch.Tensor | None = None
        self.slab_v: torch.Tensor | None = None

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self.slab_k is None else self.slab_k[:, :, : self.length]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self.slab_v is None else self.slab_v[:, :, : self.length]

    def _reserve(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        if self.slab_k is not None and length <= self.slab_k.shape[2]:
            return
        capacity = max(self.capacity, length)
        if self.slab_k is not None:
            capacity = max(capacity, 2 * self.slab_k.shape[2])
        b, h = keys.shape[:2]
        slab_k = keys.new_empty(b, h, capacity, keys.shape[-1])
        slab_v = values.new_empty(b, h, capacity, values.shape[-1])
        if self.slab_k is not None and self.length:
            slab_k[:, :, : self.length] = self.keys
            slab_v[:, :, : self.length] = self.values
        self.slab_k, self.slab_v = slab_k, slab_v

    def update(self, keys: torch.Tensor, values: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append n positions (B, kv, n, hd); returns all cached keys and values."""
        end = self.length + keys.shape[2]
        self._reserve(keys, values, end)
        self.slab_k[:, :, self.length: end] = keys
        self.slab_v[:, :, self.length: end] = values
        self.length = end
        return self.keys, self.values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def crop(self, length: int) -> None:
        """Keep the first `length` positions."""
        self.length = max(0, min(length, self.length))


class SlabLayer(DynamicLayer):
    """A transformers cache layer over a StaticKV; `keys`/`values` are the slab's live views."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        super().__init__()
        self.kv = StaticKV(capacity)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.is_initialized = key_states.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = self.kv.update(key_states, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.kv.length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes the number of positions to remove as a negative int")
        self.kv.crop(self.kv.length + tokens_to_remove)
        self.keys, self.values = self.kv.keys, self.kv.values

    def reset(self) -> None:
        self.kv.crop(0)
        self.keys, self.values = self.kv.keys, self.kv.values


def decoding_cache(config: Any, preallocated: bool = True, capacity: int = DEFAULT_CAPACITY) -> DynamicCache:
    """A transformers DynamicCache for `config`; `preallocated`: its full-attention layers are
    `SlabLayer`s (sliding-window and other special layers stay as transformers makes them)."""
    cache = DynamicCache(config=config)
    if not preallocated:
        return cache
    cache.layers = [SlabLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    if cache.layer_class_to_replicate is DynamicLayer:  # no config: layers are made as the model asks
        cache.layer_class_to_replicate = SlabLayer
    return cache
