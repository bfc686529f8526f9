"""The learning-rate schedule every recipe uses, at hand-computed points."""

import math
import time

import pytest
import pytorch_lightning as pl
import torch

from draftsmith import DraftsmithError
from draftsmith.train.optim import WarmupCosineAdamW, adamw_warmup_cosine


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


def test_a_time_budget_runs_the_cosine_over_the_share_of_time_spent():
    lr, warmup, floor = 1e-3, 4, 0.1
    clock = [0.0]
    p = torch.nn.Parameter(torch.zeros(2))
    out = adamw_warmup_cosine([p], lr, 0, warmup, floor, spent=lambda: clock[0])
    opt, sched = out["optimizer"], out["lr_scheduler"]["scheduler"]
    seen = []
    for step in range(40):  # the step count says nothing of the end: the clock reaches it at step 24
        clock[0] = min(1.0, max(0.0, (step - warmup) / 20))
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen[0] == 0.0 and seen[2] == pytest.approx(lr * 2 / 4)  # warm-up by steps, as before
    # the factor at step s is read when the scheduler steps into s, with the clock at s - 1
    assert seen[warmup + 11] == pytest.approx(lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi / 2))))
    assert seen[-1] == pytest.approx(lr * floor)  # the floor once the budget is spent, however many steps


class _Budgeted(WarmupCosineAdamW, pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.save_hyperparameters(dict(lr=1e-2, warmup_steps=2, min_lr_ratio=0.1, weight_decay=0.0))
        self.w = torch.nn.Linear(2, 1)
        self.lrs: list[float] = []

    def training_step(self, batch, _):
        time.sleep(0.02)
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        return self.w(batch[0]).pow(2).mean()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2)), batch_size=2)


def test_a_run_bounded_only_by_max_time_ends_its_schedule_at_the_floor(tmp_path):
    module = _Budgeted()
    trainer = pl.Trainer(max_steps=-1, max_time={"seconds": 2}, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module)
    lrs = module.lrs
    assert len(lrs) > 20  # stopped by the time budget, after many epochs
    assert max(lrs) > 0.9e-2 and lrs[-1] < 0.15e-2  # the peak early, near the floor (1e-3) at the end
    assert all(a >= b - 1e-12 for a, b in zip(lrs[2:], lrs[3:]))  # never rises after the warm-up


def test_a_run_without_an_end_is_refused(tmp_path):
    trainer = pl.Trainer(max_steps=-1, max_epochs=-1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    with pytest.raises(DraftsmithError, match="training has no end"):
        trainer.fit(_Budgeted())
