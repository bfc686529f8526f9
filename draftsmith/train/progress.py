"""A training run's progress as plain lines: in `train.log` beside the run's logs, and on stderr when
stderr is not a terminal (a redirected or backgrounded run, where Lightning's progress bar prints
nothing), so that `make demo > log` shows where training is."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import RichProgressBar

from draftsmith.progress import clock
from draftsmith.train.optim import budget_timer


class ProgressLog(pl.Callback):
    """A line every `every_seconds` of training (and after each validation): step, the mean loss of the steps
    since the line before (one step's loss swings widely from batch to batch), learning rate, elapsed and
    remaining time, the latest validation τ̂."""

    def __init__(self, every_seconds: float = 30.0, to_stderr: bool | None = None):
        self.every = every_seconds
        self.to_stderr = (not sys.stderr.isatty()) if to_stderr is None else to_stderr
        self.path: Path | None = None
        self.start = self.last = 0.0
        self.loss_sum: Any = None  # the losses the training steps returned since the last line
        self.loss_steps = 0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        log_dir = trainer.log_dir if trainer.loggers else None  # a broadcast: every rank asks
        if not trainer.is_global_zero:
            return
        where = Path(log_dir or trainer.default_root_dir)
        where.mkdir(parents=True, exist_ok=True)
        self.path = where / "train.log"
        self.start = self.last = time.perf_counter()
        budget = f"{trainer.max_steps} steps" if trainer.max_steps > 0 else None
        timer = budget_timer(trainer)
        if timer is not None:
            limit = clock(round(timer.time_elapsed() + timer.time_remaining()))
            budget = f"{budget} or {limit}, whichever ends first" if budget else limit
        self._write(f"training {type(pl_module).__name__} for {budget or 'the epochs set'} ({self.path})")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.path is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else None  # the step's loss ÷ accumulated batches
        if loss is not None:  # summed on the loss's device; read once a line
            loss = loss.detach() * trainer.accumulate_grad_batches
            self.loss_sum = loss if self.loss_sum is None else self.loss_sum + loss
            self.loss_steps += 1
        now = time.perf_counter()
        if now - self.last < self.every:
            return
        self.last = now
        step, total = trainer.global_step, trainer.max_steps
        elapsed = now - self.start
        timer = budget_timer(trainer)
        by_steps = elapsed / step * (total - step) if step and total and total > 0 else None
        by_time = timer.time_remaining() if timer is not None else None
        remaining = [t for t in (by_steps, by_time) if t is not None]
        left = f", ~{clock(max(min(remaining), 0.0))} left" if remaining else ""
        loss = None if self.loss_sum is None else float(self.loss_sum) / self.loss_steps
        self.loss_sum, self.loss_steps = None, 0
        lr = trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else None
        parts = [f"step {step}/{total}" if total and total > 0 else f"step {step}",
                 f"loss {loss:.4f}" if loss is not None else None,
                 f"lr {lr:.2e}" if lr is not None else None, f"{clock(elapsed)} elapsed{left}"]
        self._write("  ".join(p for p in parts if p))

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self.path is None or trainer.sanity_checking:
            return
        metrics = trainer.callback_metrics
        shown = [k for k in ("val/loss", "val/tau", "val/tau_t1", "val/confidence_auroc") if k in metrics]
        elapsed = clock(time.perf_counter() - self.start)
        self._write(f"step {trainer.global_step} validation at {elapsed}: "
                    + "  ".join(f"{k} {float(metrics[k]):.4f}" for k in shown))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.path is not None:
            self._write(f"done: {trainer.global_step} steps in {clock(time.perf_counter() - self.start)}")

    def _write(self, line: str) -> None:
        stamped = f"{time.strftime('%H:%M:%S')} {line}"
        with open(self.path, "a") as f:
            f.write(stamped + "\n")
        if self.to_stderr:
            print(stamped, file=sys.stderr, flush=True)


class RichBar(RichProgressBar):
    """Lightning's rich progress bar, its epoch shown without a total when epochs are unbounded: a run bounded
    by time or steps alone has `max_epochs` -1, which Lightning 2.6 shows as "Epoch 1/-2" (its issue 21925)."""

    def _get_train_description(self, current_epoch: int) -> str:
        epochs = self.trainer.max_epochs
        if epochs is None or epochs >= 0:
            return super()._get_train_description(current_epoch)
        return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"


def mend_progress_bar(trainer: Any) -> None:
    """Make the RichProgressBar the trainer adds by default (with `rich` installed) a `RichBar`, its settings kept."""
    for bar in trainer.callbacks:
        if type(bar) is RichProgressBar:
            bar.__class__ = RichBar
