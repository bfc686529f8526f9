"""draftsmith's own format: what the runtime loads (`models.loading`).

Feature drafters: config.json (kind, sizes, target identity, layer ids and their convention,
draft vocabulary, provenance) + model.safetensors with the trained weights, the target's frozen
embedding and head left out (they come back from the target). Standalone draft LMs: a
transformers model directory + draftsmith.json (+ the training data's token counts).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from draftsmith.train.checkpoints import best_scores
from draftsmith.export.common import provenance, sizes
from draftsmith.models.loading import NATIVE_FORMAT, STANDALONE_FILE, TOKEN_COUNTS
from draftsmith.models.registry import drafter_kind


def native_config(module: Any, ckpt: dict[str, Any]) -> dict[str, Any]:
    kind = drafter_kind(ckpt["draftsmith"]["kind"])
    best = best_scores(ckpt)
    config = {
        "format": NATIVE_FORMAT, "kind": kind.name, "target": module.identity,
        "layer_convention": "hf_output_hidden_states",  # id i = output_hidden_states[i]
        "final_feature": "post-norm last hidden state",
        "aux_layer_ids": getattr(module, "aux_layer_ids", []),
        "provenance": {**provenance(ckpt), "hyper_parameters": dict(ckpt["hyper_parameters"]), "best_scores": best},
    }
    if not kind.reads_features:
        config["model_config"] = module.student.config.to_dict()
    else:
        config["sizes"] = sizes(module)
        config["draft_vocab_size"] = module.drafter.vocab_size
        config["layer_config"] = module.drafter.config.to_dict()
        config["drafter_options"] = dict(module.drafter.options)
    return config


def write_native(module: Any, ckpt: dict[str, Any], out: Path, _options: Any) -> list[str]:
    from safetensors.torch import save_file

    from draftsmith.export.common import save

    config = native_config(module, ckpt)
    kind = drafter_kind(config["kind"])
    if not kind.reads_features:
        from peft import PeftModel

        student = module.student.merge_and_unload() if isinstance(module.student, PeftModel) else module.student
        student.save_pretrained(out)
        module.student = student
        if getattr(module, "token_counts", None) is not None:  # for the runtime's frequency-ranked head
            save_file({"token_counts": module.token_counts.long().contiguous()}, str(out / TOKEN_COUNTS))
            config["token_counts"] = TOKEN_COUNTS
        (out / STANDALONE_FILE).write_text(json.dumps(config, indent=2) + "\n")
        return [str(out)]
    tensors = {k: v.detach().contiguous() for k, v in module.drafter.state_dict().items() if k not in kind.frozen}
    save(out, tensors, config)
    return [str(out)]
