"""EAGLE-3-style drafter (Li et al. 2025, arXiv:2503.01840): fused target layers, pruned vocab.

fc (no bias) maps the concatenation of k target layers (default ids [2, N//2, N-3]) to H.
The single decoder layer attends over concat(input_layernorm(embed(x_{t+1})),
hidden_norm(g_t)) (2H wide); the residual stream is g_t. The drafter has its own final
norm and a head over a draft vocabulary of Vd tokens: `d2t[i]` is the offset such that
target id = i + d2t[i], and `t2d` marks the target ids in the draft vocabulary. During
training-time test the drafter's own output replaces fc(fused) as g.

EAGLE-3.1's options against the drift of the features across drafting steps (the layouts vLLM and
`speculators` load): `fc_norm`, an RMSNorm on each fused layer before fc (`norm_before_fc`: one on
their concatenation instead), and `norm_output`, the drafter's output normed before it is fed back
as the next step's g (the head then reads it as it is).

Notation: B batch, T sequence, H hidden, Ht target hidden, k fused layers, V vocab, Vd draft vocab.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from draftsmith import DraftsmithError
from draftsmith.models.common import (build_from_target, cache_kwargs, drafter_config, frozen_embedding, init_linear_,
                                      layer_classes, pass_last_fused_layer_, start_from_target_layer_)

OPTIONS = ("fc_norm", "norm_before_fc", "norm_output")  # EAGLE-3.1's, all off by default


class Eagle3Layer(nn.Module):
    """A Llama decoder layer whose attention reads 2H features."""

    def __init__(self, config: Any, classes: Any):
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = classes.norm(h, eps=config.rms_norm_eps)
        self.hidden_norm = classes.norm(h, eps=config.rms_norm_eps)
        self.self_attn = classes.attention(config, layer_idx=0)
        attn = self.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(attn, name)
            setattr(attn, name, nn.Linear(2 * h, old.out_features, bias=old.bias is not None))
        self.post_attention_layernorm = classes.norm(h, eps=config.rms_norm_eps)
        self.mlp = classes.mlp(config)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, attention_mask: Any, position_ids: torch.Tensor,
                position_embeddings: Any, cache: Any = None) -> torch.Tensor:
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # (B, T, 2H)
        x, _ = self.self_attn(hidden_states=x, attention_mask=attention_mask, position_ids=position_ids,
                              **cache_kwargs(self.self_attn, cache), position_embeddings=position_embeddings)
        hidden = residual + x
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Drafter(nn.Module):
    OPTIONS = (*OPTIONS, "rope_theta")
    parallel = False  # drafts a token a forward (see PEagleDrafter)

    def __init__(self, target_config: Any, embed_weight: torch.Tensor, head_weight: torch.Tensor,
                 norm_weight: torch.Tensor | None, draft_ids: torch.Tensor, num_aux: int, target_hidden_size: int,
                 fc_norm: bool = False, norm_before_fc: bool = False, norm_output: bool = False,
                 rope_theta: float | None = None):
        super().__init__()
        if fc_norm and norm_before_fc:
            raise DraftsmithError("fc_norm (a norm per fused layer) and norm_before_fc (one on all of them) exclude "
                                  "each other: choose one")
        self.config = drafter_config(target_config, rope_theta)
        classes = layer_classes()
        h, v = self.config.hidden_size, embed_weight.shape[0]
        eps = self.config.rms_norm_eps
        self.options = {"fc_norm": fc_norm, "norm_before_fc": norm_before_fc, "norm_output": norm_output}
        if rope_theta:  # unset (None, or False from a module without the option): the target's base
            self.options["rope_theta"] = float(rope_theta)
        self.embed_tokens = frozen_embedding(embed_weight)  # (V, H), the target's
        self.fc_norm = nn.ModuleList([classes.norm(target_hidden_size, eps=eps) for _ in range(num_aux)]) \
            if fc_norm else None
        self.input_norm = classes.norm(num_aux * target_hidden_size, eps=eps) if norm_before_fc else None
        self.fc = nn.Linear(num_aux * target_hidden_size, h, bias=False)
        self.layer = Eagle3Layer(self.config, classes)
        self.rotary = classes.rotary(self.config)
        self.norm = classes.norm(h, eps=self.config.rms_norm_eps)
        self.lm_head = nn.Linear(h, len(draft_ids), bias=False)  # (Vd, H)
        init_linear_(nn.ModuleList([self.fc, self.layer]), self.config.initializer_range)
        with torch.no_grad():  # start from the target's own head rows and final norm
            self.lm_head.weight.copy_(head_weight[draft_ids])
            if norm_weight is not None:
                self.norm.weight.copy_(norm_weight)
        draft_ids = torch.as_tensor(draft_ids, dtype=torch.long)
        t2d = torch.zeros(v, dtype=torch.bool)
        t2d[draft_ids] = True
        self.register_buffer("d2t", draft_ids - torch.arange(len(draft_ids)))  # (Vd,) offsets
        self.register_buffer("t2d", t2d)  # (V,)
        self.num_aux, self.target_hidden_size = num_aux, target_hidden_size

    def start_from_target_layer(self, sources: list[nn.Module],
                                norm_scale: Callable[[nn.Module], torch.Tensor]) -> None:
        """Start the draft layer from a target decoder layer (`DrafterModule`'s `init_layer`; `sources` holds
        it alone) in place of a random one (`start_from_target_layer_`): its attention projections read the
        feature half of the 2H input, the token half keeps its small random start, and the first drafting
        step runs that target layer on the target's late features."""
        (source,) = sources
        start_from_target_layer_(self.layer, source, norm_scale, self.config.hidden_size,
                                 slice(self.config.hidden_size, None))
        pass_last_fused_layer_(self.fc, self.layer.hidden_norm, source, norm_scale, self.target_hidden_size)

    @classmethod
    def from_target(cls, target_config: Any, embed_weight: torch.Tensor, head_weight: torch.Tensor,
                    norm_weight: torch.Tensor | None, draft_ids: torch.Tensor | None, num_aux: int,
                    target_hidden_size: int, **options: Any) -> "Eagle3Drafter":
        """The constructor every feature drafter kind shares (`models/registry.py`); no draft_ids: the
        target's whole vocabulary; `options`: EAGLE-3.1's and the RoPE base (`OPTIONS`)."""
        return build_from_target(cls, "EAGLE-3", cls.OPTIONS, target_config, embed_weight, head_weight, norm_weight,
                                 draft_ids, num_aux, target_hidden_size, options)

    @property
    def draft_to_target(self) -> torch.Tensor:
        """(Vd,) target id of every draft id."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    @property
    def vocab_size(self) -> int:
        return self.lm_head.out_features

    def project(self, final: torch.Tensor | None, aux: torch.Tensor) -> torch.Tensor:
        """The step-0 feature from the fused target layers: (B, T, k*Ht) → (B, T, H)."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            aux = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, aux.chunk(len(self.fc_norm), -1))], -1)
        return self.fc(aux)

    def forward(self, input_ids: torch.Tensor, feature: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None, cache: Any = None) -> torch.Tensor:
        """(B, T) tokens x_{t+1}, (B, T, H) fused or fed-back features → (B, T, H) hidden."""
        embeds = self.embed_tokens(input_ids).to(feature.dtype)
        hidden = self.layer(embeds, feature, attention_mask, position_ids, self.rotary(feature, position_ids), cache)
        # normed for the next step in the dtype it came in: under autocast the norm's float32 weight would
        # promote it, and the next step's keys (their rotary in the feature's dtype) would not join this one's
        return self.norm(hidden).to(hidden.dtype) if self.options["norm_output"] else hidden

    def head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the head multiplies: the drafter's own final norm of its hidden state (with `norm_output`
        the hidden state is already normed)."""
        return hidden if self.options["norm_output"] else self.norm(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, H) → (B, T, Vd) over the draft vocabulary."""
        return self.lm_head(self.head_input(hidden))


