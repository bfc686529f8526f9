"""Standalone draft LM: a small causal LM on the target's tokenizer (classic speculative decoding).

Initialised from the target where shapes allow: its embeddings, its head, its final norm
and `num_layers` of its decoder layers: the first ones, or the ids in `layer_ids` (e.g. a few
early layers and the last, which already maps features to the head's space). With a configured
smaller shape (hidden size, heads, intermediate size) the layers start random and only the
vocabulary is shared.
Trainable fully or through LoRA adapters (peft). It is an ordinary transformers model, so
`generate(assistant_model=...)` and every serving engine load it as they load the target.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from draftsmith import DraftsmithError
from draftsmith.models.common import quiet_peft

SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")


def build_standalone(target_model: Any, num_layers: int = 4, shape: dict[str, int] | None = None,
                     layer_ids: list[int] | None = None) -> Any:
    """A causal LM of the target's family with `num_layers` decoder layers (or one per id in
    `layer_ids`, copied from those target layers in that order); copies what fits from the target."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(target_model.config)
    n_target = config.num_hidden_layers
    ids = list(range(num_layers)) if layer_ids is None else [int(i) for i in layer_ids]  # target layers to copy
    if layer_ids is not None:
        if shape:
            raise DraftsmithError("layer_ids copies target layers; it cannot be combined with a smaller shape")
        if not ids or not all(0 <= i < n_target for i in ids):
            raise DraftsmithError(f"layer_ids must be target decoder layers in 0..{n_target - 1}, got {layer_ids}")
        num_layers = len(ids)
    elif not 1 <= num_layers <= n_target and not shape:
        raise DraftsmithError(f"num_layers must be in 1..{n_target} to copy target layers, got {num_layers}")
    bad = sorted(set(shape or {}) - set(SHAPE_KEYS))
    if bad:
        raise DraftsmithError(f"unknown shape keys {bad}; allowed: {list(SHAPE_KEYS)}")
    config.num_hidden_layers = num_layers
    for key, value in (shape or {}).items():
        setattr(config, key, value)
    types = getattr(config, "layer_types", None)
    if types:  # each layer keeps its target layer's type; a deeper configured shape repeats the pattern
        config.layer_types = [types[i % len(types)] for i in (ids if layer_ids is not None else range(num_layers))]
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config)
    source = _renumber_layers(target_model.state_dict(), ids)
    own = model.state_dict()
    copied = {k: v for k, v in source.items() if k in own and own[k].shape == v.shape}
    model.load_state_dict(copied, strict=False)
    model.copied_from_target = sorted(copied)
    return model.to(torch.float32)


def _renumber_layers(state: dict[str, torch.Tensor], ids: list[int]) -> dict[str, torch.Tensor]:
    """The target's state dict with decoder layer ids[j] renamed to layer j (other layers dropped)."""
    new_index = {str(old): str(new) for new, old in enumerate(ids)}
    out = {}
    for key, value in state.items():
        parts = key.split(".")
        at = next((i for i in range(len(parts) - 1) if parts[i] == "layers" and parts[i + 1].isdigit()), None)
        if at is None:
            out[key] = value
        elif parts[at + 1] in new_index:
            out[".".join(parts[:at + 1] + [new_index[parts[at + 1]]] + parts[at + 2:])] = value
    return out


def add_lora(model: Any, rank: int, alpha: int | None = None, target_modules: list[str] | None = None) -> Any:
    """Wrap the draft LM with LoRA adapters; only they train."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank,
                        target_modules=target_modules or ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    with quiet_peft():
        return get_peft_model(model, config)
