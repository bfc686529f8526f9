"""The "speculators" format of block drafters: the `speculators` package's DFlash and DSpark models
(`DFlashSpeculator`, `DSparkSpeculator`), which vLLM names `qwen3_dflash` / DSpark.

`transformer_layer_config` is a Qwen3 config of the draft layers (their count, the target's sizes;
Qwen3's layer is the one with per-head q/k norms); `block_size`, `mask_token_id`,
`aux_hidden_state_layer_ids` and `sample_from_anchor` (DFlash false: its anchor slot drafts nothing;
DSpark true) say how a block is laid out; DSpark adds `markov_rank` (0: no sequential head) and its
confidence head. The weights keep the module's names (the package's), with `embed_tokens.weight` (the
package would leave a missing one uninitialized) and without `lm_head.weight` over the full vocabulary
(the package and vLLM take the target's head then, as the drafter did).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from draftsmith.export.common import check_config, llama_layer_config, provenance, save, sizes


def qwen3_layer_config(module: Any) -> dict[str, Any]:
    """The draft layers' config as the package reads it (a Qwen3 config)."""
    layer = llama_layer_config(module, ["Qwen3ForCausalLM"])
    cfg = module.drafter.config
    layer.update(model_type="qwen3", num_hidden_layers=cfg.num_hidden_layers, use_sliding_window=False,
                 rope_parameters=dict(cfg.rope_parameters))
    return layer


def block_tensors(drafter: Any) -> dict[str, Any]:
    tensors = {k: v.detach().float().contiguous() if v.is_floating_point() else v.detach().contiguous()
               for k, v in drafter.state_dict().items()}
    if drafter.draft_to_target is None:
        del tensors["lm_head.weight"]  # the target's own head, rebuilt from the verifier
    return tensors


def write_block_speculators(module: Any, ckpt: dict[str, Any], out: Path, options: Any, verifier: str) -> list[str]:
    drafter, kind = module.drafter, module.kind
    s, ids = sizes(module), list(module.aux_layer_ids)
    algorithm = kind.speculators_algorithm
    architecture = kind.speculators_architecture
    tokens = min(options.speculative_tokens, drafter.drafts_per_block) if options.speculative_tokens else \
        drafter.drafts_per_block
    config = {
        "architectures": [architecture], "speculators_model_type": algorithm,
        "transformer_layer_config": qwen3_layer_config(module), "draft_vocab_size": s["Vd"],
        "block_size": drafter.block_size, "target_hidden_size": s["Ht"], "aux_hidden_state_layer_ids": ids,
        "mask_token_id": drafter.mask_token_id, "sliding_window_non_causal": False,
        "sample_from_anchor": drafter.sample_from_anchor,
        "speculators_config": {
            "algorithm": algorithm, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens}],
            "verifier": {"name_or_path": verifier, "architectures": [module.identity["architecture"]]},
        },
        "torch_dtype": "float32",
        "draftsmith": {"kind": kind.name, "target": module.identity["name"], "target_identity": module.identity,
                       "drafter_options": dict(drafter.options), "provenance": provenance(ckpt)},
    }
    if drafter.sample_from_anchor:  # DSpark's heads (markov_rank 0: none)
        rank = drafter.options["markov_rank"]
        config.update(markov_rank=rank, markov_head_type="vanilla",
                      enable_confidence_head=drafter.confidence_head is not None,
                      confidence_head_with_markov=bool(rank))
    check_config(config, {"architectures": [architecture], "speculators_model_type": algorithm,
                          "transformer_layer_config.num_hidden_layers": drafter.options["draft_layers"],
                          "draft_vocab_size": s["Vd"], "aux_hidden_state_layer_ids": ids,
                          "mask_token_id": drafter.mask_token_id, "speculators_config.algorithm": algorithm,
                          "speculators_config.verifier.name_or_path": None}, str(out))
    save(out, block_tensors(drafter), config)
    return [str(out)]
