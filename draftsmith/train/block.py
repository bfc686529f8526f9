"""LightningModule for block drafters (DFlash, DSpark): random anchors, one forward for all their blocks.

Per sequence, `anchors` positions a are drawn among those whose next token is an assistant token
(without replacement; fixed per batch in validation). Each anchor's block — x_a then mask tokens at
positions a .. a+B−1 — sees the context features of positions < a and its own block (`models/block.py`),
so all blocks of a batch run in one forward over shared context keys. Slot i predicts x_{a+i+s}
(s = 1 for DSpark, 0 for DFlash, whose slot 0 predicts nothing) against the target's distribution
there, weighted w_i = exp(−(i − first)/γ) (DFlash's position decay) and averaged by Σw.

DSpark adds the Markov bias (teacher-forced: the previous token is the data's) and trains its
confidence head with binary cross-entropy against each slot's acceptance rate α = Σ min(p, q) under
speculative sampling at T = 1, with p renormalised over a pruned draft vocabulary as distilled (the law
itself would take the target's whole head at every position, most of a step). α is the expectation of
the accept/reject outcome, a label of lower variance than a draw. Validation scores the head with
torchmetrics' AUROC and calibration error against outcomes drawn with a fixed generator at the rate
against the law itself, the labels a decode would see.

Notation: N sequences, L positions, A anchors, B block, H hidden, Vd draft vocabulary, M selected slots.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torchmetrics.classification import BinaryAUROC, BinaryCalibrationError

from draftsmith import DraftsmithError
from draftsmith.data.modules import check_datamodule
from draftsmith.models.registry import DFLASH, DrafterKind
from draftsmith.train.alignment import bucketed_rows, gather_rows
from draftsmith.train.drafting import (FeatureDrafting, log_validation_metrics, logged_training_loss,
                                       own_settings)
from draftsmith.train.losses import (acceptance_per_position, loss_tokens, sharpen, soft_cross_entropy_per_position,
                                     weighted_mean)
from draftsmith.train.metrics import DraftAcceptance
from draftsmith.train.optim import clip_gradients, warmup_cosine_optimizers


def draw_anchors(eligible: torch.Tensor, count: int, generator: torch.Generator | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `count` eligible positions per row of eligible (N, L), without replacement, sorted:
    (anchors (N, count) long, real (N, count) bool); rows with fewer fill with position 0, not real."""
    n, length = eligible.shape
    noise = torch.rand(n, length, generator=generator, device="cpu").to(eligible.device)
    score = torch.where(eligible, noise, torch.full_like(noise, 2.0))  # ineligible sort last
    order = score.argsort(-1)[:, :count]
    real = eligible.gather(1, order)
    anchors = torch.where(real, order, torch.zeros_like(order))
    anchors, perm = torch.sort(torch.where(real, anchors, torch.full_like(anchors, length)), -1)
    real = real.gather(1, perm)
    return torch.where(real, anchors, torch.zeros_like(anchors)), real


