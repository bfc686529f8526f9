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

from typing import Any, Callable

import pytorch_lightning as pl
import torch

from draftsmith import DraftsmithError
from draftsmith.data.modules import check_datamodule
from draftsmith.models.common import frozen_linear, logit_softcap, soft_cap
from draftsmith.models.registry import EAGLE, DrafterKind, drafter_kind
from draftsmith.train import frozen
from draftsmith.train.alignment import (alignment_hiddens, bucketed_rows, cod_positions, drafted_what_follows,
                                       gather_rows, shift)
from draftsmith.train.frozen import load_frozen_target
from draftsmith.train.head_kernel import HEAD_CHUNK, blocks
from draftsmith.train.losses import (ACCEPTANCE_LOSSES, acceptance_loss, feature_regression, head_distillation,
                                     loss_tokens, sharpen, step_weights, target_mix, uniform_noise)
from draftsmith.train.metrics import DraftAcceptance
from draftsmith.train.optim import NS_STEPS, OPTIMIZERS, clip_gradients, warmup_cosine_optimizers

FROZEN_PREFIXES = ("drafter.embed_tokens.", "target_head.")
TRAIN_ON = ("assistant", "all")  # the tokens training puts loss on (`train_on`)


def full_head_summary(x: torch.Tensor, weight: torch.Tensor, cap: float | None,
                      chunk: int = HEAD_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """argmax and logsumexp of soft_cap(x Wᵀ) over the whole vocabulary, (N,) each, a chunk of rows at a time
    (the target's full-vocabulary head, where a pruned draft vocabulary's table holds only part of it)."""
    top1 = torch.empty(len(x), dtype=torch.long, device=x.device)
    lse = torch.empty(len(x), dtype=torch.float32, device=x.device)
    for a, b in blocks(len(x), chunk):
        z = soft_cap(x[a:b].to(weight.dtype) @ weight.T, cap).float()
        top1[a:b], lse[a:b] = z.argmax(-1), torch.logsumexp(z, -1)
    return top1, lse


class DrafterModule(pl.LightningModule):
    """Train a feature drafter for `target` on offline feature shards or online target features.

    Args:
        target: the target model (as for `draftsmith extract --target`).
        kind: a feature drafter kind of `models/registry.py`: eagle (EAGLE-1/2 and HASS: one layer on
            [embed; feature], the target's head) or eagle3 (fused target layers, own norm and a
            pruned-vocabulary head).
        aux_layer_ids: target layers fused by EAGLE-3 (default [2, N//2, N-3]).
        draft_vocab_size: EAGLE-3 draft vocabulary Vd (the most frequent assistant tokens); None = full.
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
        feature_weight: weight of the smooth-L1 feature regression (EAGLE only).
        ce_weight: weight of the soft cross-entropy against the target distribution.
        topk_weight: weight of HASS's Top-K distillation loss.
        topk: K of the Top-K loss.
        target_temperature: the soft cross-entropy's and Top-K loss's target is the target's law sharpened to
            this temperature (`losses.sharpen`; < 1 for a drafter served greedily); 1 = the law itself. The
            acceptance loss and the validation metrics always read the law itself.
        acceptance_weight: weight of an acceptance-direct loss (`train/losses.acceptance_loss`: the
            acceptance rate Σ min(p, q) itself), beside or instead of the soft cross-entropy.
        acceptance_loss: its form: tv (1 − α), log (−log α) or hybrid (KL while p and q barely overlap,
            TV as they agree; the LK losses).
        acceptance_eta: η of the hybrid's weight λ = exp(−η·α).
        fc_norm: EAGLE-3.1 (eagle3 only): an RMSNorm on each fused target layer before fc.
        norm_before_fc: EAGLE-3.1 (eagle3 only): one RMSNorm on the fused layers' concatenation (not with fc_norm).
        norm_output: EAGLE-3.1 (eagle3 only): the drafter's output normed before it is fed back to the next step.
        mask_token_id: the token P-EAGLE's parallel positions and a block drafter's mask slots read (default:
            the tokenizer's unk token, else its pad, else EOS).
        feature_noise: width of EAGLE's uniform feature noise at step 0 (0 = off).
        train_on: the tokens training puts loss on: assistant (the answers), or all (every token of a chat,
            the user's turns and the template's tokens too: more of the target's laws from the same forward);
            validation scores assistant tokens either way.
        down_sample_ratio: COD sampling (`cod_positions`, P-EAGLE's; any kind here): alignment step j ≥ 1
            trains a random ratio^j of the anchors, nested (1 = every anchor); validation scores every anchor.
        down_sample_ratio_min: the floor of that share.
        init_layer: start the draft layer of an eagle3-family drafter from this target decoder layer (0-based,
            -1 the last; `models.common.start_from_target_layer_`) instead of a random one, a block drafter's n
            layers from the n target layers that end at it; None: random.
        optimizer: adamw, or muon: Muon on the draft layers' and fc's matrices, AdamW on the head, norms and
            the rest (`train.optim.MuonAdamW`; one lr for both, Muon's steps scaled to AdamW's size).
        muon_ns_steps: the Newton–Schulz steps of Muon's orthogonalization: 5 as Muon's authors run it; 3 put a
            random matrix's singular values in the same band (about 0.6–1.2) at 3/5 of the cost.
        lr: peak learning rate.
        weight_decay: decoupled weight decay.
        betas: AdamW betas.
        warmup_steps: linear warm-up steps, then cosine decay to min_lr_ratio * lr.
        min_lr_ratio: final learning rate as a fraction of lr.
        metric_top_k: K for the validation top-K agreement.
        target_dtype: dtype the target is loaded in (online features and the frozen parts).
        chat_template: the chat template the chats are rendered with, in place of the target tokenizer's
            own: a .jinja file or a template draftsmith ships (chatml, gemma, llama3); part of the identity.
        online: the data holds no features: run the frozen target inside each step (the CLI links it
            from the DataModule's `online`).
        count_tokens: vocabulary size → the training data's assistant-token counts, for EAGLE-3's draft
            vocabulary (the CLI links it from the DataModule's `token_counts`).
    """

    def __init__(self, target: str, kind: str = EAGLE.name, aux_layer_ids: list[int] | None = None,
                 draft_vocab_size: int | None = None, alignment_steps: int = 1, val_steps: int | None = None,
                 step_weight_decay: float = 1.0, detach_steps: bool = False, alignment_top_k: int = 0,
                 feature_weight: float = 1.0, ce_weight: float = 0.1,
                 topk_weight: float = 0.0, topk: int = 10, target_temperature: float = 1.0,
                 acceptance_weight: float = 0.0, acceptance_loss: str = "hybrid", acceptance_eta: float = 3.0,
                 fc_norm: bool = False, norm_before_fc: bool = False, norm_output: bool = False,
                 mask_token_id: int | None = None, down_sample_ratio: float = 1.0, down_sample_ratio_min: float = 0.2,
                 feature_noise: float = 0.0, train_on: str = "assistant", init_layer: int | None = None,
                 optimizer: str = "adamw", muon_ns_steps: int = NS_STEPS, lr: float = 3e-4, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.95),
                 warmup_steps: int = 50, min_lr_ratio: float = 0.1, metric_top_k: int = 5,
                 target_dtype: str = "float32", chat_template: str | None = None, online: bool = False,
                 count_tokens: Callable[[int], torch.Tensor] | None = None):
        super().__init__()
        if alignment_steps < 1:
            raise DraftsmithError(f"alignment_steps must be >= 1, got {alignment_steps}")
        if val_steps is not None and val_steps < 1:
            raise DraftsmithError(f"val_steps must be >= 1, got {val_steps}")
        entry = drafter_kind(kind)
        if not entry.reads_features:
            raise DraftsmithError(f"DrafterModule trains feature drafters; {entry.title} trains with {entry.trainer}")
        if not (0 < down_sample_ratio <= 1 and 0 < down_sample_ratio_min <= 1):
            raise DraftsmithError(f"down_sample_ratio and down_sample_ratio_min must be in (0, 1], got "
                                  f"{down_sample_ratio} and {down_sample_ratio_min}")
        if target_temperature <= 0:
            raise DraftsmithError(f"target_temperature must be > 0, got {target_temperature}")
        for name, value, choices in (("optimizer", optimizer, OPTIMIZERS), ("train_on", train_on, TRAIN_ON),
                                     ("acceptance_loss", acceptance_loss, ACCEPTANCE_LOSSES)):
            if value not in choices:
                raise DraftsmithError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
        if alignment_top_k < 0:
            raise DraftsmithError(f"alignment_top_k must be >= 0 (0: off), got {alignment_top_k}")
        if alignment_top_k and (entry.blocks or alignment_steps < 2):
            raise DraftsmithError(f"alignment_top_k masks the training-time-test steps after the first: it needs "
                                  f"an EAGLE-family kind with alignment_steps >= 2, got {entry.title} with "
                                  f"{alignment_steps}")
        if muon_ns_steps < 1:
            raise DraftsmithError(f"muon_ns_steps must be >= 1, got {muon_ns_steps}")
        if not entry.regresses_features and feature_weight and topk_weight == 0 and ce_weight == 0 \
                and acceptance_weight == 0:
            raise DraftsmithError(f"{entry.title} has no feature regression: set ce_weight or topk_weight > 0")
        self.save_hyperparameters(ignore=["online", "count_tokens"])  # what the data gave, not settings
        self.online, self.count_tokens = online, count_tokens
        self.drafter: torch.nn.Module | None = None
        self.val_metric = DraftAcceptance(val_steps or alignment_steps, metric_top_k)
        self._target = None  # the frozen target, kept out of the module tree (never in an optimizer)

    @property
    def kind(self) -> DrafterKind:
        return drafter_kind(self.hparams.kind)

    # --- construction ----------------------------------------------------------------------------
    def configure_optimizers(self) -> dict[str, Any]:
        return warmup_cosine_optimizers(self, self.parameters(), self.muon_parameters)

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm)

    def muon_parameters(self) -> list[torch.nn.Parameter]:
        """The matrices Muon updates: the linear maps of fc and the draft layers (not the head, the norms,
        DSpark's vocabulary-sized Markov tables or its confidence head)."""
        return [m.weight for name, m in self.drafter.named_modules()
                if isinstance(m, torch.nn.Linear) and (name == "fc" or name.startswith(("layer.", "layers.")))]

    def configure_model(self) -> None:
        if self.drafter is not None:
            return
        target, self.identity = load_frozen_target(self.hparams)
        head = target.lm_head.weight.detach()
        embed = target.embed_tokens.weight.detach()
        kind = self.kind
        self.aux_layer_ids = target.check_layer_ids(self.hparams.aux_layer_ids or target.default_aux_layer_ids(),
                                                     "model.init_args.aux_layer_ids") \
            if kind.fused_layers else []
        self.drafter = kind.model_class.from_target(target.config, embed, head, target.final_norm_scale(),
                                                    self._draft_ids(target) if kind.pruned_vocab else None,
                                                    len(self.aux_layer_ids), target.hidden_size,
                                                    **self.drafter_options(target))
        if self.hparams.get("init_layer") is not None:
            self._start_from_target_layer(target, kind)
        # the target's full-vocabulary head, for the distillation targets (a shared head is the drafter's own)
        self.softcap = logit_softcap(target.config)
        self.target_head = self.drafter.lm_head if "lm_head.weight" in kind.frozen else frozen_linear(head)
        if self.online:
            self._target = target
        if frozen.flattens_by_dtype(self._trainer):  # the frozen target parts join the trainable ones' dtype
            self.drafter.float()
            self.target_head.float()
        self.drafter.to(self.device)

    def feature_layer_ids(self) -> list[int]:
        """The target layers the drafter fuses (the target's defaults where the recipe names none), for the
        `draftsmith extract` command a run without features is told to run. Loads the target if need be."""
        if self.drafter is not None or not self.kind.fused_layers:
            return list(self.aux_layer_ids) if self.drafter is not None else []
        return list(self.hparams.aux_layer_ids or load_frozen_target(self.hparams)[0].default_aux_layer_ids())

    def _start_from_target_layer(self, target: Any, kind: DrafterKind) -> None:
        start = getattr(self.drafter, "start_from_target_layer", None)
        if start is None:
            raise DraftsmithError(f"init_layer: {kind.title} drafters start from a random layer; init_layer is an "
                                  "option of the eagle3 kinds (eagle3, peagle) and the block drafters (dflash, dspark)")
        start(target.decoder_layers(self.hparams.init_layer, self.drafter.config.num_hidden_layers,
                                    "model.init_args.init_layer"), target.norm_scale)

    def drafter_options(self, target: Any) -> dict[str, Any]:
        """The kind's model options (`DrafterKind.options`) as this module's hyper-parameters set them."""
        options = {k: self.hparams.get(k, False) for k in self.kind.options}
        if "mask_token_id" in options and options["mask_token_id"] in (None, False):
            tok = target.tokenizer
            options["mask_token_id"] = next(i for i in (tok.unk_token_id, tok.pad_token_id, tok.eos_token_id, 0)
                                            if i is not None)
        return options

    def _draft_ids(self, target: Any) -> torch.Tensor:
        """EAGLE-3's draft vocabulary: the most frequent assistant tokens of the training data."""
        from draftsmith.models.eagle3 import draft_vocab

        if getattr(self, "forced_draft_ids", None) is not None:  # rebuilt from a checkpoint or an export
            return self.forced_draft_ids
        vd = self.hparams.draft_vocab_size or target.vocab_size
        if vd >= target.vocab_size:
            return torch.arange(target.vocab_size)
        if self.count_tokens is None:
            raise DraftsmithError("a pruned draft vocabulary needs the training data's token counts; "
                                  "train through `draftsmith fit` with a draftsmith DataModule (or set "
                                  "draft_vocab_size: null)")
        specials = [i for i in (target.tokenizer.eos_token_id, target.tokenizer.pad_token_id) if i is not None]
        return draft_vocab(self.count_tokens(target.vocab_size), vd, always=specials)

    def setup(self, stage: str) -> None:
        self.configure_model()
        check_datamodule(self.trainer, self.identity, self.aux_layer_ids)

    # --- checkpoints leave the frozen target parts out; they come back from the target ---------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        frozen.strip(checkpoint["state_dict"], self._frozen_key)
        checkpoint["draftsmith"] = {"target_identity": self.identity, "aux_layer_ids": self.aux_layer_ids,
                                    "kind": self.hparams.kind}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.configure_model()
        frozen.check_identity(checkpoint.get("draftsmith", {}).get("target_identity"), self.identity)
        frozen.restore(checkpoint["state_dict"], self.state_dict(), self._frozen_key)

    def _frozen_key(self, key: str) -> bool:
        """Target parts: the embedding, the full-vocabulary head, and an EAGLE drafter's (shared) head."""
        return key.startswith(FROZEN_PREFIXES) or key.removeprefix("drafter.") in self.kind.frozen

    # --- the alignment forward shared by training and validation ------------------------------------
    def _features(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Target features (B, T, H) and fused aux (B, T, k*Ht), from the batch or the online target."""
        if "final" in batch:
            return batch["final"], batch.get("aux")
        if self._target is None:
            raise DraftsmithError("the batch holds no features and no target is loaded for online mode")
        final, extra = frozen.online_features(self._target, batch, self.aux_layer_ids)
        aux = torch.cat([extra[i] for i in self.aux_layer_ids], -1) if self.aux_layer_ids else None
        return final, aux

    @torch.no_grad()
    def _target_table(self, final: torch.Tensor, carries: torch.Tensor, with_top1: bool) -> tuple[torch.Tensor, ...]:
        """Target distributions at every position that carries loss in any step, computed once.

        Returns row (B, T+1) → table row (-1 where none), p (M', V or Vd; the M positions, then padding to
        M' rows, `bucketed_rows`), for metrics the target's full-vocabulary argmax (M',) and the share of the
        target's law a pruned draft vocabulary holds (M',; None for a full one). p is renormalised over a
        pruned vocabulary (the distillation target); p · mass is the target's own law on it, which a drafted
        token is accepted against: Σ min(p · mass, q) is the acceptance at T = 1. The metrics' extra costs one
        pass of the full head, which they need for the argmax anyway; a training step never pays it.
        """
        need = carries.clone()
        need[:, 0] = False  # position 0 is never predicted
        at = bucketed_rows(need)
        row = torch.full(need.shape, -1, dtype=torch.long, device=need.device)
        row.view(-1)[at.index[:at.n]] = torch.arange(at.n, device=need.device)
        feats = gather_rows(final, at)  # (M', H)
        rows = self.drafter.draft_to_target
        weight = self.target_head.weight if rows is None else self.target_head.weight[rows]
        z = soft_cap(feats.to(weight.dtype) @ weight.T, self.softcap).float()  # (M', V or Vd)
        p = torch.softmax(z, dim=-1)
        top1 = mass = None
        if rows is None:
            top1 = p.argmax(-1) if with_top1 else None
        elif with_top1:
            top1, lse = full_head_summary(feats, self.target_head.weight, self.softcap)
            mass = torch.exp(torch.logsumexp(z, -1) - lse).clamp_max(1.0)
        return row, p, top1, mass

    def carries(self, batch: dict[str, Any]) -> torch.Tensor:
        """(B, L) bool: x_i is a real token that carries loss — an assistant token, or while training with
        `train_on: all`, any token of the chat."""
        valid = batch["attention_mask"].bool()
        return valid if self.training and self.hparams.get("train_on") == "all" \
            else batch["loss_mask"].bool() & valid

    def alignment_forward(self, batch: dict[str, Any], with_metrics: bool) -> dict[str, torch.Tensor]:
        ids, valid = batch["input_ids"], batch["attention_mask"].bool()
        final, aux = self._features(batch)
        dtype = self.drafter.fc.weight.dtype  # bf16 shards meet fp32 weights; autocast decides matmuls
        final, aux = final.to(dtype), (aux.to(dtype) if aux is not None else None)
        t = ids.shape[1] - 1
        anchors = valid[:, :-1]  # (B, T)
        carries = self.carries(batch)  # (B, T+1): x_i is a real token that carries loss
        row, table, top1, mass_in = self._target_table(final, carries, with_metrics)  # table: (M, V or Vd)
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
        out = self.alignment_forward(batch, with_metrics=False)
        if not torch.isfinite(out["loss"]):
            bad = {k: float(v.detach()) for k, v in out.items()}
            raise DraftsmithError(
                f"non-finite loss at step {self.global_step} (batch {batch_idx}): {bad}; check the features "
                "for inf/NaN (bf16 overflow), lower the learning rate, or enable gradient clipping"
            )
        tokens = loss_tokens(batch)
        self.log("train/loss", out["loss"], prog_bar=True, batch_size=tokens)
        for k, v in out.items():
            if k != "loss":
                self.log(f"train/{k}", v, batch_size=tokens)
        return out["loss"]

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        out = self.alignment_forward(batch, with_metrics=True)
        self.log("val/loss", out["loss"], batch_size=loss_tokens(batch), sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        for k, v in self.val_metric.compute().items():
            self.log(f"val/{k}", v, prog_bar=k == "tau", sync_dist=False)
        self.val_metric.reset()
