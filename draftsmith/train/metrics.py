"""Validation metrics for drafters (docs/metrics.md, "Simulated acceptance during training").

Per alignment step j: top-1 agreement acc_j of the drafter's argmax with the target's,
top-K agreement (the target's argmax among the drafter's top K), and the expected
acceptance of sampling at temperature 1, Σ_v min(p(v), q(v)). The simulated acceptance
length is τ̂ = 1 + Σ_k Π_{i≤k} acc_i (greedy chain, bonus token counted); with the
expected acceptances in place of acc_i it is the T = 1 estimate.
"""

from __future__ import annotations

import torch
from torchmetrics import Metric

from draftsmith.train.head_kernel import HEAD_CHUNK, blocks, cache_rows


class DraftAcceptance(Metric):
    full_state_update = False

    def __init__(self, num_steps: int, top_k: int = 5):
        super().__init__()
        self.num_steps, self.top_k = num_steps, top_k
        for name in ("top1", "topk", "expected", "count"):
            self.add_state(name, default=torch.zeros(num_steps, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, step: int, draft_topk: torch.Tensor, target_top1: torch.Tensor, overlap: torch.Tensor) -> None:
        """draft_topk (N, K) target ids, best first; target_top1 (N,); overlap (N,) Σ min(p, q)."""
        self.top1[step] += (draft_topk[:, 0] == target_top1).sum()
        self.topk[step] += (draft_topk == target_top1[:, None]).any(-1).sum()
        self.expected[step] += overlap.double().sum()
        self.count[step] += len(target_top1)

    @torch.no_grad()
    def update_from_head(self, step: int, x: torch.Tensor, weight: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
                         target_top1: torch.Tensor, to_target: torch.Tensor | None = None, chunk: int = HEAD_CHUNK,
                         bias: torch.Tensor | None = None, table_mass: torch.Tensor | None = None) -> None:
        """Score the drafter's head x Wᵀ (x (N, H), W (V', H)) against the target's p = table[rows] (N, V').

        A chunk of rows at a time, its element-wise work `cache_rows` rows at a time: whole (N, V) float
        logits cost more in page faults and copies than in arithmetic on a CPU (as in `head_logsumexp`).
        `to_target` maps a pruned draft vocabulary's ids to target ids; `bias` is the head's, if it has one;
        `table_mass` (one per table row) the share of the target's law a pruned vocabulary's renormalised table
        holds, so that the T = 1 overlap is against the law itself.
        """
        block = cache_rows(len(weight), weight.device)
        for a, b in blocks(len(rows), chunk):
            z = torch.nn.functional.linear(x[a:b], weight, bias)
            for c, d in blocks(b - a, block):  # element-wise work on rows that stay in cache
                logits = z[c:d].float()
                top = logits.topk(self.top_k, -1).indices
                q = logits.softmax(-1)
                p = table[rows[a + c:a + d]]
                if table_mass is not None:
                    p = p * table_mass[rows[a + c:a + d], None]
                overlap = torch.minimum(p, q, out=q).sum(-1)
                self.update(step, top if to_target is None else to_target[top], target_top1[a + c:a + d], overlap)

    @staticmethod
    def chain_length(rates: torch.Tensor) -> torch.Tensor:
        """1 + Σ_k Π_{i≤k} rate_i."""
        return 1 + torch.cumprod(rates, 0).sum()

    def compute(self) -> dict[str, torch.Tensor]:
        n = self.count.clamp_min(1)
        acc, topk, expected = self.top1 / n, self.topk / n, self.expected / n
        out = {"tau": self.chain_length(acc), "tau_t1": self.chain_length(expected)}
        for j in range(self.num_steps):
            out[f"acc_{j}"] = acc[j]
            out[f"top{self.top_k}_{j}"] = topk[j]
        return {k: v.float() for k, v in out.items()}
