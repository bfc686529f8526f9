"""Context alignment / training-time test over whole sequences: the anchors every drafting step runs at.

Step 0 feeds target features at every anchor; step j feeds the drafter's own step j−1 outputs at the
same anchors (P-EAGLE: its mask inputs), tokens shifted by j, and attends to step-0 keys causally plus
its own chain's keys of steps 1..j (`models.common.alignment_mask`; run without the dense mask by
`train.attention`). Keys accumulate in one buffer, so step j costs one pass over T anchors, not j+1
copies of the sequence. COD sampling (P-EAGLE's) runs steps j ≥ 1 at a nested sample of the anchors
instead.

Notation: B batch, T anchors, H hidden, S_j the anchors step j keeps.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from draftsmith.models.common import KVBuffer, alignment_mask
from draftsmith.train.attention import AlignmentAttention, StepMask


ROW_MULTIPLE = 64  # rows a loss gathers are padded to a multiple of this (`bucketed_rows`)


class Rows(NamedTuple):
    """The True entries of a mask (B, T or any shape) as flat indices, padded: index (N',) into the flattened
    grid, real (N',) which of them are entries (the rest repeat the first), n the number of entries, dims
    the mask's number of dimensions."""

    index: torch.Tensor
    real: torch.Tensor
    n: int
    dims: int


def bucketed_rows(mask: torch.Tensor, multiple: int | None = None) -> Rows:
    """`mask`'s entries padded to a multiple of `multiple` rows, so that the products over them take one of
    a few shapes. On a CPU oneDNN builds a matmul kernel for every new shape it meets (about 15 ms for a
    (M, 4096) × (4096, 576) bf16 product, several times the product itself), and the number of rows that
    carry loss changes with every batch; padded rows are masked out of every loss."""
    multiple = ROW_MULTIPLE if multiple is None else multiple
    index = mask.reshape(-1).nonzero().squeeze(1)
    n = len(index)
    pad = -n % multiple if n else 0
    real = torch.ones(n + pad, dtype=torch.bool, device=mask.device)
    if pad:
        index = torch.cat([index, index.new_full((pad,), int(index[0]))])
        real[n:] = False
    return Rows(index, real, n, mask.dim())


def gather_rows(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    """x's entries at `rows` (x shaped as the mask, then any trailing dimensions) as (N', ...)."""
    return x.reshape(-1, *x.shape[rows.dims:])[rows.index]


def shift(x: torch.Tensor, j: int, length: int) -> torch.Tensor:
    """x[:, 1+j : 1+j+length] padded with zeros/False to `length` along dim 1."""
    y = x[:, 1 + j : 1 + j + length]
    pad = length - y.shape[1]
    return y if pad <= 0 else F.pad(y, (0, 0) * (y.dim() - 2) + (0, pad))


class Kept(NamedTuple):
    """The anchors each alignment step runs at under COD sampling: index[j] (B, S_j) into the T anchors and
    mask[j] (B, T) the same as a mask; None at step 0, which runs at every anchor."""

    index: list[torch.Tensor | None]
    mask: list[torch.Tensor | None]


def cod_positions(anchors: torch.Tensor, steps: int, ratio: float, floor: float,
                  generator: torch.Generator | None = None) -> Kept:
    """P-EAGLE's conditional drop-token (COD) sampling: the anchors each parallel step trains.

    Step 0 keeps every anchor; step j ≥ 1 keeps S_j = ⌈n · max(ratio^j, floor)⌉ of them (n: the most real
    anchors of a row). Each step keeps a prefix of the step before's (one random order a row, real anchors
    first), so a kept query at step j finds its own chain's keys of steps 1..j−1 — the condition
    (`models.common.alignment_mask` with `kept`). Rows with fewer real anchors fill with padding positions,
    which carry no loss."""
    b, t = anchors.shape
    noise = torch.rand(b, t, generator=generator, device="cpu").to(anchors.device)
    order = torch.where(anchors, noise, noise + 2.0).argsort(-1)  # (B, T): real anchors first
    real = max(int(anchors.sum(-1).max()), 1)
    index = [None] + [order[:, :min(t, math.ceil(real * max(ratio ** j, floor)))] for j in range(1, steps)]
    return Kept(index, [None] + [torch.zeros_like(anchors).scatter(1, i, True) for i in index[1:]])


def alignment_hiddens(drafter: torch.nn.Module, ids: torch.Tensor, feature: torch.Tensor, anchors: torch.Tensor,
                      steps: int, detach: bool = False, kept: Kept | None = None
                      ) -> list[torch.Tensor]:
    """The drafter's hidden output at every anchor for steps 0..steps-1, each (B, T, H).

    ids (B, T+1) tokens, feature (B, T, H) step-0 features at anchors 0..T-1, anchors (B, T)
    real positions. Step j reads tokens x_{t+1+j} at positions t+j and the step j-1 outputs;
    `detach`: read them as constants, so a later step's loss does not reach back through them.
    A P-EAGLE drafter's steps j ≥ 1 read its mask inputs instead (`mask_inputs`): the parallel positions
    it drafts from in one forward, which see what step j of a chain sees. `kept` (`cod_positions`) runs
    steps j ≥ 1 at the kept anchors alone; the others' rows of the output are zeros.
    """
    b, t = anchors.shape
    positions = torch.arange(t, device=ids.device)[None].expand(b, t)
    cache, hiddens = KVBuffer(), []
    parallel = drafter.parallel
    with AlignmentAttention(drafter):
        for j in range(steps):
            tokens, index = shift(ids, j, t), (kept.index[j] if kept is not None else None)
            if parallel and j > 0:
                tokens, feature = drafter.mask_inputs(b, t if index is None else index.shape[1])
            else:
                if detach and j > 0:
                    feature = feature.detach()
                if index is not None:  # a chain step at the kept anchors: its tokens and step j-1's outputs there
                    tokens = tokens.gather(1, index)
                    feature = feature.gather(1, index[..., None].expand(-1, -1, feature.shape[-1]))
            if index is None:  # every anchor: the attention takes the mask's structure, not its T × (j+1)·T
                at, mask = positions, StepMask(anchors, j)
            else:
                at, mask = index, alignment_mask(anchors, j, kept.index)
            out = drafter(tokens, feature, at + j, mask, cache)  # (B, T or S_j, H)
            if index is not None:  # the kept anchors' rows back in place
                out = out.new_zeros(b, t, out.shape[-1]).scatter(1, index[..., None].expand_as(out), out)
            hiddens.append(out)
            feature = out
    return hiddens


@torch.no_grad()
def drafted_what_follows(drafter: torch.nn.Module, hidden: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor,
                         j: int, k: int = 1) -> torch.Tensor:
    """(B, T) bool: at anchor t, x_{t+2+j}, the token step j + 1 reads there, is among step j's top-k draft
    tokens (`hidden` (B, T, H) its outputs; mapped to target ids): the context step j + 1 trains in is one a
    chain (k = 1) or a tree of k children a node reaches only if step j drafted that token (GRIFFIN's
    token-alignable training; ids and valid (B, T+1))."""
    t = ids.shape[1] - 1
    follows = shift(ids, j + 1, t)  # (B, T): x_{t+2+j}
    at = bucketed_rows(valid[:, :-1] & shift(valid, j + 1, t))
    drafted = torch.zeros(follows.shape, dtype=torch.bool, device=ids.device)
    if at.n:  # the product over the padded rows, so that it takes one of a few shapes; the real ones kept
        logits = drafter.logits(gather_rows(hidden, at))
        top = logits.topk(min(k, logits.shape[-1]), dim=-1).indices[:at.n]  # (n, k)
        rows = drafter.draft_to_target
        top = top if rows is None else rows[top]
        drafted.view(-1)[at.index[:at.n]] = (top == gather_rows(follows, at)[:at.n, None]).any(-1)
    return drafted
