"""The "speculators" format: the `speculators` library's Eagle3Speculator (and PEagleSpeculator, the same
layout with `mask_token_id` and `mask_hidden`), which vLLM serves directly (`vllm serve EXPORT_DIR` reads
the verifier from it); block drafters' (DFlash, DSpark) are written by `export/block.py`.

`transformer_layer_config` holds the Llama layer config; `norm_before_residual` is written
explicitly (vLLM defaults it to true); `speculators_config` names the proposal method and the
verifier. The verifier must resolve outside draftsmith: a local model directory with config and
tokenizer (an embedded or GGUF target's dequantized copy) or a hub id given with `--verifier`;
draftsmith's own name for the target goes in the `draftsmith` block. Weights as in the eagle3
format plus `embed_tokens.weight` (the `speculators` package leaves a missing embedding at zero
without a warning; vLLM shares the target's copy either way), saved as model.safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from draftsmith import DraftsmithError
from draftsmith.export.common import check_config, llama_layer_config, provenance, save, sizes
from draftsmith.export.eagle3 import check_eagle3, eagle3_tensors, options_config
def verifier_path(identity: dict[str, Any], verifier: str | None) -> str:
    """What `speculators_config.verifier.name_or_path` should say: `verifier` when given (checked
    against the drafter's target where it is a local directory), else the target's local directory."""
    from draftsmith.models.sources import resolve_source

    if verifier is None:
        if identity.get("adapter"):
            raise DraftsmithError("the drafter's target has a LoRA adapter merged in: save the merged model and "
                                  "name it with --verifier (a local directory or a hub id)")
        source = resolve_source(identity["name"])
        path = Path(source)
        return str(path.resolve()) if path.is_dir() else source
    if verifier.startswith("embedded:"):
        raise DraftsmithError("--verifier: an embedded alias means nothing to vLLM or the speculators package; "
                              "leave --verifier out (its dequantized directory is named) or give a directory or hub id")
    path = Path(verifier).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise DraftsmithError(f"--verifier {verifier}: no config.json there (expected a model directory)")
        config = json.loads((path / "config.json").read_text())
        config = config.get("text_config", config)
        found = {k: config.get(k) for k in ("hidden_size", "vocab_size")}
        wanted = {k: identity[k] for k in found}
        if found != wanted:
            raise DraftsmithError(f"--verifier {verifier} is not the drafter's target: {found}, expected {wanted}")
        return str(path.resolve())
    return verifier


def write_speculators(module: Any, ckpt: dict[str, Any], out: Path, options: Any) -> list[str]:
    if module.kind.blocks:  # DFlash, DSpark: export/block.py
        from draftsmith.export.block import write_block_speculators

        return write_block_speculators(module, ckpt, out, options,
                                       verifier_path(module.identity, options.verifier))
    s, ids = sizes(module), list(module.aux_layer_ids)
    tensors = eagle3_tensors(module.drafter, with_embeddings=True)
    check_eagle3(tensors, s, str(out), module.drafter.options, module.drafter.parallel)
    layer = llama_layer_config(module, ["LlamaForCausalLM"])
    algorithm = module.kind.speculators_algorithm  # eagle3, or peagle (P-EAGLE: its mask token and mask_hidden)
    architecture = module.kind.speculators_architecture
    parallel = {"mask_token_id": module.drafter.mask_token_id} if module.kind.parallel else {}
    config = {
        "architectures": [architecture], "speculators_model_type": algorithm, **parallel,
        "transformer_layer_config": layer, "draft_vocab_size": s["Vd"], "target_hidden_size": s["Ht"],
        "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": ids, **options_config(module.drafter),
        "speculators_config": {
            "algorithm": algorithm, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": options.speculative_tokens or 3}],
            "verifier": {"name_or_path": verifier_path(module.identity, options.verifier),
                         "architectures": [module.identity["architecture"]]},
        },
        "torch_dtype": "float32",
        "draftsmith": {"kind": module.kind.name, "target": module.identity["name"], "target_identity": module.identity,
                       "provenance": provenance(ckpt)},
    }
    check_config(config, {"architectures": [architecture], "speculators_model_type": algorithm, **parallel,
                          "transformer_layer_config": None, "draft_vocab_size": s["Vd"],
                          "target_hidden_size": s["Ht"], "norm_before_residual": False,
                          "eagle_aux_hidden_state_layer_ids": ids, "speculators_config.algorithm": algorithm,
                          "speculators_config.default_proposal_method": "greedy",
                          "speculators_config.verifier.name_or_path": None}, str(out))
    methods = [m["proposal_type"] for m in config["speculators_config"]["proposal_methods"]]
    if config["speculators_config"]["default_proposal_method"] not in methods:
        raise DraftsmithError(f"{out}: default_proposal_method is not among proposal_methods {methods}")
    save(out, tensors, config)
    return [str(out)]
