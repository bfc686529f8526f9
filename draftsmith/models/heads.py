"""Stop heads: small models that tell the runtime when a draft should stop growing.

- `AcceptanceHead` (SpecDec++, Huang et al. 2024): the probability that a drafted token is
  accepted, from the drafter's hidden state that drafted it (optionally with DISCO's features of
  the distribution it drew the token from appended). n residual blocks x + SiLU(Wx + b), each with
  its own weights, and a linear output. The policy stops once the predicted chance that some
  drafted token is rejected, 1 − Π a_i, exceeds its threshold h.
- `StopClassifier` (DISCO, Mamou et al. 2024): a 2-layer FFN on the drafter's distribution
  (its top-k probabilities, its entropy) and the token's position in the round; the policy keeps
  drafting while its confidence C_i stays at or above τ.

Both return logits (`probability` turns them into the predicted chance of acceptance); both read
only the draft, so decoding with them stays lossless. Notation: H drafter hidden, V vocab, k top-k.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from draftsmith import DraftsmithError



@dataclass
class AcceptanceHeadConfig:
    """hidden_size: the drafter's hidden size; num_layers: residual blocks before the output;
    rejection_weight: the w its loss weighed rejected tokens by (see StopHead); normalize: scale each
    hidden state to unit RMS first (a feature drafter's state is its residual stream before the final
    norm, with norms in the hundreds that vary by token; False for heads exported before it existed);
    draft_features: append DISCO's features (`disco_features`: this many of the drafter's largest
    probabilities, its entropy, the token's position in the round) to the hidden state; 0: the hidden
    state alone, as SpecDec++ reads it."""

    hidden_size: int
    num_layers: int = 3
    rejection_weight: float = 1.0
    normalize: bool = False
    draft_features: int = 0

    @property
    def probabilities(self) -> int:
        """How many of the drafter's largest probabilities the head reads (0: none)."""
        return self.draft_features


@dataclass
class StopClassifierConfig:
    """top_k: drafter probabilities read (largest first); width: the FFN's hidden width;
    rejection_weight: the w its loss weighed rejected tokens by (see StopHead)."""

    top_k: int = 10
    width: int = 64
    rejection_weight: float = 1.0

    @property
    def probabilities(self) -> int:
        """How many of the drafter's largest probabilities the head reads."""
        return self.top_k


class ResidualBlock(nn.Module):
    def __init__(self, size: int):
        super().__init__()
        self.linear = nn.Linear(size, size)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class StopHead(nn.Module):
    """What both heads share: `forward` returns the logit their loss trains, `probability` the
    predicted chance that the drafted token is accepted. Trained with rejection weight w (SpecDec++'s
    loss, train/heads.py), a head's sigmoid estimates a / (a + w·(1 − a)) rather than a: its logit
    sits log w below a's, and `calibrated` adds log w back (w = 1, an unweighted loss: no change)."""

    config: Any

    def calibrated(self, logits: torch.Tensor) -> torch.Tensor:
        """forward's logits → logits of the acceptance probability itself."""
        return logits + math.log(self.config.rejection_weight)

    def probability(self, *inputs: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.calibrated(self(*inputs)))

    def input_widths(self) -> tuple[int, ...]:
        """The last dimension of each input `forward` takes."""
        raise NotImplementedError

    def stored_inputs(self, rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """What `forward` reads, from label rows (`draftsmith labels`: hidden, top_probs, entropy, depth)."""
        raise NotImplementedError

    def stored_features(self, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """DISCO's features of label rows, over the `config.probabilities` largest probabilities."""
        return disco_features(rows["top_probs"], rows["entropy"], rows["depth"].float(), self.config.probabilities)


class AcceptanceHead(StopHead):
    """SpecDec++'s acceptance head: (..., H) drafter hidden [, (..., k + 2) DISCO features] → (...,)
    logit of P(accepted)."""

    kind = "specdec"

    def __init__(self, config: AcceptanceHeadConfig):
        super().__init__()
        self.config = config
        size = sum(self.input_widths())  # the hidden state, then DISCO's features when it reads them
        self.blocks = nn.Sequential(*[ResidualBlock(size) for _ in range(config.num_layers)])
        self.out = nn.Linear(size, 1)

    def forward(self, hidden: torch.Tensor, features: torch.Tensor | None = None) -> torch.Tensor:
        x = hidden.to(self.out.weight.dtype)
        if self.config.normalize:
            x = nn.functional.rms_norm(x, x.shape[-1:], eps=1e-6)
        if self.config.draft_features:
            if features is None:
                raise DraftsmithError("this acceptance head reads the drafter's distribution too (draft_features)")
            x = torch.cat([x, features.to(x.dtype)], -1)
        return self.out(self.blocks(x))[..., 0]

    def input_widths(self) -> tuple[int, ...]:
        k = self.config.draft_features
        return (self.config.hidden_size,) + ((k + 2,) if k else ())

    def stored_inputs(self, rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        hidden = rows["hidden"].float()
        return (hidden, self.stored_features(rows)) if self.config.draft_features else (hidden,)

    def acceptance(self, hidden: torch.Tensor, q_raw: torch.Tensor | None, position: int) -> float:
        """a_i for the token drawn from q_raw (V,) by the state `hidden` (H,) at position i of the round."""
        k = self.config.draft_features
        if not k:
            return float(self.probability(hidden))
        return float(self.probability(hidden, round_features(q_raw, position, k)))


def disco_features(top: torch.Tensor, entropy: torch.Tensor, position: torch.Tensor, top_k: int) -> torch.Tensor:
    """DISCO's input: (..., top_k) largest probabilities, (...,) entropy in nats, (...,) position in
    the round (1 = the round's first drafted token) → (..., top_k + 2)."""
    if top.shape[-1] < top_k:
        raise DraftsmithError(f"the stop classifier reads {top_k} probabilities; the labels hold {top.shape[-1]}")
    return torch.cat([top[..., :top_k].float(), entropy[..., None].float(), position[..., None].float()], -1)


def distribution_summary(q_raw: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(top_k largest probabilities (..., top_k), entropy in nats (...,)) of distributions (..., V)."""
    q = q_raw.float()
    entropy = -(q * torch.log(q.clamp_min(1e-30))).sum(-1)  # 0 · log 0 = 0
    return q.topk(min(top_k, q.shape[-1]), dim=-1).values, entropy


def round_features(q_raw: torch.Tensor, position: int, top_k: int) -> torch.Tensor:
    """DISCO's features (top_k + 2,) of a token drawn from q_raw (V,) at position i of the round."""
    return disco_features(*distribution_summary(q_raw, top_k), torch.tensor(float(position)), top_k)


class StopClassifier(StopHead):
    """DISCO's stop classifier: (..., top_k + 2) features → (...,) logit of P(the drafted token is right)."""

    kind = "disco"

    def __init__(self, config: StopClassifierConfig):
        super().__init__()
        self.config = config
        self.net = nn.Sequential(nn.Linear(config.top_k + 2, config.width), nn.ReLU(), nn.Linear(config.width, 1))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features.to(self.net[0].weight.dtype))[..., 0]

    def input_widths(self) -> tuple[int, ...]:
        return (self.config.top_k + 2,)

    def stored_inputs(self, rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return (self.stored_features(rows),)

    def confidence(self, q_raw: torch.Tensor, position: int) -> float:
        """C_i for the token drawn from q_raw (V,) at position i of the round."""
        return float(self.probability(round_features(q_raw, position, self.config.top_k)))


def head_config(head: nn.Module) -> dict[str, Any]:
    return asdict(head.config)
