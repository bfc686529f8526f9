"""The Trainer `draftsmith fit` builds: Lightning's, with one more precision, "auto", and the callback
that keeps a run's memory from growing.

`precision: auto` (the CPU recipes' setting) becomes "bf16-mixed" where bf16 runs a training
batch's matrix products faster than float32 on the trainer's accelerator, else "32-true"
(`draftsmith.models.precision` measures which; the choice is printed)."""

from __future__ import annotations

from typing import Any, Literal

import pytorch_lightning as pl
from lightning_fabric.connector import _PRECISION_INPUT

from draftsmith.memory import release_freed_memory
from draftsmith.models.precision import resolve_precision


class Trainer(pl.Trainer):
    def __init__(self, *args: Any, accelerator: str | Any = "auto",
                 precision: _PRECISION_INPUT | Literal["auto"] | None = None, **kwargs: Any) -> None:
        """Lightning's Trainer with one more precision (every other option is Lightning's own).

        Args:
            accelerator: "cpu", "gpu", "cuda", "mps", "tpu", or "auto" (the one this machine has).
            precision: as Lightning's ("32-true", "bf16-mixed", ...), or "auto": bf16-mixed or 32-true, whichever
                trains faster on this machine (measured once and printed).
        """
        super().__init__(*args, accelerator=accelerator, precision=resolve_precision(precision, accelerator), **kwargs)


class ReleaseFreedMemory(pl.Callback):
    """Every `every_n_steps` training steps and after each validation, hand the pages of freed blocks back
    to the system (`draftsmith.memory`): without it a CPU run's resident memory grows with every batch shape."""

    def __init__(self, every_n_steps: int = 10):
        self.every = every_n_steps

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step % self.every == 0:
            release_freed_memory()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        release_freed_memory()
