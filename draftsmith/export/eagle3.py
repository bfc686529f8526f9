"""The eagle3 format: EAGLE-3 drafters as the flat Llama config vLLM and SGLang read.

Tensors: fc [H, k*Ht] (no bias), the first layer's input/hidden/post-attention norms, attention
on 2H inputs, the final norm, the pruned head lm_head [Vd, H], d2t int64 [Vd] (target id =
draft id + d2t[draft id]) and t2d bool [V] with Vd true entries. Layer ids: vLLM reads HF
`output_hidden_states` ids; SGLang adds 1 to what it reads, so its copy stores id − 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftsmith import DraftsmithError
from draftsmith.export.common import (check_config, check_tensors, layer_shapes, layer_tensors, llama_layer_config,
                                     provenance, save, sizes)
from draftsmith.models.eagle3 import OPTIONS
from draftsmith.models.registry import EAGLE3


def eagle3_tensors(drafter: Any, with_embeddings: bool = False) -> dict[str, torch.Tensor]:
    state = {k: v.detach().contiguous() for k, v in drafter.state_dict().items()}
    out = {"fc.weight": state["fc.weight"].float(), "norm.weight": state["norm.weight"].float(),
           "lm_head.weight": state["lm_head.weight"].float(), "d2t": state["d2t"].long(), "t2d": state["t2d"].bool(),
           **layer_tensors(drafter)}
    out.update({k: v.float() for k, v in state.items() if k.startswith(("fc_norm.", "input_norm."))})  # EAGLE-3.1
    if drafter.parallel:  # P-EAGLE's stand-in for the fused layers
        out["mask_hidden"] = state["mask_hidden"].float()
    if with_embeddings:
        out["embed_tokens.weight"] = state["embed_tokens.weight"].float()
    return out


def options_config(drafter: Any) -> dict[str, bool]:
    """EAGLE-3.1's flags as vLLM's Eagle3LlamaForCausalLM and `speculators` read them (all false: EAGLE-3)."""
    return {name: bool(drafter.options.get(name, False)) for name in OPTIONS}


def option_shapes(options: dict[str, bool], s: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """The tensors EAGLE-3.1's flags add: a norm per fused layer, or one on their concatenation."""
    if options.get("fc_norm"):
        return {f"fc_norm.{i}.weight": (s["Ht"],) for i in range(s["k"])}
    if options.get("norm_before_fc"):
        return {"input_norm.weight": (s["k"] * s["Ht"],)}
    return {}


def check_eagle3(tensors: dict[str, torch.Tensor], s: dict[str, int], where: str,
                 options: dict[str, bool] | None = None, parallel: bool = False) -> None:
    """The EAGLE-3 layout's tensors and shapes, EAGLE-3.1's `options` and a `parallel` (P-EAGLE) drafter's
    mask stand-in included."""
    h = s["H"]
    shapes = {**layer_shapes(s, 2 * h), "fc.weight": (h, s["k"] * s["Ht"]), "layers.0.input_layernorm.weight": (h,),
              "layers.0.hidden_norm.weight": (h,), "norm.weight": (h,), "lm_head.weight": (s["Vd"], h),
              "d2t": (s["Vd"],), "t2d": (s["V"],), **option_shapes(options or {}, s)}
    if parallel:  # P-EAGLE's stand-in for the fused layers
        shapes["mask_hidden"] = (1, 1, s["k"] * s["Ht"])
    check_tensors(EAGLE3.name, tensors, shapes, {"embed_tokens.weight"}, where)
    problems = []
    if "d2t" in tensors and tensors["d2t"].dtype != torch.int64:
        problems.append(f"d2t dtype {tensors['d2t'].dtype}, expected int64")
    if "t2d" in tensors and (tensors["t2d"].dtype != torch.bool or int(tensors["t2d"].sum()) != s["Vd"]):
        problems.append("t2d must be bool with exactly Vd true entries")
    if problems:
        raise DraftsmithError(f"{where} breaks the {EAGLE3.name} contract: " + "; ".join(problems))


def eagle3_config(module: Any, layer_ids: list[int], k: int) -> dict[str, Any]:
    s = sizes(module)
    config = llama_layer_config(module, ["LlamaForCausalLMEagle3"])
    config.update({"draft_vocab_size": s["Vd"], "target_hidden_size": s["Ht"], "norm_before_residual": False,
                   "eagle_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}, **options_config(module.drafter)})
    if k != 3:  # vLLM sizes fc from num_aux_hidden_states (default 3)
        config["num_aux_hidden_states"] = k
    return config


def write_eagle3(module: Any, ckpt: dict[str, Any], out: Path, _options: Any) -> list[str]:
    s, ids = sizes(module), list(module.aux_layer_ids)
    tensors = eagle3_tensors(module.drafter)
    check_eagle3(tensors, s, str(out), module.drafter.options, module.drafter.parallel)
    for engine, layer_ids in (("vllm", ids), ("sglang", [i - 1 for i in ids])):
        config = eagle3_config(module, layer_ids, len(ids))
        check_config(config, {"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
                              "vocab_size": s["V"], "draft_vocab_size": s["Vd"], "target_hidden_size": s["Ht"],
                              "tie_word_embeddings": False, "norm_before_residual": False,
                              "eagle_config.eagle_aux_hidden_state_layer_ids": layer_ids, "rope_theta": None,
                              "rope_scaling": None}, str(out / engine))
        config["draftsmith"] = {"kind": EAGLE3.name, "target": module.identity["name"], "provenance": provenance(ckpt),
                                "layer_convention": "sglang (hf id - 1)" if engine == "sglang" else "hf_output_hidden_states"}
        save(out / engine, tensors, config)
    return [str(out / "vllm"), str(out / "sglang")]
