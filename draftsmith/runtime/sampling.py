"""Logits → distributions. Both sides of speculative decoding go through this one function.

`distributions` returns the raw distribution softmax(logits) (deferral rules read it) and
the scaled one (temperature, then top-k, then top-p) that tokens are sampled from. The same
config applied to the drafter's and the target's logits keeps decoding lossless: the q in an
acceptance ratio is exactly the distribution its token was sampled from.

Notation: V vocab; leading dimensions are arbitrary (..., V).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from draftsmith import DraftsmithError


@dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 means greedy: the scaled distribution is one-hot on the argmax."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise DraftsmithError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise DraftsmithError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise DraftsmithError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def distributions(logits: torch.Tensor, cfg: SamplingConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw, scaled) probabilities, each (..., V), in float32."""
    logits = logits.float()
    raw = torch.softmax(logits, dim=-1)
    if cfg.greedy:
        # one-hot by a scatter: F.one_hot checks its indices on the host off a GPU (and a CUDA graph
        # records the whole greedy chain, tests/runtime/test_graphs.py runs it on the meta device)
        return raw, torch.zeros_like(raw).scatter_(-1, greedy_tokens(logits).unsqueeze(-1), 1.0)
    scaled = logits / cfg.temperature
    if cfg.top_k is not None and cfg.top_k < logits.shape[-1]:
        kth = scaled.topk(cfg.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if cfg.top_p is not None and cfg.top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
        keep_sorted = before < cfg.top_p  # the smallest prefix reaching top_p (the first token always)
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
    return raw, probs


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the last dim, (...,) long; taken in float32, which is exact for bf16/fp16
    logits and, on a CPU, faster than their own argmax."""
    return logits.float().argmax(-1)


def seeded(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded with `seed` on `device`: decoding draws its random numbers on the device its
    distributions live on (torch refuses a CPU generator for a GPU tensor's draws)."""
    return torch.Generator(device=device).manual_seed(seed)


_DRAW: Callable[[torch.Tensor, torch.Generator | None], torch.Tensor] | None = None  # see `drawing_with`


@contextmanager
def drawing_with(draw: Callable[[torch.Tensor, torch.Generator | None], torch.Tensor]) -> Iterator[None]:
    """Every `sample` of the runtime draws with `draw(probs, generator)` instead, while the context lasts:
    another sampler measured in the same decoding loop (benchmarks/sampling_cost.py)."""
    global _DRAW
    before, _DRAW = _DRAW, draw
    try:
        yield
    finally:
        _DRAW = before


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of (..., V) probabilities (normalized or not), (...,) long: the first index whose
    cumulative probability exceeds a uniform draw (inverse-CDF sampling, one random number per row, the
    sums in float64). Tokens of probability 0 are never drawn.

    `torch.multinomial(probs, 1)` draws the same law by an exponential race, one exponential per
    vocabulary entry, which on a CPU costs about ten times this draw for a 49k vocabulary, and every
    decoding round draws at least once; it also checks the probabilities on the host first, which on a
    GPU makes each draw wait for the device and cannot be recorded into a CUDA graph. Here the check
    (no nan, inf or negative entry, no row summing to 0) runs on a CPU only, where it costs no wait."""
    if _DRAW is not None:
        return _DRAW(probs, generator)
    cdf = probs.double().cumsum(-1)
    if probs.device.type == "cpu":
        total = cdf[..., -1]
        if not (bool((torch.isfinite(total) & (total > 0)).all()) and bool(probs.min() >= 0)):
            raise DraftsmithError("probabilities contain inf, nan or a negative value, or a row sums to 0")
    cdf = cdf / cdf[..., -1:]  # the last entry exactly 1, above any draw in [0, 1)
    u = torch.rand(probs.shape[:-1] + (1,), generator=generator, dtype=torch.float64, device=probs.device)
    return torch.searchsorted(cdf, u, right=True).squeeze(-1)
