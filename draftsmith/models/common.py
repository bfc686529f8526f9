"""Pieces every feature drafter shares: the target family's layer classes, a KV buffer, masks.

Notation: B batch, T sequence (anchors), S keys, H hidden, kv key/value heads, hd head dim.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import os
import warnings
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from draftsmith import DraftsmithError


def family_classes(config: Any) -> SimpleNamespace:
    """The target family's DecoderLayer, Attention, MLP, RMSNorm and RotaryEmbedding classes."""
    try:
        modeling = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    except ImportError:
        raise DraftsmithError(f"transformers has no modeling code for model type {config.model_type!r}") from None
    found = {}
    for suffix in ("DecoderLayer", "Attention", "MLP", "RMSNorm", "RotaryEmbedding"):
        names = [n for n, obj in vars(modeling).items()
                 if isinstance(obj, type) and obj.__module__ == modeling.__name__ and n.endswith(suffix)]
        if not names:
            raise DraftsmithError(
                f"model type {config.model_type!r}: no *{suffix} class in {modeling.__name__}; "
                "draftsmith's feature drafters need a Llama-like decoder family"
            )
        found[suffix] = getattr(modeling, min(names, key=len))
    return SimpleNamespace(layer=found["DecoderLayer"], attention=found["Attention"], mlp=found["MLP"],
                           norm=found["RMSNorm"], rotary=found["RotaryEmbedding"])


def drafter_config(target_config: Any) -> Any:
    """The target's config cut to one decoder layer, with sdpa attention."""
    config = copy.deepcopy(target_config)
    config.num_hidden_layers = 1
    config._attn_implementation = "sdpa"
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:1]
    return config


def init_linear_(module: nn.Module, std: float) -> None:
    """HF-style init for the trainable drafter parts: N(0, std) weights, zero biases."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def frozen_linear(weight: torch.Tensor) -> nn.Linear:
    """A bias-free Linear holding a frozen copy of `weight` (out, in)."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
    return layer


def frozen_embedding(weight: torch.Tensor) -> nn.Embedding:
    emb = nn.Embedding(weight.shape[0], weight.shape[1])
    emb.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
    return emb


_FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask (True: attend) as the additive mask attention adds to its scores: 0 where
    allowed, -inf elsewhere, which is what torch's SDPA makes of a boolean mask (the two give the same
    bits). Every row must allow some position."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


@contextmanager
def grouped_query_sdpa(enabled: bool):
    """Let transformers' SDPA attention call torch's grouped-query mode (`enable_gqa`) under a mask
    too, instead of first repeating every cached key and value per query head: with a tree mask or
    a chain of several tokens that repeat copies the whole KV cache in every layer. transformers
    reads this switch at each call; it is set only for the duration of one forward. On a GPU a
    masked grouped-query call leaves the fused kernels: enable it on a CPU."""
    if not enabled:
        yield
        return
    before = os.environ.get(_FORCE_GQA)
    os.environ[_FORCE_GQA] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[_FORCE_GQA]
        else:
            os.environ[_FORCE_GQA] = before


@contextmanager
def quiet_peft():
    """peft asks transformers' deprecated `is_gradient_checkpointing`: a FutureWarning no user can act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


class KVBuffer:
    """Keys and values appended along the sequence, (B, kv, S, hd); duck-types HF's Cache.update.

    Training appends one block per alignment step; decoding appends tokens and `crop`s
    rejected ones away.
    """

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int = 0, *args, **kwargs):
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=2)
            self.values = torch.cat([self.values, values], dim=2)
        return self.keys, self.values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def crop(self, length: int) -> None:
        """Keep the first `length` positions."""
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]


def alignment_mask(valid: torch.Tensor, step: int) -> torch.Tensor:
    """Attention of alignment step `step` over the keys of steps 0..step, (B, 1, T, (step+1)*T) bool.

    The query at anchor t in step j stands for the (j+1)-th drafted token after a real
    prefix ending at t. It sees step-0 keys (made from target features) at positions
    s <= t, and its own chain's keys of steps 1..j at anchor t (the diagonal of each
    block): exactly the context it has at decoding time. `valid` (B, T) marks real tokens.
    """
    b, t = valid.shape
    idx = torch.arange(t, device=valid.device)
    causal = (idx[None, :] <= idx[:, None])[None] & valid[:, None, :]  # (B, T, T)
    diag = torch.eye(t, dtype=torch.bool, device=valid.device).expand(b, t, t)
    return torch.cat([causal] + [diag] * step, dim=-1)[:, None]


@functools.cache
def _cache_name(kind: type) -> str:
    return "cache" if "cache" in inspect.signature(kind.forward).parameters else "past_key_values"


def cache_kwargs(module: nn.Module, cache: Any) -> dict[str, Any]:
    """{name: cache} under the name `module`'s forward takes its KV cache by: `cache` from transformers 5.24
    on, `past_key_values` before (5.24 still takes the old name, with a FutureWarning, until 5.40)."""
    return {_cache_name(type(module)): cache}
