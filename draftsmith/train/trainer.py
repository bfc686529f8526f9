"""The Trainer `draftsmith fit` builds: Lightning's, with one more precision, "auto".

`precision: auto` (the CPU recipes' setting) becomes "bf16-mixed" where bf16 runs a training
batch's matrix products faster than float32 on the trainer's accelerator, else "32-true"
(`draftsmith.models.precision` measures which; the choice is printed)."""

from __future__ import annotations

from typing import Any, Literal

import pytorch_lightning as pl
from lightning_fabric.connector import _PRECISION_INPUT

from draftsmith.models.precision import resolve_precision


class Trainer(pl.Trainer):
    def __init__(self, *args: Any, accelerator: str | Any = "auto",
                 precision: _PRECISION_INPUT | Literal["auto"] | None = None, **kwargs: Any) -> None:
        """precision: as Lightning's, or "auto": bf16-mixed or 32-true, whichever trains faster here (measured)."""
        super().__init__(*args, accelerator=accelerator, precision=resolve_precision(precision, accelerator), **kwargs)
