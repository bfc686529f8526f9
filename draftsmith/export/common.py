"""What every export writer shares: the drafter's sizes, the Llama layer config the engines read,
contract checks (tensor names and shapes, config fields) and the writing of one directory.

Notation: H drafter hidden, Ht target hidden, I intermediate, V vocab, Vd draft vocab, k fused layers,
nh / nkv query / key-value heads, hd head dim.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from draftsmith import DraftsmithError
from draftsmith.train.checkpoints import monitored_records, validated_score

LAYER_TENSORS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "post_attention_layernorm.weight", "input_layernorm.weight", "hidden_norm.weight")


def layer_tensors(drafter: Any, prefix: str = "layers.0.") -> dict[str, torch.Tensor]:
    """The drafter's decoder layer as float tensors under the engines' `layers.0.` names."""
    return {prefix + k[len("layer."):]: v.detach().float().contiguous() for k, v in drafter.state_dict().items()
            if k.startswith("layer.") and k[len("layer."):] in LAYER_TENSORS}


def layer_shapes(c: dict[str, int], attn_in: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the decoder layer's tensors; `attn_in` is H (EAGLE) or 2H (EAGLE-3's first layer)."""
    h, i, q, kv = c["H"], c["I"], c["nh"] * c["hd"], c["nkv"] * c["hd"]
    return {
        "layers.0.self_attn.q_proj.weight": (q, attn_in), "layers.0.self_attn.k_proj.weight": (kv, attn_in),
        "layers.0.self_attn.v_proj.weight": (kv, attn_in), "layers.0.self_attn.o_proj.weight": (h, q),
        "layers.0.mlp.gate_proj.weight": (i, h), "layers.0.mlp.up_proj.weight": (i, h),
        "layers.0.mlp.down_proj.weight": (h, i), "layers.0.post_attention_layernorm.weight": (h,),
    }


def check_tensors(fmt: str, tensors: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], optional: set[str],
                  where: str) -> None:
    """Every expected tensor present with its shape, nothing unexpected; raise naming each problem."""
    problems = [f"missing {name} {shape}" for name, shape in shapes.items() if name not in tensors]
    problems += [f"{name}: shape {tuple(t.shape)}, expected {shapes[name]}" for name, t in tensors.items()
                 if name in shapes and tuple(t.shape) != shapes[name]]
    problems += [f"unexpected tensor {name}" for name in tensors if name not in shapes and name not in optional]
    if problems:
        raise DraftsmithError(f"{where} breaks the {fmt} contract: " + "; ".join(problems))


def check_config(config: dict[str, Any], required: dict[str, Any], where: str) -> None:
    """Each required field present, and equal where a value is given (None: any value)."""
    problems = []
    for key, value in required.items():
        node = config
        for part in key.split("."):
            node = node.get(part, KeyError) if isinstance(node, dict) else KeyError
        if node is KeyError:
            problems.append(f"missing {key}")
        elif value is not None and node != value:
            problems.append(f"{key} = {node!r}, expected {value!r}")
    if problems:
        raise DraftsmithError(f"{where}/config.json breaks its consumer's contract: " + "; ".join(problems))


def provenance(ckpt: dict[str, Any]) -> dict[str, Any]:
    """Where an export came from: the checkpoint file, its step and epoch, and its validation score (the
    monitor ModelCheckpoint ranks by, val/tau for drafters: the τ̂ it was chosen by; as ModelCheckpoint
    recorded it for a top-k file, else as the run validated at the checkpoint's step; None where it
    did not), so that a served drafter can be traced to its run and two exports of one run told apart."""
    score, monitor = None, None
    for state in monitored_records(ckpt)[:1]:
        monitor = state["monitor"]
        recorded = {Path(k).name: v for k, v in (state.get("best_k_models") or {}).items()}
        value = recorded.get(Path(ckpt["path"]).name)
        score = validated_score(ckpt, monitor) if value is None else float(value)
    return {"checkpoint": str(Path(ckpt["path"]).resolve()), "global_step": ckpt.get("global_step"),
            "epoch": ckpt.get("epoch"), "monitor": monitor, "score": score,
            "val_tau": score if monitor == "val/tau" else None}


def sizes(module: Any) -> dict[str, int]:
    cfg, d = module.drafter.config, module.drafter
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return {"H": cfg.hidden_size, "Ht": module.identity["hidden_size"], "I": cfg.intermediate_size,
            "V": module.identity["vocab_size"], "Vd": d.vocab_size, "k": len(module.aux_layer_ids) or 1,
            "nh": cfg.num_attention_heads, "nkv": cfg.num_key_value_heads, "hd": hd}


def _rope(cfg: Any) -> tuple[float, Any]:
    """Legacy rope_theta / rope_scaling from a transformers-5 config (which uses rope_parameters)."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    theta = params.pop("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    scaling = None if params.get("rope_type", "default") == "default" else params
    return float(theta), scaling


def llama_layer_config(module: Any, architectures: list[str]) -> dict[str, Any]:
    cfg = module.drafter.config
    theta, scaling = _rope(cfg)
    s = sizes(module)
    return {
        "architectures": architectures, "model_type": "llama", "hidden_size": s["H"],
        "intermediate_size": s["I"], "num_attention_heads": s["nh"], "num_key_value_heads": s["nkv"],
        "head_dim": s["hd"], "num_hidden_layers": 1, "vocab_size": s["V"], "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps, "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": theta, "rope_scaling": scaling, "attention_bias": bool(getattr(cfg, "attention_bias", False)),
        "mlp_bias": bool(getattr(cfg, "mlp_bias", False)), "tie_word_embeddings": False,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "torch_dtype": "float32",
    }


def save(out: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any], bin_file: bool = False) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if bin_file:  # the EAGLE reference code reads only pytorch_model.bin (writing a pickle, never reading one)
        torch.save(tensors, out / "pytorch_model.bin")
    else:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
