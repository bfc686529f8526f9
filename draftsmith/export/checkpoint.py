"""A training checkpoint → its trained LightningModule, for the export writers (finding and reading
checkpoints: `train/checkpoints.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftsmith import DraftsmithError
from draftsmith.models.registry import DrafterKind, trained_kind
from draftsmith.train.checkpoints import is_zero_dir, best_checkpoint, checkpoint_state


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a draftsmith training checkpoint: a .ckpt file, a ZeRO directory, or a run directory
    (its best checkpoint, as Lightning recorded it)."""
    path = Path(path)
    if path.is_dir() and not is_zero_dir(path):
        path = best_checkpoint(path)
    if not path.exists():
        raise DraftsmithError(f"checkpoint {path} not found")
    ckpt = checkpoint_state(path)
    if "draftsmith" not in ckpt or "hyper_parameters" not in ckpt:
        raise DraftsmithError(f"{path} is not a draftsmith training checkpoint (no draftsmith metadata)")
    ckpt["path"] = str(path)
    return ckpt


def module_from_checkpoint(ckpt: dict[str, Any]) -> Any:
    """Rebuild the trained LightningModule (target parts come back from the target itself)."""
    hp = {k: v for k, v in ckpt["hyper_parameters"].items() if not k.startswith("_")}  # LightningCLI adds _class_path
    kind = trained_kind(ckpt["draftsmith"]["kind"])
    if isinstance(kind, DrafterKind) and kind.blocks:  # one written while BlockDrafterModule extended DrafterModule
        # holds EAGLE's settings too, at their defaults
        from draftsmith.train.drafter import EAGLE_SETTINGS

        hp = {k: v for k, v in hp.items() if k not in EAGLE_SETTINGS}
    module = kind.trainer_class(**hp)
    if "drafter.d2t" in ckpt["state_dict"]:  # the draft vocabulary the checkpoint was trained with
        d2t = ckpt["state_dict"]["drafter.d2t"]
        module.drafting.forced_draft_ids = torch.arange(len(d2t)) + d2t
    module.on_load_checkpoint(ckpt)
    state = {k.removeprefix("_forward_module."): v for k, v in ckpt["state_dict"].items()}
    module.load_state_dict(state)
    return module.eval()
