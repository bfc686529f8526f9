"""LightningModule for feature drafters: EAGLE-1/2, HASS, EAGLE-3 training-time test.

One mechanism covers HASS's harmonized context alignment and EAGLE-3's training-time
test (`train/alignment.py`): step j feeds the drafter's own step j-1 outputs at the same anchors
and attends to step-0 keys causally plus its own chain's keys. Loss at step j is weighted w_j.

Data alignment (T tokens x_0..x_{T-1}, target features f_t predict x_{t+1}): anchor t in
step j reads token x_{t+1+j} and predicts f_{t+1+j} and p_{t+1+j} = softmax(head(f_{t+1+j}));
it carries loss where x_{t+1+j} is an assistant token.

Notation: B batch, T anchors, H hidden, V vocab (Vd for EAGLE-3's draft vocab), N selected positions.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytorch_lightning as pl
import torch

from draftsmith import DraftsmithError
from draftsmith.data.modules import check_datamodule
from draftsmith.models.registry import EAGLE, DrafterKind
from draftsmith.train.alignment import (alignment_hiddens, bucketed_rows, cod_positions, drafted_what_follows,
                                       gather_rows, shift)
from draftsmith.train.drafting import (FeatureDrafting, log_validation_metrics, logged_training_loss,
                                       own_settings)
from draftsmith.train.losses import (acceptance_loss, feature_regression, head_distillation, loss_tokens, sharpen,
                                     step_weights, target_mix, uniform_noise)
from draftsmith.train.metrics import DraftAcceptance
from draftsmith.train.optim import clip_gradients, warmup_cosine_optimizers


class DrafterModule(pl.LightningModule):
    """Train an EAGLE-family feature drafter (eagle, eagle3, peagle) for `target` on offline feature shards or
    online target features. The settings every feature drafter takes (target, optimizer, distillation target,
    ...) are `train/drafting.FeatureDrafting`'s, passed through `**settings`; these are EAGLE's own.

    Args:
        target: the target model (as for `draftsmith extract --target`).
        kind: eagle (EAGLE-1/2 and HASS: one layer on [embed; feature], the target's head), eagle3 (fused
            target layers, own norm and a pruned-vocabulary head) or peagle (EAGLE-3 drafting in parallel).
        alignment_steps: n, the steps of context alignment / training-time test (1 = plain EAGLE).
        val_steps: the drafting steps validation unrolls and scores (τ̂, acc_j; default: alignment_steps);
            steps beyond alignment_steps are scored, not trained, so τ̂ stays comparable across n.
        step_weight_decay: w_j = decay^j for step j.
        detach_steps: step j reads the drafter's step j-1 features as constants (as the HASS reference
            code does): each step's loss trains the drafter at that step, not the features it fed.
        alignment_top_k: GRIFFIN's token-alignable training (0: off): a step j ≥ 1 puts loss only on the
            anchors where the token each earlier step's successor reads is among that step's top-k draft
            tokens (`alignment.drafted_what_follows`): 1, the contexts a greedy chain reaches; k, those a tree
            that expands k children a node reaches. Validation scores every anchor either way.
        feature_weight: weight of the smooth-L1 feature regression (eagle only).
        topk_weight: weight of HASS's Top-K distillation loss.
        topk: K of the Top-K loss.
        down_sample_ratio: COD sampling (`cod_positions`, P-EAGLE's; any EAGLE kind here): alignment step j ≥ 1
            trains a random ratio^j of the anchors, nested (1 = every anchor); validation scores every anchor.
        down_sample_ratio_min: the floor of that share.
        feature_noise: width of EAGLE's uniform feature noise at step 0 (0 = off).
        **settings: `FeatureDrafting`'s (aux_layer_ids, draft_vocab_size, ce_weight, target_temperature,
            acceptance_weight, optimizer, lr, ...).
    """

    def __init__(self, target: str, kind: str = EAGLE.name, alignment_steps: int = 1, val_steps: int | None = None,
                 step_weight_decay: float = 1.0, detach_steps: bool = False, alignment_top_k: int = 0,
                 feature_weight: float = 1.0, topk_weight: float = 0.0, topk: int = 10,
                 down_sample_ratio: float = 1.0, down_sample_ratio_min: float = 0.2, feature_noise: float = 0.0,
                 **settings: Any):
        own = own_settings(locals())
        super().__init__()
        self.drafting = FeatureDrafting(target, kind, **settings)
        entry = self.drafting.kind
        if entry.blocks:
            raise DraftsmithError(f"DrafterModule trains the EAGLE kinds; {entry.title} trains with {entry.trainer}")
        if alignment_steps < 1:
            raise DraftsmithError(f"alignment_steps must be >= 1, got {alignment_steps}")
        if val_steps is not None and val_steps < 1:
            raise DraftsmithError(f"val_steps must be >= 1, got {val_steps}")
        if not (0 < down_sample_ratio <= 1 and 0 < down_sample_ratio_min <= 1):
            raise DraftsmithError(f"down_sample_ratio and down_sample_ratio_min must be in (0, 1], got "
                                  f"{down_sample_ratio} and {down_sample_ratio_min}")
        if alignment_top_k < 0:
            raise DraftsmithError(f"alignment_top_k must be >= 0 (0: off), got {alignment_top_k}")
        if alignment_top_k and alignment_steps < 2:
            raise DraftsmithError(f"alignment_top_k masks the training-time-test steps after the first: it needs "
                                  f"alignment_steps >= 2, got {alignment_steps}")
        h = {**self.drafting.settings, **own}
        if not entry.regresses_features and feature_weight and topk_weight == 0 and h["ce_weight"] == 0 \
                and h["acceptance_weight"] == 0:
            raise DraftsmithError(f"{entry.title} has no feature regression: set ce_weight or topk_weight > 0")
        self.save_hyperparameters(h)
        self.drafter: torch.nn.Module | None = None
        self.val_metric = DraftAcceptance(val_steps or alignment_steps, h["metric_top_k"])

    @property
    def kind(self) -> DrafterKind:
        return self.drafting.kind

    @property
    def identity(self) -> dict[str, Any]:
        return self.drafting.identity

    @property
    def aux_layer_ids(self) -> list[int]:
        return self.drafting.aux_layer_ids

    # --- construction, checkpoints (FeatureDrafting's) and the optimizer --------------------------------
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

    # --- the alignment forward shared by training and validation ------------------------------------
    def alignment_forward(self, batch: dict[str, Any], with_metrics: bool) -> dict[str, torch.Tensor]:
        ids, valid = batch["input_ids"], batch["attention_mask"].bool()
        final, aux = self.drafting.features(batch)
        dtype = self.drafter.fc.weight.dtype  # bf16 shards meet fp32 weights; autocast decides matmuls
        final, aux = final.to(dtype), (aux.to(dtype) if aux is not None else None)
        t = ids.shape[1] - 1
        anchors = valid[:, :-1]  # (B, T)
        carries = self.drafting.carries(batch, self.training and self.hparams.train_on == "all")  # (B, T+1)
        row, table, top1, mass_in = self.drafting.target_table(self.drafter, self.target_head, final, carries,
                                                               with_metrics)  # table: (M, V or Vd)
        h = self.hparams
        weight = self.drafter.lm_head.weight  # (V or Vd, H)
        mass, mix = target_mix(sharpen(table, h.target_temperature), weight, h.ce_weight, h.topk_weight,
                               min(h.topk, table.shape[-1]))
        feature = self.drafter.project(final[:, :-1], aux[:, :-1] if aux is not None else None)
        regresses = self.kind.regresses_features
        if self.training and regresses:
            feature = uniform_noise(feature, h.feature_noise)
        weights = step_weights(h.alignment_steps, h.step_weight_decay)
        scored = self.val_metric.num_steps if with_metrics else 0  # validation scores these steps
        steps = max(h.alignment_steps, scored)
        kept = cod_positions(anchors, steps, h.down_sample_ratio, h.down_sample_ratio_min) \
            if self.training and h.get("down_sample_ratio", 1.0) < 1 else None
        hiddens = alignment_hiddens(self.drafter, ids, feature, anchors, steps, h.detach_steps, kept)
        total, parts, aligned = 0.0, {}, None
        for j, hidden in enumerate(hiddens):
            sel = anchors & shift(carries, j, t)  # (B, T)
            if h.get("alignment_top_k") and self.training and 0 < j < h.alignment_steps:
                drafted = drafted_what_follows(self.drafter, hiddens[j - 1], ids, valid, j - 1, h.alignment_top_k)
                aligned = drafted if aligned is None else aligned & drafted
                sel = sel & aligned
            if kept is not None and kept.mask[j] is not None:  # COD sampling: the anchors step j ran at
                sel = sel & kept.mask[j]
            at = bucketed_rows(sel)  # the N selected anchors, padded with the first; `every` marks the real ones
            if not at.n:
                continue
            every = at.real
            rows = gather_rows(shift(row, j, t), at)  # (N',) table rows of f_{t+1+j}
            picked = gather_rows(hidden, at)  # (N', H)
            x = self.drafter.head_input(picked)
            if j < h.alignment_steps:  # a trained step
                loss = 0.0
                if torch.is_tensor(mix):  # a soft cross-entropy or Top-K term (ce_weight, topk_weight)
                    parts[f"distill_{j}"] = loss = head_distillation(x, weight, mass[rows], mix[rows], every)
                if h.acceptance_weight:  # on the drafter's logits over its vocabulary, against the same table
                    logits = x.to(weight.dtype) @ weight.T
                    parts[f"acceptance_{j}"] = acceptance_loss(logits, table[rows], every, h.acceptance_loss,
                                                               h.acceptance_eta)
                    loss = loss + h.acceptance_weight * parts[f"acceptance_{j}"]
                if regresses and h.feature_weight:
                    parts[f"feature_{j}"] = feature_regression(picked, gather_rows(shift(final, j, t), at), every)
                    loss = loss + h.feature_weight * parts[f"feature_{j}"]
                total = total + weights[j] * loss
            if j < scored:
                n = at.n
                self.val_metric.update_from_head(j, x[:n], weight, table, rows[:n], top1[rows[:n]],
                                                 self.drafter.draft_to_target, table_mass=mass_in)
        if not torch.is_tensor(total):  # no position carried loss in this batch
            total = sum(p.sum() * 0.0 for p in self.drafter.parameters() if p.requires_grad)
        return {"loss": total, **parts}

    # --- Lightning hooks -------------------------------------------------------------------------------
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        return logged_training_loss(self, self.alignment_forward(batch, with_metrics=False), batch, batch_idx)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        out = self.alignment_forward(batch, with_metrics=True)
        self.log("val/loss", out["loss"], batch_size=loss_tokens(batch), sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        log_validation_metrics(self, self.val_metric)


# EAGLE's own settings (a block drafter takes none of them)
EAGLE_SETTINGS = tuple(n for n in inspect.signature(DrafterModule).parameters if n not in ("target", "kind", "settings"))
