"""Standalone draft LM: a small causal LM on the target's tokenizer (classic speculative decoding).

Initialised from the target where shapes allow: its embeddings, its head, its final norm
and its first `num_layers` decoder layers. With a configured smaller shape (hidden size,
heads, intermediate size) the layers start random and only the vocabulary is shared.
Trainable fully or through LoRA adapters (peft). It is an ordinary transformers model, so
`generate(assistant_model=...)` and every serving engine load it as they load the target.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from draftsmith import DraftsmithError

SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")


def build_standalone(target_model: Any, num_layers: int = 4, shape: dict[str, int] | None = None) -> Any:
    """A `num_layers`-layer causal LM of the target's family; copies what fits from the target."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(target_model.config)
    if not 1 <= num_layers <= config.num_hidden_layers and not shape:
        raise DraftsmithError(f"num_layers must be in 1..{config.num_hidden_layers} to copy target layers, got {num_layers}")
    bad = sorted(set(shape or {}) - set(SHAPE_KEYS))
    if bad:
        raise DraftsmithError(f"unknown shape keys {bad}; allowed: {list(SHAPE_KEYS)}")
    config.num_hidden_layers = num_layers
    for key, value in (shape or {}).items():
        setattr(config, key, value)
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config)
    source = target_model.state_dict()
    own = model.state_dict()
    copied = {k: v for k, v in source.items() if k in own and own[k].shape == v.shape}
    model.load_state_dict(copied, strict=False)
    model.copied_from_target = sorted(copied)
    return model.to(torch.float32)


def add_lora(model: Any, rank: int, alpha: int | None = None, target_modules: list[str] | None = None) -> Any:
    """Wrap the draft LM with LoRA adapters; only they train."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank,
                        target_modules=target_modules or ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return get_peft_model(model, config)
