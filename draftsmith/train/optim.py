"""The optimizer every draftsmith recipe uses: AdamW, linear warm-up, cosine decay to a floor; the
gradient clipping every training module uses; and `WarmupCosineAdamW`, which gives a module both.

The schedule is transformers' `get_cosine_with_min_lr_schedule_with_warmup`: the learning rate rises
linearly from 0 over `warmup_steps`, then follows half a cosine down to `min_lr_ratio · lr` at the
last step.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch


def adamw_warmup_cosine(params: Iterable[torch.nn.Parameter], lr: float, total_steps: int, warmup_steps: int,
                        min_lr_ratio: float, weight_decay: float = 0.0,
                        betas: tuple[float, float] = (0.9, 0.999)) -> dict[str, Any]:
    """What `configure_optimizers` returns; the schedule steps every optimizer step."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    opt = torch.optim.AdamW([p for p in params if p.requires_grad], lr=lr, betas=tuple(betas), weight_decay=weight_decay)
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(opt, warmup_steps, max(1, int(total_steps)),
                                                            min_lr_rate=min_lr_ratio)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


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
    min_lr_ratio, weight_decay and, where the module has it, betas) and its `configure_gradient_clipping`
    (`clip_gradients`)."""

    def trained_parameters(self) -> Iterable[torch.nn.Parameter]:
        return self.parameters()

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self) -> dict[str, Any]:
        h = self.hparams
        return adamw_warmup_cosine(self.trained_parameters(), h.lr, self.trainer.estimated_stepping_batches,
                                   h.warmup_steps, h.min_lr_ratio, h.weight_decay, betas=h.get("betas", (0.9, 0.999)))