class PEagleDrafter(Eagle3Drafter):
    """P-EAGLE (parallel EAGLE): an EAGLE-3 drafter that drafts K tokens in one forward. After the real
    anchors, K − 1 positions read the mask token and `mask_hidden`, a learned stand-in for the fused
    target layers (k·Ht) projected like them; each sees the real anchors before it and the mask
    positions before it, and drafts the token its depth predicts. Trained on the alignment steps with
    those inputs in place of the drafter's own tokens and outputs (`train/alignment.alignment_hiddens`)."""

    OPTIONS = (*Eagle3Drafter.OPTIONS, "mask_token_id")
    parallel = True  # its steps after the first read `mask_inputs` and run in one forward

    def __init__(self, *args: Any, mask_token_id: int = 0, **options: bool):
        super().__init__(*args, **options)
        if not 0 <= mask_token_id < self.embed_tokens.num_embeddings:
            raise DraftsmithError(f"mask_token_id {mask_token_id} is outside the target's vocabulary")
        self.mask_token_id = mask_token_id
        self.options["mask_token_id"] = mask_token_id
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, self.num_aux * self.target_hidden_size))

    def mask_inputs(self, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens (N, L), features (N, L, H)) of `length` mask positions."""
        device = self.mask_hidden.device
        tokens = torch.full((batch, length), self.mask_token_id, dtype=torch.long, device=device)
        return tokens, self.project(None, self.mask_hidden.to(self.fc.weight.dtype)).expand(batch, length, -1)


def draft_vocab(token_counts: torch.Tensor, size: int, always: list[int] = ()) -> torch.Tensor:
    """The `size` most frequent target ids (ties by id), always including `always`; sorted ids."""
    size = min(size, len(token_counts))
    counts = token_counts.clone().double()
    counts[list(always)] = float("inf")
    order = torch.argsort(-counts, stable=True)[:size]
    return torch.sort(order).values
