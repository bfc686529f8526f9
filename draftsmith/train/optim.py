"""The optimizer every draftsmith recipe uses: AdamW, linear warm-up, cosine decay to a floor."""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch


def adamw_warmup_cosine(params: Iterable[torch.nn.Parameter], lr: float, total_steps: int, warmup_steps: int,
                        min_lr_ratio: float, weight_decay: float = 0.0,
                        betas: tuple[float, float] = (0.9, 0.999)) -> dict[str, Any]:
    """What `configure_optimizers` returns; the schedule steps every optimizer step."""
    opt = torch.optim.AdamW([p for p in params if p.requires_grad], lr=lr, betas=tuple(betas), weight_decay=weight_decay)
    total = max(1, int(total_steps))

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
