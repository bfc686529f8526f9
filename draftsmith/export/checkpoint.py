"""Training checkpoints: which one a run's best is, reading it safely, rebuilding its module.

The best checkpoint is Lightning's own record: `ModelCheckpoint` keeps `best_model_path` and
`best_model_score` in its callback state, saved inside every checkpoint it writes; the newest
checkpoint of a run therefore says which file scored best (file names and modification times
do not: `best-step=900` sorts after `best-step=1000`). A DeepSpeed ZeRO checkpoint is a
directory; it is consolidated once with DeepSpeed's own converter (through Lightning's wrapper,
which keeps Lightning's state) into `<dir>.fp32.ckpt` beside it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftsmith import DraftsmithError


def _is_zero_dir(path: Path) -> bool:
    return path.is_dir() and (path / "latest").is_file()


def _candidates(run_dir: Path) -> list[Path]:
    """Every checkpoint under a run directory: .ckpt files and ZeRO .ckpt directories."""
    found = [p for p in run_dir.glob("**/*.ckpt") if p.is_file() or _is_zero_dir(p)]
    return [p for p in found if not any(_is_zero_dir(parent) for parent in p.parents)]


def checkpoint_state(path: Path) -> dict[str, Any]:
    """A checkpoint's contents without its weights' provenance checks (weights_only: nothing is executed)."""
    if _is_zero_dir(path):
        path = consolidate_zero(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # an unexpected object in the pickle: refuse rather than execute it
        raise DraftsmithError(f"{path}: not a checkpoint draftsmith can read safely ({type(e).__name__}: {e})") from None


def monitored_records(ckpt: dict[str, Any]) -> list[dict[str, Any]]:
    """The states a checkpoint holds of its run's monitored ModelCheckpoints (monitor, best_model_path,
    best_model_score, best_k_models, ...), in callback order; unmonitored ones (last.ckpt by steps) left out."""
    return [v for k, v in ckpt.get("callbacks", {}).items()
            if k.startswith("ModelCheckpoint") and isinstance(v, dict) and v.get("monitor")]


def best_scores(ckpt: dict[str, Any]) -> dict[str, float]:
    """Each monitored ModelCheckpoint's best score so far, by its callback state key."""
    return {k: float(v["best_model_score"]) for k, v in ckpt.get("callbacks", {}).items()
            if isinstance(v, dict) and v.get("best_model_score") is not None}


def best_checkpoint(run_dir: str | Path) -> Path:
    """The checkpoint Lightning's ModelCheckpoint recorded as best in the run's newest checkpoint;
    the newest checkpoint itself when no monitored ModelCheckpoint ran."""
    run_dir = Path(run_dir)
    found = _candidates(run_dir)
    if not found:
        raise DraftsmithError(f"no checkpoint (*.ckpt) under {run_dir}; train first (`draftsmith fit --config RECIPE`)")
    newest = max(found, key=lambda p: (p.stat().st_mtime, p.name == "last.ckpt"))
    records = [v for v in monitored_records(checkpoint_state(newest)) if v.get("best_model_path")]
    if not records:
        return newest
    recorded = Path(records[0]["best_model_path"])
    if recorded.exists():
        return recorded
    moved = [p for p in found if p.name == recorded.name]  # the run directory was moved or copied
    if len(moved) == 1:
        return moved[0]
    raise DraftsmithError(f"{newest} records {recorded} as the best checkpoint, which is not under {run_dir}; "
                          "pass the checkpoint file itself")


def consolidate_zero(directory: Path) -> Path:
    """A DeepSpeed ZeRO checkpoint directory → one fp32 Lightning checkpoint beside it (done once)."""
    out = directory.with_name(directory.name + ".fp32.ckpt")
    if out.is_file() and out.stat().st_mtime >= (directory / "latest").stat().st_mtime:
        return out
    try:
        from pytorch_lightning.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict
    except ImportError:
        raise DraftsmithError(f"{directory} is a DeepSpeed ZeRO checkpoint: `pip install deepspeed` to convert it") from None
    tmp = out.with_name(out.name + ".tmp")
    try:
        convert_zero_checkpoint_to_fp32_state_dict(str(directory), str(tmp))
    except ModuleNotFoundError:
        raise DraftsmithError(f"{directory} is a DeepSpeed ZeRO checkpoint: `pip install deepspeed` to convert it") from None
    tmp.replace(out)
    return out


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a draftsmith training checkpoint: a .ckpt file, a ZeRO directory, or a run directory
    (its best checkpoint, as Lightning recorded it)."""
    path = Path(path)
    if path.is_dir() and not _is_zero_dir(path):
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
    kind = ckpt["draftsmith"]["kind"]
    if kind in ("specdec", "disco"):
        from draftsmith.train.heads import StopHeadModule

        module = StopHeadModule(**hp)
    elif kind == "standalone":
        from draftsmith.train.distill import DistillModule

        module = DistillModule(**hp)
    else:
        from draftsmith.train.drafter import DrafterModule

        module = DrafterModule(**hp)
        if kind == "eagle3":
            d2t = ckpt["state_dict"]["drafter.d2t"]
            module.forced_draft_ids = torch.arange(len(d2t)) + d2t
    module.on_load_checkpoint(ckpt)
    state = {k.removeprefix("_forward_module."): v for k, v in ckpt["state_dict"].items()}
    module.load_state_dict(state)
    return module.eval()
