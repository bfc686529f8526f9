"""The learning-rate schedule every recipe uses, at hand-computed points; Muon beside AdamW."""

import math
import time

import pytest
import pytorch_lightning as pl
import torch

from draftsmith import DraftsmithError
from draftsmith.train.optim import MuonAdamW, adamw_warmup_cosine, newton_schulz, warmup_cosine_optimizers


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


class _Budgeted(pl.LightningModule):
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

    def configure_optimizers(self):
        return warmup_cosine_optimizers(self, self.parameters())


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


def polar(m: torch.Tensor) -> torch.Tensor:
    """U V^T of m's SVD: the orthogonal matrix nearest m."""
    u, _, vh = torch.linalg.svd(m, full_matrices=False)
    return u @ vh


@pytest.mark.parametrize("shape", [(48, 160), (160, 48), (64, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_newton_schulz_orthogonalizes_a_matrix_either_way_round(shape, dtype):
    torch.manual_seed(0)
    k = min(shape)
    u, v = torch.linalg.qr(torch.randn(shape[0], k))[0], torch.linalg.qr(torch.randn(shape[1], k))[0]
    g = u @ torch.diag(torch.logspace(0, -1, k)) @ v.T  # singular values over a decade
    x = newton_schulz(g, steps=5, dtype=dtype)
    assert x.shape == g.shape and x.dtype == dtype
    s = torch.linalg.svdvals(x.float())
    assert s.min() > 0.6 and s.max() < 1.25, s  # every direction near unit size, the small ones lifted
    cos = (x.float() * polar(g)).sum() / (x.float().norm() * polar(g).norm())
    assert cos > 0.95  # and it points where the exact polar factor does


@pytest.mark.parametrize("ns_steps", [5, 3])
def test_muon_adamw_steps_its_matrices_by_the_scaled_orthogonal_update_and_the_rest_as_adamw(ns_steps):
    torch.manual_seed(0)
    w, b = torch.nn.Parameter(torch.randn(12, 30)), torch.nn.Parameter(torch.randn(30))
    ref = torch.nn.Parameter(b.detach().clone())
    lr, wd = 0.01, 0.1
    opt = MuonAdamW([{"params": [w], "muon": True}, {"params": [b], "muon": False}], lr=lr, betas=(0.9, 0.95),
                    weight_decay=wd, ns_steps=ns_steps, dtype=torch.float32)
    adamw = torch.optim.AdamW([ref], lr=lr, betas=(0.9, 0.95), weight_decay=wd)
    w0, grads = w.detach().clone(), [torch.randn(12, 30) for _ in range(3)]
    for i, gw in enumerate(grads):
        gb = torch.randn(30)
        w.grad, b.grad, ref.grad = gw, gb, gb.clone()
        opt.step()
        adamw.step()
        torch.testing.assert_close(b.detach(), ref.detach(), rtol=1e-6, atol=1e-7)  # torch's AdamW, step by step
        if i == 0:  # from a zero momentum the update is the first gradient's direction, orthogonalized
            expect = w0 * (1 - lr * wd) - lr * 0.2 * math.sqrt(30) * newton_schulz(gw, ns_steps, torch.float32)
            torch.testing.assert_close(w.detach(), expect, rtol=1e-5, atol=1e-6)
    with pytest.raises(DraftsmithError, match="not 2-D"):
        MuonAdamW([{"params": [b], "muon": True}], lr=lr)


def test_muon_adamw_resumes_from_its_state_dict_as_if_never_stopped():
    def run(split: int | None) -> torch.Tensor:
        torch.manual_seed(0)
        layer = torch.nn.Linear(16, 24)
        make = lambda: MuonAdamW([{"params": [layer.weight], "muon": True},  # noqa: E731
                                  {"params": [layer.bias], "muon": False}], lr=0.02, dtype=torch.float32)
        opt = make()
        for step in range(6):
            if step == split:
                state = opt.state_dict()
                opt = make()
                opt.load_state_dict(state)
            opt.zero_grad()
            layer(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
        return torch.cat([layer.weight.detach().flatten(), layer.bias.detach()])

    torch.testing.assert_close(run(split=3), run(split=None), rtol=0, atol=0)


def test_muon_is_refused_where_fsdp_or_deepspeed_shard_the_matrices(tiny_target_dir):
    from types import SimpleNamespace

    from pytorch_lightning.strategies import DDPStrategy, FSDPStrategy

    from draftsmith.train.drafter import DrafterModule

    module = DrafterModule(str(tiny_target_dir), kind="eagle3", aux_layer_ids=[0, 1, 2], optimizer="muon",
                           muon_ns_steps=3)
    module.configure_model()
    names = {id(p): n for n, p in module.named_parameters()}
    muon = sorted(names[id(p)] for p in module.drafting.muon_parameters(module.drafter))
    assert "drafter.fc.weight" in muon and "drafter.layer.mlp.down_proj.weight" in muon
    assert not [n for n in muon if "head" in n or "norm" in n or "embed" in n]  # heads, norms, tables: AdamW
    module._trainer = SimpleNamespace(strategy=FSDPStrategy(), estimated_stepping_batches=10, precision="bf16-mixed")
    with pytest.raises(DraftsmithError, match="FSDP and DeepSpeed shard"):
        module.configure_optimizers()
    module._trainer = SimpleNamespace(strategy=DDPStrategy(), estimated_stepping_batches=10, precision="bf16-mixed")
    opt = module.configure_optimizers()["optimizer"]
    assert isinstance(opt, MuonAdamW) and opt.ns_dtype == torch.bfloat16
    assert opt.param_groups[0]["muon"] and opt.param_groups[0]["ns_steps"] == 3
    assert [len(g["params"]) for g in opt.param_groups] == [len(muon), sum(p.requires_grad for p in module.parameters()) - len(muon)]
    with pytest.raises(DraftsmithError, match="optimizer must be one of adamw, muon"):
        DrafterModule(str(tiny_target_dir), kind="eagle3", optimizer="sgd")
    with pytest.raises(DraftsmithError, match="muon_ns_steps must be >= 1"):
        DrafterModule(str(tiny_target_dir), kind="eagle3", optimizer="muon", muon_ns_steps=0)