def block_layout(anchors: torch.Tensor, block: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (N, A·B) of every block slot (anchor + i) and which context positions each block sees,
    (N, A, L): those before its anchor."""
    positions = (anchors[..., None] + torch.arange(block, device=anchors.device)).flatten(1)
    visible = torch.arange(length, device=anchors.device)[None, None] < anchors[..., None]
    return positions, visible


class BlockDrafterModule(pl.LightningModule):
    """Train a DFlash or DSpark block drafter (`kind: dflash | dspark`) on the same feature shards as EAGLE-3.
    The settings every feature drafter takes (target, aux_layer_ids, draft_vocab_size, mask_token_id, ce_weight,
    target_temperature, acceptance_weight, optimizer, lr, ...) are `train/drafting.FeatureDrafting`'s, passed
    through `**settings`; these are the block drafters' own.

    Args:
        target: the target model (as for `draftsmith extract --target`).
        kind: dflash or dspark.
        block_size: B, the block's slots: the anchor and B − 1 mask tokens (DFlash drafts B − 1 tokens a
            round, DSpark B).
        draft_layers: the drafter's decoder layers.
        anchors: blocks trained per sequence and step.
        decay_gamma: γ of the per-slot loss weight exp(−(i − first)/γ).
        markov_rank: r of DSpark's sequential bias W2·W1[prev] (0: none; DSpark only).
        confidence_head: DSpark's per-slot acceptance head (needs markov_rank > 0).
        confidence_weight: weight of the confidence head's cross-entropy.
        **settings: `FeatureDrafting`'s.
    """

    def __init__(self, target: str, kind: str = DFLASH.name, block_size: int = 8, draft_layers: int = 1,
                 anchors: int = 64, decay_gamma: float = 4.0, markov_rank: int = 0, confidence_head: bool = False,
                 confidence_weight: float = 1.0, **settings: Any):
        own = own_settings(locals())
        super().__init__()
        self.drafting = FeatureDrafting(target, kind, **settings)
        if not self.kind.blocks:
            raise DraftsmithError(f"BlockDrafterModule trains block drafters (dflash, dspark), not {self.kind.title}")
        if anchors < 1 or decay_gamma <= 0:
            raise DraftsmithError(f"anchors must be >= 1 and decay_gamma > 0, got {anchors} and {decay_gamma}")
        self.save_hyperparameters({**self.drafting.settings, **own})
        self.drafter: torch.nn.Module | None = None
        first = 0 if self.kind.model_class.sample_from_anchor else 1
        self.val_metric = DraftAcceptance(block_size - first, self.hparams.metric_top_k)
        self.val_auroc, self.val_ece = BinaryAUROC(), BinaryCalibrationError(n_bins=10)

    @property
    def kind(self) -> DrafterKind:
        return self.drafting.kind

    @property
    def identity(self) -> dict[str, Any]:
        return self.drafting.identity

    @property
    def aux_layer_ids(self) -> list[int]:
        return self.drafting.aux_layer_ids

    # --- construction, checkpoints (FeatureDrafting's) and the optimizer, as DrafterModule's -------------
    def configure_model(self) -> None:
        if self.drafter is None:
            self.drafter, self.target_head = self.drafting.build(self.hparams, self._trainer)
            self.drafter.to(self.device)

    def setup(self, stage: str) -> None:
        self.configure_model()
        check_datamodule(self.trainer, self.identity, self.aux_layer_ids)

    def feature_layer_ids(self) -> list[int]:
        return self.drafting.feature_layer_ids(self.hparams, self.drafter is not None)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.drafting.save(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.configure_model()
        self.drafting.restore(checkpoint, self.state_dict())

    def configure_optimizers(self) -> dict[str, Any]:
        return warmup_cosine_optimizers(self, self.parameters(), lambda: self.drafting.muon_parameters(self.drafter))

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        return logged_training_loss(self, self.alignment_forward(batch, with_metrics=False), batch, batch_idx)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        out = self.alignment_forward(batch, with_metrics=True)
        self.log("val/loss", out["loss"], batch_size=loss_tokens(batch), sync_dist=True)

    def alignment_forward(self, batch: dict[str, Any], with_metrics: bool) -> dict[str, torch.Tensor]:
        h, drafter = self.hparams, self.drafter
        ids, valid = batch["input_ids"], batch["attention_mask"].bool()
        final, aux = self.drafting.features(batch)
        dtype = drafter.fc.weight.dtype
        final, aux = final.to(dtype), aux.to(dtype)
        n, length = ids.shape
        carries = self.drafting.carries(batch, self.training and h.train_on == "all")  # (N, L): carries loss
        predicts = F.pad(carries[:, 1:], (0, 1))  # (N, L): the target's law at i, over x_{i+1}, carries loss
        row, table, top1, mass_in = self.drafting.target_table(drafter, self.target_head, final, predicts,
                                                               with_metrics)
        eligible = valid & predicts  # the anchor's next token carries loss
        generator = None if self.training else torch.Generator().manual_seed(0)
        anchors, real = draw_anchors(eligible, h.anchors, generator)  # (N, A)
        b, first = drafter.block_size, drafter.first_slot
        positions, visible = block_layout(anchors, b, length)
        context = drafter.context(drafter.project(None, aux), torch.arange(length, device=ids.device)[None].expand(n, -1))
        tokens = drafter.block_tokens(ids.gather(1, anchors))  # (N, A, B)
        hidden = drafter(tokens.flatten(1), positions, context, visible).view(*tokens.shape, -1)  # (N, A, B, H)
        slots = torch.arange(b, device=ids.device)
        at = anchors[..., None] + slots + (1 - first)  # (N, A, B): the position of the token each slot drafts
        inside = at < length
        at = at.clamp_max(length - 1)
        # x_at's law is the target's at at − 1 (the context ends before the anchor, as when decoding)
        before = (at - 1).clamp_min(0).flatten(1)
        law = row.gather(1, before).view_as(at)  # (N, A, B) table rows, -1: no loss
        sel = real[..., None] & inside & (slots >= first) & (law >= 0)
        drafted = bucketed_rows(sel)  # the M drafted tokens, padded with the first at weight 0
        if not drafted.n:
            return {"loss": sum(p.sum() * 0.0 for p in drafter.parameters() if p.requires_grad)}
        rows = gather_rows(law, drafted)  # (M',)
        prev = gather_rows(ids.gather(1, before).view_as(at), drafted)  # the token before each drafted one
        picked, slot = gather_rows(hidden, drafted), gather_rows(slots.expand_as(at), drafted)
        weight = torch.exp(-(slot - first).float() / h.decay_gamma) * drafted.real
        logits = drafter.logits(picked).float()
        bias, embedding = drafter.markov(prev)
        if bias is not None:
            logits = logits + bias.float()
        p = table[rows]
        parts, total = {}, 0.0
        if h.ce_weight:
            parts["distill"] = weighted_mean(soft_cross_entropy_per_position(logits, sharpen(p, h.target_temperature)),
                                             weight)
            total = h.ce_weight * parts["distill"]
        alpha = accepted = None  # (M,) acceptance at T = 1: the confidence head's label; the metrics' rate
        if drafter.confidence_head is not None or with_metrics:
            with torch.no_grad():
                q = logits.softmax(-1)
                alpha = torch.minimum(p, q).sum(-1)  # against p renormalised over a pruned vocabulary, as distilled
                # against the law itself (its mass outside the vocabulary is never drafted): what a decode sees
                accepted = alpha if mass_in is None else torch.minimum(p * mass_in[rows, None], q).sum(-1)
        if h.acceptance_weight:
            parts["acceptance"] = weighted_mean(acceptance_per_position(logits, p, h.acceptance_loss,
                                                                        h.acceptance_eta), weight)
            total = total + h.acceptance_weight * parts["acceptance"]
        if drafter.confidence_head is not None:
            confidence = drafter.confidence(picked, embedding).float()
            parts["confidence"] = weighted_mean(
                F.binary_cross_entropy_with_logits(confidence, alpha, reduction="none"), weight)
            total = total + h.confidence_weight * parts["confidence"]
            if with_metrics:
                m = drafted.n
                draws = torch.rand(m, generator=torch.Generator().manual_seed(1)).to(accepted.device)
                outcome = (draws < accepted[:m]).long()
                self.val_auroc.update(confidence[:m].sigmoid(), outcome)
                self.val_ece.update(confidence[:m].sigmoid(), outcome)
        if with_metrics:
            m = drafted.n
            self._score_slots(slot[:m] - first, logits[:m], top1[rows[:m]], accepted[:m])
        return {"loss": total, **parts}

    @torch.no_grad()
    def _score_slots(self, slot: torch.Tensor, logits: torch.Tensor, target_top1: torch.Tensor,
                     alpha: torch.Tensor) -> None:
        top = logits.topk(min(self.hparams.metric_top_k, logits.shape[-1]), -1).indices
        to_target = self.drafter.draft_to_target
        top = top if to_target is None else to_target[top]
        for j in range(self.val_metric.num_steps):
            here = slot == j
            if here.any():
                self.val_metric.update(j, top[here], target_top1[here], alpha[here])

    def on_validation_epoch_end(self) -> None:
        log_validation_metrics(self, self.val_metric)
        if self.drafter.confidence_head is not None and self.val_auroc.update_count:
            self.log("val/confidence_auroc", self.val_auroc.compute(), sync_dist=False)
            self.log("val/confidence_ece", self.val_ece.compute(), sync_dist=False)
        self.val_auroc.reset()
        self.val_ece.reset()
