"""The optimizer every draftsmith recipe uses: AdamW, linear warm-up, cosine decay to a floor; the
gradient clipping every training module uses; and `WarmupCosineAdamW`, which gives a module both.

The learning rate rises linearly from 0 over `warmup_steps`, then follows half a cosine down to
`min_lr_ratio · lr` at the end of training (transformers' `get_cosine_with_min_lr_schedule_with_warmup`
when training is bounded by steps). The end is the last step where `trainer.max_steps` (or epochs)
bound training; where only `trainer.max_time` does, the cosine runs over the share of that time spent,
so a run given twenty minutes finishes its schedule in twenty minutes on any machine.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch

from draftsmith import DraftsmithError


def cosine_factor(progress: float, min_lr_ratio: float) -> float:
    """The learning rate ÷ its peak after warm-up, `progress` (0..1) of the way through training."""
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, progress))))


def adamw_warmup_cosine(params: Iterable[torch.nn.Parameter], lr: float, total_steps: float, warmup_steps: int,
                        min_lr_ratio: float, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
                        spent: Callable[[], float] | None = None) -> dict[str, Any]:
    """What `configure_optimizers` returns; the schedule steps every optimizer step.

    spent: the share of a time budget spent so far (0..1); the cosine follows it instead of the steps
    (`total_steps` is then unused)."""
    opt = torch.optim.AdamW([p for p in params if p.requires_grad], lr=lr, betas=tuple(betas), weight_decay=weight_decay)
    decay_steps = max(1, int(total_steps) - warmup_steps) if spent is None else 1

    def factor(step: int) -> float:  # a plain function: LambdaLR keeps no state of it in a checkpoint
        if step < warmup_steps:  # by steps alone: no clock read (under DDP each read is a broadcast)
            return step / warmup_steps
        return cosine_factor((step - warmup_steps) / decay_steps if spent is None else spent(), min_lr_ratio)

    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def budget_timer(trainer: Any) -> Any:
    """Lightning's Timer callback where `trainer.max_time` bounds training, else None."""
    from pytorch_lightning.callbacks import Timer

    timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
    return timer if timer is not None and timer.time_remaining() is not None else None


def time_spent(trainer: Any) -> Callable[[], float]:
    """The share of `trainer.max_time` spent in training, from Lightning's own Timer (which restores it on
    resume and stops the run at 1). Across processes every rank takes rank 0's reading, so that all apply
    the same learning rate."""
    timer = budget_timer(trainer)
    if timer is None:
        raise DraftsmithError("training has no end: set trainer.max_steps (or max_epochs) or trainer.max_time")

    def spent() -> float:
        elapsed = timer.time_elapsed()
        share = elapsed / max(elapsed + timer.time_remaining(), 1e-9)
        return trainer.strategy.broadcast(share) if trainer.world_size > 1 else share
    return spent


def clip_gradients(module: Any, optimizer: torch.optim.Optimizer, clip_val: float | None,
                   algorithm: str | None) -> None:
    """A training module's `configure_gradient_clipping`: Lightning's clipping, except by norm under FSDP.

    Lightning's FSDP precision refuses `gradient_clip_algorithm="norm"` (each rank holds only a shard of
    every gradient); the FSDP root module's own `clip_grad_norm_` reduces the shards' norms across ranks."""
    from pytorch_lightning.strategies import FSDPStrategy

    if clip_val and algorithm in (None, "norm") and isinstance(module.trainer.strategy, FSDPStrategy):
        module.trainer.model.clip_grad_norm_(clip_val)
    else:
        module.clip_gradients(optimizer, gradient_clip_val=clip_val, gradient_clip_algorithm=algorithm)


class WarmupCosineAdamW:
    """Mixed into a training module ahead of `pl.LightningModule`: its `configure_optimizers` (AdamW over
    `trained_parameters()` on `adamw_warmup_cosine`'s schedule, from the hyper-parameters lr, warmup_steps,
    min_lr_ratio, weight_decay and, where the module has it, betas; over steps or, where only max_time
    bounds training, over time) and its `configure_gradient_clipping` (`clip_gradients`)."""

    def trained_parameters(self) -> Iterable[torch.nn.Parameter]:
        return self.parameters()

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self) -> dict[str, Any]:
        h, total = self.hparams, self.trainer.estimated_stepping_batches
        spent = time_spent(self.trainer) if math.isinf(total) else None
        return adamw_warmup_cosine(self.trained_parameters(), h.lr, total, h.warmup_steps,
                                   h.min_lr_ratio, h.weight_decay, betas=h.get("betas", (0.9, 0.999)), spent=spent)
