"""The eagle format: EAGLE-1/2 and HASS drafters for vLLM, SGLang and the EAGLE reference code.

Input at position t: concat(embed(x_{t+1}), f_t), embeddings first; f_t the target's post-norm
last hidden state. One decoder layer without its input norm, no final norm, no head (the
target's is used). vLLM builds fc without a bias and drops a stored one; SGLang and the
reference code build it with one and leave it random when absent: draftsmith trains without a
bias and writes `fc.bias` as zeros. `architectures` differs per engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftsmith.models.registry import EAGLE
from draftsmith.export.common import (check_config, check_tensors, layer_shapes, layer_tensors, llama_layer_config,
                                     provenance, save, sizes)

ENGINES = {"vllm": ["LlamaForCausalLM"], "sglang": ["LlamaForCausalLMEagle"], "eagle-reference": ["LlamaForCausalLM"]}


def eagle_tensors(drafter: Any, with_embeddings: bool = True) -> dict[str, torch.Tensor]:
    """fc (+ zero bias), layers.0.* without the input norm, the embedding."""
    fc = drafter.fc.weight.detach().float().contiguous()
    out = {"fc.weight": fc, "fc.bias": torch.zeros(fc.shape[0]), **layer_tensors(drafter)}
    if with_embeddings:
        out["embed_tokens.weight"] = drafter.embed_tokens.weight.detach().float().contiguous()
    return out


def check_eagle(tensors: dict[str, torch.Tensor], s: dict[str, int], where: str) -> None:
    shapes = {**layer_shapes(s, s["H"]), "fc.weight": (s["H"], 2 * s["H"]), "fc.bias": (s["H"],)}
    check_tensors(EAGLE.name, tensors, shapes, {"embed_tokens.weight"}, where)


def write_eagle(module: Any, ckpt: dict[str, Any], out: Path, _options: Any) -> list[str]:
    s = sizes(module)
    tensors = eagle_tensors(module.drafter)
    check_eagle(tensors, s, str(out))
    for engine, arch in ENGINES.items():
        config = llama_layer_config(module, arch)
        config["draftsmith"] = {"kind": EAGLE.name, "target": module.identity["name"],
                                "feature": "post-norm last hidden state", "input": "concat(embed, feature)",
                                "provenance": provenance(ckpt)}
        check_config(config, {"architectures": arch, "num_hidden_layers": 1, "hidden_size": s["H"],
                              "vocab_size": s["V"], "rope_theta": None, "rope_scaling": None}, str(out / engine))
        save(out / engine, tensors, config, bin_file=engine == "eagle-reference")
    return [str(out / e) for e in ENGINES]
