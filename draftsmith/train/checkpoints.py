"""Training checkpoints: which one a run's best or last is, and reading one safely.

The best checkpoint is Lightning's own record: `ModelCheckpoint` keeps `best_model_path` and
`best_model_score` in its callback state, saved inside every checkpoint it writes; the newest
checkpoint of a run therefore says which file scored best (file names and modification times
do not: `best-step=900` sorts after `best-step=1000`). A DeepSpeed ZeRO checkpoint is a
directory; it is consolidated once with DeepSpeed's own converter (through Lightning's wrapper,
which keeps Lightning's state) into `<dir>.fp32.ckpt` beside it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from draftsmith import DraftsmithError


def is_zero_dir(path: Path) -> bool:
    return path.is_dir() and (path / "latest").is_file()


def _candidates(run_dir: Path) -> list[Path]:
    """Every checkpoint under a run directory: .ckpt files and ZeRO .ckpt directories."""
    found = [p for p in run_dir.glob("**/*.ckpt") if p.is_file() or is_zero_dir(p)]
    return [p for p in found if not any(is_zero_dir(parent) for parent in p.parents)]


def checkpoint_state(path: Path) -> dict[str, Any]:
    """A checkpoint's contents without its weights' provenance checks (weights_only: nothing is executed)."""
    if is_zero_dir(path):
        path = consolidate_zero(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # an unexpected object in the pickle: refuse rather than execute it
        raise DraftsmithError(f"{path}: not a checkpoint draftsmith can read safely ({type(e).__name__}: {e})") from None


def training_finished(ckpt: dict[str, Any], max_steps: int = -1, max_time: Any = None) -> bool:
    """Whether the run a checkpoint belongs to has reached its end: `max_steps` steps, or `max_time` (a
    recipe's `trainer.max_time`, in any form Lightning takes) of training by Lightning's Timer."""
    if max_steps > 0 and ckpt.get("global_step", 0) >= max_steps:
        return True
    if max_time is None:
        return False
    from pytorch_lightning.callbacks import Timer

    budget = Timer(duration=max_time).time_remaining()  # not started: the whole duration, in seconds
    spent = next((v["time_elapsed"].get("train", 0.0) for k, v in ckpt.get("callbacks", {}).items()
                  if k.startswith("Timer") and isinstance(v, dict) and "time_elapsed" in v), 0.0)
    return spent >= budget


def validated_score(ckpt: dict[str, Any], monitor: str) -> float | None:
    """`monitor`'s score at the checkpoint's own step, where the run validated at that step (the record
    `save_last_at_stop` keeps); None where it did not."""
    state = ckpt.get("callbacks", {}).get("SaveLastAtStop") or {}
    if state.get("global_step") != ckpt.get("global_step") or monitor not in state.get("scores", {}):
        return None
    return float(state["scores"][monitor])


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


def last_checkpoint(trainer: Any) -> Path | None:
    """The newest last.ckpt (or last-vN.ckpt) in the logger's version directories, for a trainer config
    whose ModelCheckpoints name no dirpath, so that Lightning keeps their files under the logger's version
    (`logs/version_N/checkpoints`); None when there is none, or when they have a fixed place, where
    Lightning finds `last` itself."""
    checkpoints = [cb for cb in trainer.callbacks or [] if str(getattr(cb, "class_path", "")).endswith("ModelCheckpoint")]
    args = getattr(trainer.logger, "init_args", None)
    if not checkpoints or any(cb.init_args.get("dirpath") for cb in checkpoints) or args is None \
            or args.get("version") is not None:
        return None
    base = Path(args.get("save_dir") or trainer.default_root_dir or ".")
    base = base / args["name"] if args.get("name") else base
    found = sorted(base.glob("version_*/checkpoints/last*.ckpt"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def keep_checkpoints_beside(trainer: Any, last: Path) -> None:
    """A resumed run logs to a new version of its logger; its ModelCheckpoints (those given no dirpath)
    keep writing in `last`'s directory, named as the checkpoint recorded it (Lightning restores a
    ModelCheckpoint's best-so-far and its last file only when its dirpath equals the recorded one, and
    records a dirpath it resolved itself unresolved: `runs/...` where a dirpath given is made absolute)."""
    states = checkpoint_state(last).get("callbacks", {})
    recorded = {state.get("dirpath") for key, state in states.items() if str(key).startswith("ModelCheckpoint")}
    here = os.path.realpath(last.parent)
    where = next((d for d in recorded if d and os.path.realpath(d) == here), here)
    for cb in trainer.checkpoint_callbacks:
        if cb.dirpath is None:  # setup() would have put its files in the new version
            cb.dirpath = where


def save_last_at_stop() -> Any:
    """A callback that writes every save_last ModelCheckpoint's last.ckpt where a run stops between its
    periodic saves: at the end of training (a `max_time` budget, or `max_steps` that is no multiple of
    the save interval) and when the run is stopped by SIGTERM (a scheduler's preemption, `kill`, a
    container stopping), which Lightning ends at the end of a training step and, left alone, exits 0
    having saved nothing since the last checkpoint."""
    import pytorch_lightning as pl
    from pytorch_lightning.utilities.exceptions import SIGTERMException
    from pytorch_lightning.utilities.rank_zero import rank_zero_info

    def save(trainer: Any, why: str) -> None:
        for cb in trainer.checkpoint_callbacks:
            if cb.save_last and cb.dirpath:
                path = Path(cb.dirpath) / f"{cb.CHECKPOINT_NAME_LAST}{cb.FILE_EXTENSION}"
                trainer.save_checkpoint(path)
                rank_zero_info(f"{why} after step {trainer.global_step}: saved {path}")

    class SaveLastAtStop(pl.Callback):
        """Also keeps, in every checkpoint, the step and the scores of the run's latest validation
        (`validated_score`): ModelCheckpoint records scores only for the top-k files it writes."""

        def __init__(self) -> None:
            self.validated: dict[str, Any] = {}

        @property
        def state_key(self) -> str:  # the key of its state in a checkpoint's callbacks
            return "SaveLastAtStop"

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            if not trainer.sanity_checking:
                self.validated = {"global_step": trainer.global_step, "scores": {
                    k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}}

        def state_dict(self) -> dict[str, Any]:
            return dict(self.validated)

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.validated = dict(state_dict)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            save(trainer, "training ended")

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            if isinstance(exception, SIGTERMException):
                save(trainer, "stopped by SIGTERM")

    return SaveLastAtStop()
