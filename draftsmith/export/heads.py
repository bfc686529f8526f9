"""Stop heads travel inside the drafter's native export: `draftsmith export HEAD_RUN --format native
--out DRAFTER_EXPORT` adds the head's weights (stop_heads.safetensors, `<kind>.<parameter>`) and its
section (config.json's or draftsmith.json's `stop_heads.<kind>`: head config, the target and drafter it
was trained for, its labels and provenance; `draftsmith tune` adds the tuned thresholds)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftsmith import DraftsmithError


def export_stop_head(ckpt: dict[str, Any], fmt: str, out: str) -> dict[str, Any]:
    from draftsmith.export.checkpoint import module_from_checkpoint
    from draftsmith.train.checkpoints import best_scores
    from draftsmith.models.heads import head_config
    from draftsmith.models.loading import native_config_path, update_stop_heads
    from draftsmith.runtime.loading import load_proposer, load_stop_head, stop_head_mismatch
    from draftsmith.runtime.policies import policy_kind
    from draftsmith.models.target import load_target

    kind = ckpt["draftsmith"]["kind"]
    if fmt != "native":
        raise DraftsmithError(f"a {kind} stop head travels inside its drafter's native export: "
                              "--format native --out DRAFTER_EXPORT_DIR")
    native_config_path(out)  # refuses a directory that is not a native drafter export
    module = module_from_checkpoint(ckpt)
    run = ckpt["draftsmith"]["labels_run"]
    best = best_scores(ckpt)
    section = {"head": head_config(module.head), "target": run["target"], "drafter": run["drafter"],
               "label": module.hparams.label,
               "labels": {k: run[k] for k in ("k", "top_k", "chain", "data", "max_positions")},
               "provenance": {"checkpoint": ckpt["path"], "global_step": ckpt.get("global_step"), "best_scores": best,
                              "hyper_parameters": {k: v for k, v in ckpt["hyper_parameters"].items() if not k.startswith("_")}},
               "tuned": {}}
    target = load_target(module.hparams.target, dtype="float32", chat_template=module.hparams.get("chat_template"),
                         template_kwargs=module.hparams.get("template_kwargs"))
    proposer, _ = load_proposer(out, target, run["drafter"]["head_vocab"])
    diffs = stop_head_mismatch(section, target, proposer)
    if diffs:
        raise DraftsmithError(f"this {kind} stop head was trained for another drafter or target than the export in {out} "
                              f"({'; '.join(diffs)}); label that drafter (`draftsmith labels`) and train the head again")
    update_stop_heads(out, kind, section, module.head.state_dict())
    reloaded, _ = load_stop_head(out, policy_kind(kind), target, proposer)
    g = torch.Generator().manual_seed(0)
    x = [torch.randn(16, width, generator=g) for width in module.head.input_widths()]
    with torch.no_grad():
        error = float((module.head.float()(*x) - reloaded.float()(*x)).abs().max())
    if error > 1e-5:
        raise DraftsmithError(f"{out}: the reloaded {kind} head's outputs differ from the trained one's by {error:.2e}")
    return {"format": fmt, "kind": kind, "out": str(out), "directories": [str(Path(out))], "max_logit_error": error,
            "checkpoint": ckpt["path"]}
