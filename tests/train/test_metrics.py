"""Validation metrics against hand-computed values (docs/metrics.md, "Simulated acceptance during training")."""

import pytest
import torch

from draftsmith.train import head_kernel as losses
from draftsmith.train.metrics import DraftAcceptance

# Step 0: three positions; the drafter's head gives q (logits log q), the target p.
Q0 = [[0.7, 0.1, 0.1, 0.1], [0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.1, 0.4]]
P0 = [[0.5, 0.3, 0.1, 0.1], [0.1, 0.2, 0.6, 0.1], [0.0, 0.0, 1.0, 0.0]]
# top-1 agrees on the first only (1/3); the target's argmax is in the drafter's top 2 for the first two (2/3);
# Σ min(p, q) = 0.8, 0.6, 0.1 (mean 0.5). Step 1: one position where q = p (all three are 1).
Q1 = P1 = [[0.1, 0.2, 0.3, 0.4]]


@pytest.mark.parametrize("chunk,cache_floats", [(1, None), (2, None), (256, None), (3, 8)])  # 8 floats: 2 rows of 4
@pytest.mark.parametrize("pruned", [False, True])
def test_acceptance_from_the_drafter_head_matches_hand_values(chunk, cache_floats, pruned, monkeypatch):
    if cache_floats is not None:
        monkeypatch.setattr(losses, "CACHE_FLOATS", cache_floats)
    table = torch.tensor([P0[2], P0[0], P0[1], P1[0]])  # rows in another order than the positions
    weight = torch.eye(4)  # logits = x
    to_target = torch.tensor([10, 11, 12, 13]) if pruned else None
    offset = 10 if pruned else 0
    metric = DraftAcceptance(num_steps=2, top_k=2)
    metric.update_from_head(0, torch.tensor(Q0).log(), weight, table, torch.tensor([1, 2, 0]),
                            torch.tensor([0, 2, 2]) + offset, to_target, chunk=chunk)
    metric.update_from_head(1, torch.tensor(Q1).log(), weight, table, torch.tensor([3]),
                            torch.tensor([3]) + offset, to_target, chunk=chunk)
    out = {k: float(v) for k, v in metric.compute().items()}
    assert out["acc_0"] == pytest.approx(1 / 3) and out["top2_0"] == pytest.approx(2 / 3)
    assert out["acc_1"] == out["top2_1"] == 1.0
    assert out["tau"] == pytest.approx(1 + 1 / 3 + 1 / 3 * 1)
    assert out["tau_t1"] == pytest.approx(1 + 0.5 + 0.5 * 1.0, abs=1e-6)
