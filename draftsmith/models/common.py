"""Pieces every feature drafter shares: its Llama-layout layer classes and config, a KV buffer, masks.

Notation: B batch, T sequence (anchors), S keys, H hidden, kv key/value heads, hd head dim.
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from draftsmith import DraftsmithError


def layer_classes() -> SimpleNamespace:
    """The classes a feature drafter's layer is built of: Llama's DecoderLayer, Attention, MLP, RMSNorm
    and RotaryEmbedding, whatever the target's family. The engines load EAGLE drafters in this layout
    for every target family (vLLM's Eagle3LlamaForCausalLM, `speculators`' LlamaDecoderLayer), and a
    drafter trains from scratch: it needs the target's sizes, not its family's MoE MLPs, q/k norms,
    sliding windows or (1 + w) norms (docs/targets.md)."""
    from transformers.models.llama import modeling_llama as llama

    return SimpleNamespace(layer=llama.LlamaDecoderLayer, attention=llama.LlamaAttention, mlp=llama.LlamaMLP,
                           norm=llama.LlamaRMSNorm, rotary=llama.LlamaRotaryEmbedding)


def target_rope(config: Any) -> dict[str, Any]:
    """The target's rope parameters as one dict; a family with one per layer type (Gemma 3) gives its
    full-attention layers'."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if "full_attention" in params:
        params = dict(params["full_attention"])
    if "rope_theta" not in params:
        params["rope_theta"] = float(getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", "default")
    return params


def drafter_config(target_config: Any, rope_theta: float | None = None) -> Any:
    """A one-layer Llama config of the target's sizes (hidden, MLP width, heads, head dim, rope), with a
    SiLU MLP, no biases and sdpa attention: the layer every feature drafter is built of, in the layout
    every engine loads an EAGLE drafter in whatever the target's activation and biases. An MoE
    target's MLP width is its dense `intermediate_size`. `rope_theta`: the drafter's own RoPE base in
    place of the target's (its exports' configs carry it, so the engines rotate alike)."""
    from transformers import LlamaConfig

    t = target_config.get_text_config()
    heads = t.num_attention_heads
    config = LlamaConfig(
        vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=getattr(t, "num_key_value_heads", None) or heads,
        head_dim=getattr(t, "head_dim", None) or t.hidden_size // heads, hidden_act="silu",
        max_position_embeddings=getattr(t, "max_position_embeddings", 4096), rms_norm_eps=t.rms_norm_eps,
        rope_parameters={**target_rope(t), **({"rope_theta": float(rope_theta)} if rope_theta else {})},
        attention_bias=False,
        initializer_range=getattr(t, "initializer_range", 0.02), tie_word_embeddings=False,
        bos_token_id=getattr(t, "bos_token_id", None), eos_token_id=getattr(t, "eos_token_id", None),
        pad_token_id=getattr(t, "pad_token_id", None))
    config._attn_implementation = "sdpa"
    return config


def build_from_target(cls: type, title: str, known: tuple[str, ...], target_config: Any, embed_weight: torch.Tensor,
                      head_weight: torch.Tensor, norm_weight: torch.Tensor | None, draft_ids: torch.Tensor | None,
                      num_aux: int, target_hidden_size: int, options: dict[str, Any]) -> Any:
    """A fused-layer drafter `cls` from the target's parts (the shared `from_target` of EAGLE-3, P-EAGLE
    and the block drafters): its `options` checked against the `known` ones; no draft_ids, the target's
    whole vocabulary."""
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise DraftsmithError(f"unknown {title} options {unknown}; known: {list(known)}")
    if draft_ids is None:
        draft_ids = torch.arange(embed_weight.shape[0])
    return cls(target_config, embed_weight, head_weight, norm_weight, draft_ids, num_aux, target_hidden_size, **options)


def start_from_target_layer_(layer: nn.Module, source: nn.Module, norm_scale: Any, hidden_size: int,
                             inputs: slice = slice(None)) -> None:
    """Copy a target decoder layer (`source`) into a draft layer of `hidden_size` (`DrafterModule`'s
    `init_layer`): the attention projections (q/k/v on the input columns `inputs` of the draft layer's, e.g. the
    feature half of EAGLE-3's 2H input; q/k norms where both have them), the MLP where it is a dense one of the
    same shapes, and the norms' scales (`norm_scale`: any family's convention, Gemma's 1 + w read right)."""
    attn, mine = source.self_attn, layer.self_attn
    pairs = [(getattr(mine, n).weight[:, inputs], getattr(attn, n).weight) for n in ("q_proj", "k_proj", "v_proj")]
    pairs.append((mine.o_proj.weight, attn.o_proj.weight))
    if all(hasattr(source.mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        pairs += [(getattr(layer.mlp, n).weight, getattr(source.mlp, n).weight)
                  for n in ("gate_proj", "up_proj", "down_proj")]
    bad = [tuple(src.shape) for dst, src in pairs if dst.shape != src.shape]
    if bad:
        raise DraftsmithError(f"init_layer: the target layer's weights {bad} do not fit the draft layer (hidden "
                              f"{hidden_size}): start from a random layer (init_layer: null)")
    # Gemma's norm before its MLP is pre_feedforward_layernorm (its post_attention_layernorm norms the attention's
    # output)
    mlp_norm = getattr(source, "pre_feedforward_layernorm", None) or source.post_attention_layernorm
    norms = [(layer.input_layernorm, source.input_layernorm), (layer.post_attention_layernorm, mlp_norm)]
    norms += [(getattr(mine, n), getattr(attn, n)) for n in ("q_norm", "k_norm")
              if hasattr(mine, n) and hasattr(attn, n)]
    with torch.no_grad():
        for dst, src in pairs:
            dst.copy_(src)
        for dst, src in norms:
            dst.weight.copy_(norm_scale(src))


def pass_last_fused_layer_(fc: nn.Linear, hidden_norm: nn.Module, source: nn.Module, norm_scale: Any,
                           target_hidden_size: int) -> None:
    """Make fc pass the last fused target layer through (an identity beside a tenth of its random start) and
    `hidden_norm`, which norms what the first draft layer reads, take `source`'s input norm: with
    `start_from_target_layer_`, the first draft layer then starts as `source` run on that layer's output."""
    h = hidden_norm.weight.shape[0]
    if target_hidden_size != h:
        raise DraftsmithError(f"init_layer: the target's hidden size {target_hidden_size} is not the draft "
                              f"layer's {h}: start from a random layer (init_layer: null)")
    with torch.no_grad():
        hidden_norm.weight.copy_(norm_scale(source.input_layernorm))
        fc.weight.mul_(0.1)
        fc.weight[:, -h:] += torch.eye(h, dtype=fc.weight.dtype, device=fc.weight.device)


def logit_softcap(config: Any) -> float | None:
    """The cap c of a family whose logits are c·tanh(z / c) (Gemma 2's `final_logit_softcapping`;
    set in some Gemma 3 configs too), else None."""
    cap = getattr(config.get_text_config(), "final_logit_softcapping", None)
    return float(cap) if cap else None


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """The target's logits as its own forward returns them: c·tanh(z / c) under a soft-cap c."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


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


def alignment_mask(valid: torch.Tensor, step: int, kept: list[torch.Tensor | None] | None = None) -> torch.Tensor:
    """Attention of alignment step `step` over the keys of steps 0..step, (B, 1, Q, T + K_1 + … + K_step) bool.

    The query at anchor t in step j stands for the (j+1)-th drafted token after a real
    prefix ending at t. It sees step-0 keys (made from target features) at positions
    s <= t, and its own chain's keys of steps 1..j at anchor t: exactly the context it has at
    decoding time. `valid` (B, T) marks real tokens. Every step runs at every anchor (Q = K_i = T,
    the own-chain blocks diagonal) unless `kept` (P-EAGLE's COD sampling, `train.alignment.cod_positions`)
    gives the anchors each step i ≥ 1 ran at, (B, K_i) indices, each a prefix of the one before: the
    queries are then kept[step], and the own chain's key of step i is the same row of kept[i].
    """
    b, t = valid.shape
    every = torch.arange(t, device=valid.device).expand(b, t)
    ran = [every] * (step + 1) if kept is None else [every] + [kept[i] for i in range(1, step + 1)]
    query = ran[step]
    causal = (torch.arange(t, device=valid.device)[None, None] <= query[..., None]) & valid[:, None, :]  # (B, Q, T)
    own = [torch.eye(query.shape[1], keys.shape[1], dtype=torch.bool, device=valid.device).expand(b, -1, -1)
           for keys in ran[1:]]
    return torch.cat([causal, *own], dim=-1)[:, None]


@functools.cache
def _cache_name(kind: type) -> str:
    return "cache" if "cache" in inspect.signature(kind.forward).parameters else "past_key_values"


def cache_kwargs(module: nn.Module, cache: Any) -> dict[str, Any]:
    """{name: cache} under the name `module`'s forward takes its KV cache by: `cache` from transformers 5.24
    on, `past_key_values` before (5.24 still takes the old name, with a FutureWarning, until 5.40)."""
    return {_cache_name(type(module)): cache}
