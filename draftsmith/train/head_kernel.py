"""logsumexp over a large vocabulary head without keeping (N, V) float logits alive.

`head_logsumexp(x, W)` = logsumexp(x Wᵀ, -1), computed a chunk of rows at a time with a custom
backward that recomputes each chunk's logits; within a chunk the element-wise passes run on as
many rows as fit a cache-sized budget. The losses (`losses.py`) and the validation metric use it.

Notation: N rows, H hidden, V vocab.
"""

from __future__ import annotations

import weakref

import torch

HEAD_CHUNK = 256  # rows per matmul when a head's (rows, V) logits are computed piecewise
CHUNK_FLOATS = 4 << 20  # a small head's chunks grow to this many logits: fewer products and gradient casts
CACHE_BYTES = 3 << 20  # what the element-wise passes over float logits may keep in cache at a time
CACHE_FLOATS = CACHE_BYTES // 4  # float32 logits in that budget: cache_rows divides it by the vocabulary


def cache_rows(vocab: int, device: torch.device) -> int:
    """Rows of (rows, vocab) float logits that fit in CACHE_FLOATS, at least one; on an accelerator every row
    at once (there kernel launches, not the cache, are what many small blocks would cost)."""
    if device.type != "cpu":
        return 1 << 30
    return max(1, CACHE_FLOATS // vocab)


def chunk_rows(vocab: int) -> int:
    """Rows a chunk of logits holds: HEAD_CHUNK, or more for a head small enough that more fit CHUNK_FLOATS."""
    return max(HEAD_CHUNK, CHUNK_FLOATS // vocab)


class _Casts:
    """The weights' casts to the matmul dtype, kept while the weight is unchanged (its version counter): a
    step's forward and backward passes, and every training-time-test step, share one cast of the head. On a
    CPU only: there the cast of a head costs about what a chunk's product does; on an accelerator it is cheap."""

    def __init__(self, size: int = 4):
        self.size, self.entries = size, {}

    def __call__(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if weight.dtype == dtype or weight.device.type != "cpu":
            return weight.to(dtype)
        key = (id(weight), dtype)
        hit = self.entries.get(key)
        if hit is not None and hit[0]() is weight and hit[1] == weight._version:
            return hit[2]
        cast = weight.detach().to(dtype)
        if len(self.entries) >= self.size:
            self.entries.pop(next(iter(self.entries)))
        self.entries[key] = (weakref.ref(weight), weight._version, cast)
        return cast


cast_weight = _Casts()


def blocks(n: int, size: int):
    """(start, stop) of consecutive blocks of at most `size` out of n."""
    return ((i, min(i + size, n)) for i in range(0, n, size))


class _HeadLogSumExp(torch.autograd.Function):
    """logsumexp(x Wᵀ) over the vocabulary, row chunk by row chunk; the backward recomputes each
    chunk's logits instead of keeping (N, V) floats alive (on a CPU their page faults and copies
    cost more than the extra matmul). Within a chunk the float conversion, exp and reductions run
    `cache_rows` rows at a time, so their temporaries stay in cache; the arithmetic is the same
    (benchmarks/head_loss.py measures what it saves)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, chunk: int) -> torch.Tensor:
        xc, wc, acc = x.to(dtype), cast_weight(weight, dtype), torch.promote_types(dtype, torch.float32)
        out, rows = torch.empty(len(x), dtype=acc, device=x.device), cache_rows(len(weight), weight.device)
        for a, b in blocks(len(x), chunk):
            z = xc[a:b] @ wc.T
            for c, d in blocks(b - a, rows):
                out[a + c:a + d] = torch.logsumexp(z[c:d].to(acc), -1)
        ctx.save_for_backward(x, weight, out)
        ctx.dtype, ctx.chunk = dtype, chunk
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, lse = ctx.saved_tensors
        xc, wc = x.to(ctx.dtype), cast_weight(weight, ctx.dtype)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = torch.empty_like(x) if need_x else None
        grad_w = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) if need_w else None
        rows = cache_rows(len(weight), weight.device)
        for a, b in blocks(len(x), ctx.chunk):
            g = xc[a:b] @ wc.T  # logits (n, V), overwritten in place by the gradient on them
            for c, d in blocks(b - a, rows):
                # d lse / d z = softmax(z); scaled by the incoming gradient per row
                g[c:d] = torch.exp(g[c:d].to(lse.dtype) - lse[a + c:a + d, None]).mul_(grad[a + c:a + d, None])
            if need_x:
                grad_x[a:b] = (g @ wc).to(x.dtype)
            if need_w:
                grad_w += (g.T @ xc[a:b]).to(lse.dtype)
        return grad_x, grad_w.to(weight.dtype) if need_w else None, None, None


def matmul_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype x Wᵀ runs in: autocast's when it is on, else the promoted dtype of both."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else torch.promote_types(x.dtype, weight.dtype)


def head_logsumexp(x: torch.Tensor, weight: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """logsumexp(x Wᵀ, -1) (N,), at least float32; the matmuls run in the autocast dtype when autocast is on.
    `chunk`: rows per product, `chunk_rows` of the vocabulary by default."""
    dtype, chunk = matmul_dtype(x, weight), chunk or chunk_rows(len(weight))
    with torch.autocast(x.device.type, enabled=False):
        return _HeadLogSumExp.apply(x, weight, dtype, chunk)
