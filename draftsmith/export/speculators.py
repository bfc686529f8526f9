"""The "speculators" format: vLLM's native speculator config (Eagle3Speculator), EAGLE-3 drafters.

`transformer_layer_config` holds the Llama layer config; `norm_before_residual` is written
explicitly (vLLM defaults it to true); `speculators_config` names the proposal method and the
verifier. Weights as in the eagle3 format, saved as model.safetensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from draftsmith import DraftsmithError
from draftsmith.export.common import check_config, llama_layer_config, save, sizes
from draftsmith.export.eagle3 import check_eagle3, eagle3_tensors


def write_speculators(module: Any, ckpt: dict[str, Any], out: Path, k: int) -> list[str]:
    s, ids = sizes(module), list(module.aux_layer_ids)
    tensors = eagle3_tensors(module.drafter)
    check_eagle3(tensors, s, str(out))
    layer = llama_layer_config(module, ["LlamaForCausalLM"])
    config = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "transformer_layer_config": layer, "draft_vocab_size": s["Vd"], "target_hidden_size": s["Ht"],
        "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": ids,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k}],
            "verifier": {"name_or_path": module.identity["name"], "architectures": [module.identity["architecture"]]},
        },
        "torch_dtype": "float32",
    }
    check_config(config, {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                          "transformer_layer_config": None, "draft_vocab_size": s["Vd"],
                          "target_hidden_size": s["Ht"], "norm_before_residual": False,
                          "eagle_aux_hidden_state_layer_ids": ids, "speculators_config.algorithm": "eagle3",
                          "speculators_config.default_proposal_method": "greedy",
                          "speculators_config.verifier.name_or_path": None}, str(out))
    methods = [m["proposal_type"] for m in config["speculators_config"]["proposal_methods"]]
    if config["speculators_config"]["default_proposal_method"] not in methods:
        raise DraftsmithError(f"{out}: default_proposal_method is not among proposal_methods {methods}")
    save(out, tensors, config)
    return [str(out)]
