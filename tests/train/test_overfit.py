"""Each training module can overfit one batch: in a few dozen steps its loss falls and the drafter
comes to agree with the target on that batch (top-1 at step 0, the validation metric).

The distillation losses are cross-entropies against the target's distribution, so they fall towards
its entropy, not towards zero; agreement is the stated target. A module whose loss did not reach its
parameters (a detached tensor, a frozen drafter, a loss on the wrong positions) would do neither."""

import pytest
import torch

from draftsmith.data.modules import FeatureDataModule
from draftsmith.train.distill import DistillModule
from draftsmith.train.drafter import DrafterModule
from draftsmith.train.optim import MuonAdamW

STEPS = 60


def agreement(module, batch, step, key: str = "acc_0"):
    """Top-1 agreement with the target at step 0 on `batch` (the validation metric), or another of the
    metric's figures (`tau_t1`: the chain length its T = 1 acceptance rates give)."""
    module.val_metric.reset()
    with torch.no_grad():
        step(batch)
    return float(module.val_metric.compute()[key])


@pytest.fixture(autouse=True)
def seeded():
    """Every test starts from the same generator state (the drafter's initial weights, the block drafters'
    random anchors), whichever tests ran before it in the process."""
    torch.manual_seed(0)


def overfit(module, batch, lr, step, steps: int = STEPS):
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    if module.hparams.get("optimizer") == "muon":  # the drafter's matrices by Muon, the rest by AdamW
        mats = {id(p) for p in module.drafting.muon_parameters(module.drafter)}
        opt = MuonAdamW([{"params": [p for p in params if id(p) in mats], "muon": True},
                         {"params": [p for p in params if id(p) not in mats], "muon": False}], lr=lr,
                        dtype=torch.float32)
    before = agreement(module, batch, step)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = module.training_step(batch, 0)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, before, agreement(module, batch, step)


@pytest.fixture
def batch_and_data(tiny_features):
    dm = FeatureDataModule(str(tiny_features / "features"), layer_ids=[0, 1, 2], max_tokens=300, val_fraction=0.2)
    dm.setup("fit")
    return next(iter(dm.train_dataloader())), dm


@pytest.mark.parametrize("kind,lr,losses", [("eagle", 1e-2, {}), ("eagle3", 3e-3, {}),
                                            ("eagle3", 1e-2, {"optimizer": "muon"}),
                                            ("eagle3", 1e-2, {"down_sample_ratio": 0.5}),
                                            ("eagle3", 3e-3, {"ce_weight": 0.0, "topk_weight": 0.0,
                                                              "acceptance_weight": 1.0}),
                                            ("eagle3", 3e-3, {"ce_weight": 0.0, "topk_weight": 0.0,
                                                              "acceptance_weight": 1.0, "acceptance_loss": "log"})])
def test_feature_drafter_overfits_one_batch(tiny_features, batch_and_data, kind, lr, losses):
    """With HASS's Top-K loss; by Muon; with step 1 at a COD sample of the anchors; and with an
    acceptance-direct loss alone (hybrid, log), no cross-entropy."""
    batch, dm = batch_and_data
    extra = {"aux_layer_ids": [0, 1, 2], "draft_vocab_size": 40} if kind == "eagle3" else {}
    module = DrafterModule(str(tiny_features / "target"), kind=kind, alignment_steps=2,
                           count_tokens=dm.token_counts, **extra, **{"topk_weight": 1.0, **losses})
    module.configure_model()
    module.log = lambda *a, **k: None  # no Trainer here
    losses, before, after = overfit(module, batch, lr, lambda b: module.alignment_forward(b, with_metrics=True))
    assert losses[-1] < 0.9 * losses[0] and after >= 0.8 and after >= before + 0.5, (losses[::10], before, after)


