"""Block drafters: DFlash (Chen et al. 2026, arXiv:2602.06036) and DSpark, which draft a whole block in
one forward.

A block is the last committed token (the anchor, at position a) followed by B − 1 mask tokens at
positions a+1 .. a+B−1. Every draft layer's attention reads two kinds of keys: the context, made
from the target's fused features of positions < a (fc over k target layers, then `hidden_norm`; the
same keys for every layer's k_proj/v_proj, so decoding caches them), and the block's own tokens,
seen in both directions. Queries come from the block alone. Layers are Qwen3-style (per-head q/k
norms), the layout of the `speculators` package's DFlash and DSpark models.

- DFlash (`sample_from_anchor` False): block slot i ≥ 1 predicts x_{a+i} (B − 1 drafted tokens).
- DSpark (`sample_from_anchor` True): slot i ≥ 0 predicts x_{a+i+1} (B drafted tokens), plus a
  low-rank sequential ("Markov") logit bias W2·W1[prev] from the token before each slot (the anchor
  for slot 0, the token drafted at slot i − 1 after it), applied as the block is sampled, and a
  confidence head: the predicted chance c_i that slot i's token is accepted, from [hidden; W1[prev]].

Notation: B block size, A anchors, T context positions, H hidden (= the target's), Ht target hidden,
k fused layers, V vocab, Vd draft vocab, r Markov rank, h / kv query / key-value heads, hd head dim.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from draftsmith import DraftsmithError
from draftsmith.models.common import (build_from_target, drafter_config, frozen_embedding, frozen_linear, init_linear_,
                                      layer_classes, pass_last_fused_layer_, start_from_target_layer_)

OPTIONS = ("block_size", "draft_layers", "mask_token_id", "markov_rank", "confidence_head")


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE: x (N, heads, S, hd) at the positions cos/sin (N, S, hd) were made for."""
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + turned * sin[:, None]


def block_attention(q: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor, k_ctx: torch.Tensor,
                    v_ctx: torch.Tensor, visible: torch.Tensor, scale: float, fused: bool | None = None) -> torch.Tensor:
    """Attention of A blocks of B queries over the context and their own block. q (N, h, A·B, hd);
    k_blk, v_blk (N, kv, A·B, hd); k_ctx, v_ctx (N, kv, T, hd); visible (N, A, T): which context positions
    each block sees. Returns (N, h, A·B, hd).

    Explicitly (the default on a CPU) it scores each block against the context and its own block only,
    keeping the N·h·A·B·T scores for the backward pass; `fused` (the default on a GPU) runs one
    scaled_dot_product_attention over [context | every block] under the anchor-block mask instead, whose
    memory-efficient kernels never hold the scores: training with hundreds of anchors a sequence fits."""
    if q.is_cuda if fused is None else fused:
        return _fused_block_attention(q, k_blk, v_blk, k_ctx, v_ctx, visible, scale)
    n, h, ab, hd = q.shape
    kv, a = k_blk.shape[1], visible.shape[1]
    b, g = ab // a, h // kv
    q = q.reshape(n, kv, g, a, b, hd).float() * scale
    ctx = torch.einsum("nkgabd,nktd->nkgabt", q, k_ctx.float())  # (N, kv, g, A, B, T)
    ctx = ctx.masked_fill(~visible[:, None, None, :, None, :], float("-inf"))
    own = torch.einsum("nkgabd,nkacd->nkgabc", q, k_blk.float().reshape(n, kv, a, b, hd))  # (N, kv, g, A, B, B)
    weights = torch.softmax(torch.cat([ctx, own], -1), dim=-1)
    t = k_ctx.shape[2]
    out = torch.einsum("nkgabt,nktd->nkgabd", weights[..., :t], v_ctx.float()) + \
        torch.einsum("nkgabc,nkacd->nkgabd", weights[..., t:], v_blk.float().reshape(n, kv, a, b, hd))
    return out.reshape(n, h, ab, hd).to(v_blk.dtype)


def _fused_block_attention(q: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor, k_ctx: torch.Tensor,
                           v_ctx: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    n, h, ab, _ = q.shape
    b, group = ab // visible.shape[1], h // k_blk.shape[1]
    keys = torch.cat([k_ctx, k_blk], 2).repeat_interleave(group, 1).to(q.dtype)
    values = torch.cat([v_ctx, v_blk], 2).repeat_interleave(group, 1).to(q.dtype)
    block = torch.arange(ab, device=q.device) // b
    own = (block[:, None] == block[None, :]).expand(n, ab, ab)
    mask = torch.cat([visible.repeat_interleave(b, 1), own], -1)[:, None]  # (N, 1, A·B, T + A·B)
    out = nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    return out.to(v_blk.dtype)


class BlockAttention(nn.Module):
    def __init__(self, config: Any, norm: type):
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.q_proj = nn.Linear(h, self.heads * hd, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.heads * hd, h, bias=False)
        self.q_norm = norm(hd, eps=config.rms_norm_eps)
        self.k_norm = norm(hd, eps=config.rms_norm_eps)

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        return x.reshape(*x.shape[:2], heads, self.head_dim).transpose(1, 2)  # (N, heads, S, hd)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values of x (N, S, H): (N, kv, S, hd) each."""
        k = rotate(self.k_norm(self._split(self.k_proj(x), self.kv_heads)), cos, sin)
        return k, self._split(self.v_proj(x), self.kv_heads)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], context: tuple[torch.Tensor, ...],
                visible: torch.Tensor) -> torch.Tensor:
        cos, sin = rope
        q = rotate(self.q_norm(self._split(self.q_proj(x), self.heads)), cos, sin)
        k, v = self.keys(x, cos, sin)
        out = block_attention(q, k, v, *context, visible, self.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))


