"""EAGLE-1/2 and HASS feature drafter (Li et al. 2024, arXiv:2401.15077; HASS arXiv:2408.15766).

At anchor t the input is concat(embed(x_{t+1}), f_t), embeddings first, where f_t is the
target's post-norm last hidden state; fc (no bias) maps it to H, one decoder layer of the
Llama layout (input norm removed, as in EAGLE) predicts f_{t+1}, and the target's own
frozen head turns that into next-token logits. Embedding and head are frozen copies of
the target's. HASS is this drafter trained with the Top-K loss and context alignment.

Notation: B batch, T sequence, H hidden, V vocab.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from draftsmith import DraftsmithError
from draftsmith.models.common import (cache_kwargs, drafter_config, layer_classes, frozen_embedding, frozen_linear,
                                      init_linear_)


class EagleDrafter(nn.Module):
    parallel = False  # drafts a token a forward (see PEagleDrafter)

    def __init__(self, target_config: Any, embed_weight: torch.Tensor, head_weight: torch.Tensor):
        super().__init__()
        self.config = drafter_config(target_config)
        classes = layer_classes()
        h = self.config.hidden_size
        self.embed_tokens = frozen_embedding(embed_weight)  # (V, H), the target's
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layer = classes.layer(self.config, layer_idx=0)
        self.layer.input_layernorm = nn.Identity()  # EAGLE drops the first layer's input norm
        self.rotary = classes.rotary(self.config)
        self.lm_head = frozen_linear(head_weight)  # (V, H), the target's
        init_linear_(nn.ModuleList([self.fc, self.layer]), self.config.initializer_range)
        self.draft_to_target: torch.Tensor | None = None  # full vocabulary
        self.options: dict[str, bool] = {}

    @classmethod
    def from_target(cls, target_config: Any, embed_weight: torch.Tensor, head_weight: torch.Tensor,
                    norm_weight: torch.Tensor | None, draft_ids: torch.Tensor | None, num_aux: int,
                    target_hidden_size: int, **options: bool) -> "EagleDrafter":
        """The constructor every feature drafter kind shares (`models/registry.py`): the target's parts;
        an EAGLE drafter reads no draft vocabulary, fused layers or final norm, and has no options."""
        if any(options.values()):
            raise DraftsmithError(f"{sorted(k for k, v in options.items() if v)}: options of the eagle3 kind "
                                  "(EAGLE-3.1), not of an EAGLE-1/2 drafter")
        return cls(target_config, embed_weight, head_weight)

    @property
    def vocab_size(self) -> int:
        return self.lm_head.out_features

    def project(self, final: torch.Tensor, aux: torch.Tensor | None = None) -> torch.Tensor:
        """The step-0 feature from the target's: f_t itself, (B, T, H)."""
        return final

    def forward(self, input_ids: torch.Tensor, feature: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None, cache: Any = None) -> torch.Tensor:
        """(B, T) tokens x_{t+1}, (B, T, H) features f_t → (B, T, H) predicted f_{t+1}."""
        x = self.fc(torch.cat([self.embed_tokens(input_ids).to(feature.dtype), feature], dim=-1))  # (B, T, H)
        return self.layer(x, attention_mask=attention_mask, position_ids=position_ids,
                          position_embeddings=self.rotary(x, position_ids), **cache_kwargs(self.layer, cache))

    def head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the head multiplies: the predicted feature itself (it is already post-norm)."""
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, H) → (B, T, V) through the target's head."""
        return self.lm_head(self.head_input(hidden))