def test_standalone_draft_lm_overfits_one_batch(tiny_features, batch_and_data):
    batch, dm = batch_and_data
    # a random student of a smaller shape (a copy of the target's layers would start where it should end)
    module = DistillModule(str(tiny_features / "target"), num_layers=1, shape={"hidden_size": 16, "intermediate_size": 32},
                           count_tokens=dm.token_counts)
    module.configure_model()
    module.log = lambda *a, **k: None
    losses, before, after = overfit(module, batch, 3e-3, lambda b: module._step(b, with_metrics=True))
    # the tiny target's argmax is nearly constant, so agreement starts high: the KL must fall tenfold
    assert losses[-1] < losses[0] / 10 and after >= 0.95, (losses[::10], before, after)


@pytest.mark.parametrize("kind,losses", [("dflash", {}),
                                         ("dspark", {"markov_rank": 8, "confidence_head": True, "confidence_weight": 0.1}),
                                         ("dflash", {"ce_weight": 0.0, "acceptance_weight": 1.0, "acceptance_loss": "tv"})])
def test_block_drafter_overfits_one_batch(tiny_features, batch_and_data, kind, losses):
    """DFlash and DSpark (its Markov bias and confidence head trained with it), and DFlash on the
    acceptance-direct loss alone: fresh random anchors every step; agreement at the first drafting slot
    and the chain length the slots' T = 1 acceptance rates give (τ at T = 1: DSpark's first slot agrees from
    the start, its head being the target's rows, so agreement alone cannot show it learned).
    A block drafter reads the target only through its fused features and starts further away than an
    EAGLE drafter, so it gets 300 steps; the tiny target's near-flat laws make the cross-entropy move
    little (its floor is their entropy) and its argmax fragile, so the confidence head's cross-entropy,
    which shares the drafter's hidden states, is weighted 0.1 here. The TV loss (1 − α) must fall tenfold.
    The head covers the whole vocabulary: a pruned one holds a share of the tiny target's near-flat laws
    about its own size, and the T = 1 acceptance, against the law itself, can never pass that share."""
    from draftsmith.train.block import BlockDrafterModule

    batch, dm = batch_and_data
    module = BlockDrafterModule(target=str(tiny_features / "target"), kind=kind, aux_layer_ids=[0, 1, 2],
                                draft_vocab_size=None, block_size=4, anchors=16, count_tokens=dm.token_counts,
                                **{"ce_weight": 1.0, **losses})
    module.configure_model()
    module.log = lambda *a, **k: None
    step = lambda b: module.alignment_forward(b, with_metrics=True)  # noqa: E731
    tau_before = agreement(module, batch, step, "tau_t1")
    curve, before, after = overfit(module, batch, 3e-3, step, 300)
    tau_after = agreement(module, batch, step, "tau_t1")
    assert curve[-1] < curve[0] and after >= 0.8 and tau_after >= tau_before + 0.3, \
        (curve[::50], before, after, tau_before, tau_after)
    if losses.get("acceptance_weight"):
        assert curve[-1] < curve[0] / 10, curve[::50]


def test_a_block_drafter_distils_the_sharpened_law(tiny_features, batch_and_data, monkeypatch):
    """target_temperature reaches a block drafter's soft cross-entropy (and only it: the metrics read p)."""
    from draftsmith.train import block
    from draftsmith.train.losses import sharpen

    batch, dm = batch_and_data
    seen, out = [], {}
    monkeypatch.setattr(block, "sharpen", lambda p, t: seen.append(t) or sharpen(p, t))
    for temperature in (1.0, 0.5):
        torch.manual_seed(0)
        module = block.BlockDrafterModule(target=str(tiny_features / "target"), kind="dflash", aux_layer_ids=[0, 1, 2],
                                          draft_vocab_size=40, block_size=4, anchors=16, count_tokens=dm.token_counts,
                                          ce_weight=1.0, target_temperature=temperature)
        module.configure_model()
        module.eval()
        with torch.no_grad():
            out[temperature] = module.alignment_forward(batch, with_metrics=True)["distill"]
        out[f"tau_t1_{temperature}"] = module.val_metric.compute()["tau_t1"]
    assert seen == [1.0, 0.5] and not torch.isclose(out[0.5], out[1.0])
    torch.testing.assert_close(out["tau_t1_0.5"], out["tau_t1_1.0"])
