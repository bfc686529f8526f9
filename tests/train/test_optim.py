"""The learning-rate schedule every recipe uses, at hand-computed points."""

import math

import pytest
import torch

from draftsmith.train.optim import adamw_warmup_cosine


def test_warmup_then_cosine_to_the_floor():
    lr, warmup, total, floor = 1e-3, 10, 110, 0.1
    p = torch.nn.Parameter(torch.zeros(2))
    frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    out = adamw_warmup_cosine([p, frozen], lr, total, warmup, floor, weight_decay=0.01, betas=(0.9, 0.95))
    opt, sched = out["optimizer"], out["lr_scheduler"]["scheduler"]
    assert out["lr_scheduler"]["interval"] == "step"
    assert opt.param_groups[0]["params"] == [p]  # frozen parameters never reach the optimizer
    assert opt.param_groups[0]["betas"] == (0.9, 0.95) and opt.param_groups[0]["weight_decay"] == 0.01
    seen = []
    for _ in range(total + 1):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen[0] == 0.0 and seen[5] == pytest.approx(lr * 5 / 10)  # linear warm-up from 0
    assert seen[warmup] == pytest.approx(lr)  # the peak
    middle = warmup + (total - warmup) // 2  # half way down the cosine: (1 + floor) / 2
    assert seen[middle] == pytest.approx(lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi / 2))))
    assert seen[total] == pytest.approx(lr * floor)  # the floor at the last step
    assert all(a >= b for a, b in zip(seen[warmup:], seen[warmup + 1:]))  # never rises after the peak