class BlockLayer(nn.Module):
    def __init__(self, config: Any, classes: Any):
        super().__init__()
        self.input_layernorm = classes.norm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = BlockAttention(config, classes.norm)
        self.post_attention_layernorm = classes.norm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = classes.mlp(config)

    def forward(self, x: torch.Tensor, rope: Any, context: tuple[torch.Tensor, ...], visible: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, context, visible)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    """DSpark's first-order sequential bias over the draft vocabulary: W2·W1[prev], rank r."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)  # (V, r): the previous token (target id)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)  # (Vd, r)
        nn.init.normal_(self.markov_w1.weight, std=0.01)
        nn.init.zeros_(self.markov_w2.weight)  # training starts from DFlash's logits

    def forward(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """prev (...) target ids → (bias (..., Vd), W1[prev] (..., r))."""
        emb = self.markov_w1(prev)
        return self.markov_w2(emb), emb


class ConfidenceHead(nn.Module):
    """DSpark's per-slot acceptance predictor: a logit from [hidden; W1[prev]]."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


class BlockDrafter(nn.Module):
    sample_from_anchor = False  # DFlash: the anchor's slot predicts nothing

    def __init__(self, target_config: Any, embed_weight: torch.Tensor, head_weight: torch.Tensor,
                 norm_weight: torch.Tensor | None, draft_ids: torch.Tensor, num_aux: int, target_hidden_size: int,
                 block_size: int = 8, draft_layers: int = 1, mask_token_id: int = 0, markov_rank: int = 0,
                 confidence_head: bool = False):
        super().__init__()
        if block_size < 2:
            raise DraftsmithError(f"block_size must be >= 2, got {block_size}")
        if draft_layers < 1:
            raise DraftsmithError(f"draft_layers must be >= 1, got {draft_layers}")
        if not 0 <= mask_token_id < embed_weight.shape[0]:
            raise DraftsmithError(f"mask_token_id {mask_token_id} is outside the target's vocabulary")
        self.config = drafter_config(target_config)
        self.config.num_hidden_layers = draft_layers
        if target_hidden_size != self.config.hidden_size:
            raise DraftsmithError("a block drafter's hidden size is the target's")
        classes = layer_classes()
        h, v, eps = self.config.hidden_size, embed_weight.shape[0], self.config.rms_norm_eps
        self.options = {"block_size": block_size, "draft_layers": draft_layers, "mask_token_id": mask_token_id,
                        "markov_rank": markov_rank, "confidence_head": confidence_head}
        self.block_size, self.mask_token_id = block_size, mask_token_id
        self.embed_tokens = frozen_embedding(embed_weight)  # (V, H), the target's
        self.fc = nn.Linear(num_aux * target_hidden_size, h, bias=False)
        self.hidden_norm = classes.norm(h, eps=eps)
        self.layers = nn.ModuleList([BlockLayer(self.config, classes) for _ in range(draft_layers)])
        self.norm = classes.norm(h, eps=eps)
        self.rotary = classes.rotary(self.config)
        init_linear_(nn.ModuleList([self.fc, self.layers]), self.config.initializer_range)
        draft_ids = torch.as_tensor(draft_ids, dtype=torch.long)
        if len(draft_ids) < v:  # a pruned head, trained from the target's rows
            self.lm_head = nn.Linear(h, len(draft_ids), bias=False)
            with torch.no_grad():
                self.lm_head.weight.copy_(head_weight[draft_ids])
            t2d = torch.zeros(v, dtype=torch.bool)
            t2d[draft_ids] = True
            self.register_buffer("d2t", draft_ids - torch.arange(len(draft_ids)))  # (Vd,) offsets
            self.register_buffer("t2d", t2d)  # (V,)
            self.draft_to_target = draft_ids
        else:  # the full vocabulary: the target's own head, frozen (as the engines rebuild it)
            self.lm_head = frozen_linear(head_weight)
            self.draft_to_target = None
        if norm_weight is not None:
            with torch.no_grad():
                self.norm.weight.copy_(norm_weight)
        if markov_rank and not self.sample_from_anchor:
            raise DraftsmithError("markov_rank is DSpark's sequential bias: train kind dspark")
        if confidence_head and not markov_rank:
            raise DraftsmithError("DSpark's confidence head reads the Markov embedding: set markov_rank > 0")
        self.markov_head = MarkovHead(v, self.lm_head.out_features, markov_rank) if markov_rank else None
        self.confidence_head = ConfidenceHead(h + markov_rank) if confidence_head else None
        self.num_aux, self.target_hidden_size = num_aux, target_hidden_size

    def start_from_target_layer(self, sources: list[nn.Module], norm_scale: Any) -> None:
        """Start the draft layers from as many consecutive target decoder layers (`DrafterModule`'s
        `init_layer`, the last of them; `start_from_target_layer_`): the first one's context keys and values
        are then that target layer's own projections of the last fused layer, which fc passes through (set
        once, with `hidden_norm`, from the first), and the block's queries read them as the target layer's
        would; each later layer copies the target layer after the one before it."""
        for layer, source in zip(self.layers, sources, strict=True):
            start_from_target_layer_(layer, source, norm_scale, self.config.hidden_size)
        pass_last_fused_layer_(self.fc, self.hidden_norm, sources[0], norm_scale, self.target_hidden_size)

    @classmethod
    def from_target(cls, target_config: Any, embed_weight: torch.Tensor, head_weight: torch.Tensor,
                    norm_weight: torch.Tensor | None, draft_ids: torch.Tensor | None, num_aux: int,
                    target_hidden_size: int, **options: Any) -> "BlockDrafter":
        """The constructor every feature drafter kind shares (`models/registry.py`); `options`: `OPTIONS`."""
        return build_from_target(cls, "block drafter", OPTIONS, target_config, embed_weight, head_weight, norm_weight,
                                 draft_ids, num_aux, target_hidden_size, options)

    @property
    def vocab_size(self) -> int:
        return self.lm_head.out_features

    @property
    def first_slot(self) -> int:
        """The first block slot that drafts a token: 0 for DSpark, 1 for DFlash (slot 0 is the anchor)."""
        return 0 if self.sample_from_anchor else 1

    @property
    def drafts_per_block(self) -> int:
        return self.block_size - self.first_slot

    def rope(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(like, positions)

    def project(self, final: torch.Tensor | None, aux: torch.Tensor) -> torch.Tensor:
        """The context features from the fused target layers: (N, T, k·Ht) → (N, T, H)."""
        return self.hidden_norm(self.fc(aux))

    def context(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's context keys and values of `project`'s features (N, T, H) at positions (N, T)."""
        cos, sin = self.rope(features, positions)
        return [layer.self_attn.keys(features, cos, sin) for layer in self.layers]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, context: list[tuple[torch.Tensor, ...]],
                visible: torch.Tensor) -> torch.Tensor:
        """Blocks tokens (N, A·B) at positions (N, A·B) over `context` (per layer keys/values (N, kv, T, hd)),
        visible (N, A, T) → hidden (N, A·B, H), normed."""
        x = self.embed_tokens(tokens).to(self.fc.weight.dtype)
        rope = self.rope(x, positions)
        for layer, ctx in zip(self.layers, context):
            x = layer(x, rope, ctx, visible)
        return self.norm(x)

    def block_tokens(self, anchors: torch.Tensor) -> torch.Tensor:
        """(..., ) anchor tokens → (..., B) blocks: the anchor then mask tokens."""
        out = torch.full((*anchors.shape, self.block_size), self.mask_token_id, dtype=torch.long, device=anchors.device)
        out[..., 0] = anchors
        return out

    def head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) normed hidden → (..., Vd) logits, before any Markov bias."""
        return self.lm_head(hidden)

    def markov(self, prev: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(bias (..., Vd), W1[prev] (..., r)) for previous tokens (...); (None, None) without a Markov head."""
        return self.markov_head(prev) if self.markov_head is not None else (None, None)

    def confidence(self, hidden: torch.Tensor, prev_embedding: torch.Tensor) -> torch.Tensor:
        """Confidence logits (...) of the slots with hidden (..., H) and W1[prev] (..., r)."""
        return self.confidence_head(torch.cat([hidden, prev_embedding.to(hidden.dtype)], -1))


class DSparkDrafter(BlockDrafter):
    sample_from_anchor = True  # slot 0 drafts the token after the anchor


@torch.no_grad()
def probe(drafter: BlockDrafter, context: int = 12, seed: int = 0) -> torch.Tensor:
    """One block drafted after `context` random fused features (a fixed generator): every drafting slot's
    logits with the Markov bias from the anchor, and the confidence logits beside them, (D, Vd [+1]).
    What an export's reload is compared by."""
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(1, context, drafter.fc.in_features, generator=g)
    anchor = torch.randint(0, drafter.embed_tokens.num_embeddings, (1,), generator=g)
    ctx = drafter.context(drafter.project(None, feats), torch.arange(context)[None])
    tokens = drafter.block_tokens(anchor)[None]
    hidden = drafter(tokens.flatten(1), context + torch.arange(drafter.block_size)[None], ctx,
                     torch.ones(1, 1, context, dtype=torch.bool))[0, drafter.first_slot:]
    logits = drafter.logits(hidden)
    bias, embedding = drafter.markov(anchor.expand(len(hidden)))
    if bias is None:
        return logits
    out = [logits + bias]
    if drafter.confidence_head is not None:
        out.append(drafter.confidence(hidden, embedding)[:, None])
    return torch.cat(out, -1)
