"""What the two feature drafters' LightningModules share, held by each (composition, not a parent class).

EAGLE's `DrafterModule` (train/drafter.py) and the block drafters' `BlockDrafterModule` (train/block.py)
train different things the same way: a drafter built for a frozen target, distilled from the target's
distributions at the positions that carry loss, its checkpoints without the target's parts. `FeatureDrafting`
is that shared part: the settings both take, the drafter and target head it builds for the module to hold,
the features and target distributions the losses read, and the checkpoint's target identity. Each module
adds only its own settings and loss.

Notation: B batch, T positions, H hidden, V vocab (Vd a pruned draft vocabulary's), M selected positions.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from draftsmith import DraftsmithError
from draftsmith.models.common import frozen_linear, logit_softcap, soft_cap
from draftsmith.models.registry import DrafterKind, drafter_kind
from draftsmith.train import frozen
from draftsmith.train.alignment import bucketed_rows, gather_rows
from draftsmith.train.frozen import load_frozen_target
from draftsmith.train.head_kernel import HEAD_CHUNK, blocks
from draftsmith.train.losses import ACCEPTANCE_LOSSES, loss_tokens
from draftsmith.train.optim import NS_STEPS, OPTIMIZERS

FROZEN_PREFIXES = ("drafter.embed_tokens.", "target_head.")
TRAIN_ON = ("assistant", "all")  # the tokens training puts loss on (`train_on`)
FROM_THE_DATA = ("online", "count_tokens")  # what the DataModule gives, not settings: never in hparams


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


def own_settings(frame_locals: Mapping[str, Any]) -> dict[str, Any]:
    """A module's own settings from `locals()` taken first thing in its `__init__` (less self and **settings)."""
    return {k: v for k, v in frame_locals.items() if k not in ("self", "settings", "__class__")}


class FeatureDrafting:
    """The settings, drafter and target parts both feature drafters' modules share.

    Args:
        target: the target model (as for `draftsmith extract --target`).
        kind: a feature drafter kind of `models/registry.py`.
        aux_layer_ids: target layers fused by the eagle3 family and the block drafters (default [2, N//2, N-3]).
        draft_vocab_size: the draft vocabulary Vd (the most frequent assistant tokens); None = full.
        ce_weight: weight of the soft cross-entropy against the target distribution.
        target_temperature: the soft cross-entropy's (and Top-K loss's) target is the target's law sharpened to
            this temperature (`losses.sharpen`; < 1 for a drafter served greedily); 1 = the law itself. The
            acceptance loss and the validation metrics always read the law itself.
        acceptance_weight: weight of an acceptance-direct loss (`train/losses.acceptance_loss`: the
            acceptance rate Σ min(p, q) itself), beside or instead of the soft cross-entropy.
        acceptance_loss: its form: tv (1 − α), log (−log α) or hybrid (KL while p and q barely overlap,
            TV as they agree; the LK losses).
        acceptance_eta: η of the hybrid's weight λ = exp(−η·α).
        fc_norm: EAGLE-3.1 (eagle3 family only): an RMSNorm on each fused target layer before fc.
        norm_before_fc: EAGLE-3.1 (eagle3 family only): one RMSNorm on the fused layers' concatenation (not with
            fc_norm).
        norm_output: EAGLE-3.1 (eagle3 family only): the drafter's output normed before it is fed back to the
            next step.
        rope_theta: the eagle3 family's draft layer's RoPE base in place of the target's (None): a larger one
            turns the positions of a long context through the angles a drafter trained on short ones has seen
            (docs/training.md, Long contexts); the exports' configs carry it.
        mask_token_id: the token P-EAGLE's parallel positions and a block drafter's mask slots read (default:
            the tokenizer's unk token, else its pad, else EOS).
        train_on: the tokens training puts loss on: assistant (the answers), or all (every token of a chat,
            the user's turns and the template's tokens too: more of the target's laws from the same forward);
            validation scores assistant tokens either way.
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
        template_kwargs: variables the chat template reads (e.g. {"enable_thinking": false}); part of the
            identity, as the template.
        online: the data holds no features: run the frozen target inside each step (the CLI links it
            from the DataModule's `online`).
        count_tokens: vocabulary size → the training data's assistant-token counts, for a pruned draft
            vocabulary (the CLI links it from the DataModule's `token_counts`).
    """

    def __init__(self, target: str, kind: str, aux_layer_ids: list[int] | None = None,
                 draft_vocab_size: int | None = None, ce_weight: float = 0.1, target_temperature: float = 1.0,
                 acceptance_weight: float = 0.0, acceptance_loss: str = "hybrid", acceptance_eta: float = 3.0,
                 fc_norm: bool = False, norm_before_fc: bool = False, norm_output: bool = False,
                 rope_theta: float | None = None, mask_token_id: int | None = None, train_on: str = "assistant",
                 init_layer: int | None = None,
                 optimizer: str = "adamw", muon_ns_steps: int = NS_STEPS, lr: float = 3e-4, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.95), warmup_steps: int = 50, min_lr_ratio: float = 0.1,
                 metric_top_k: int = 5, target_dtype: str = "float32", chat_template: str | None = None,
                 template_kwargs: dict[str, Any] | None = None, online: bool = False,
                 count_tokens: Callable[[int], torch.Tensor] | None = None):
        given = dict(locals())
        self.settings = {k: v for k, v in given.items() if k not in ("self", *FROM_THE_DATA)}
        self.kind: DrafterKind = drafter_kind(kind)
        if not self.kind.reads_features:
            raise DraftsmithError(f"{self.kind.title} reads no target features; it trains with {self.kind.trainer}")
        if target_temperature <= 0:
            raise DraftsmithError(f"target_temperature must be > 0, got {target_temperature}")
        for name, value, choices in (("optimizer", optimizer, OPTIMIZERS), ("train_on", train_on, TRAIN_ON),
                                     ("acceptance_loss", acceptance_loss, ACCEPTANCE_LOSSES)):
            if value not in choices:
                raise DraftsmithError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
        if muon_ns_steps < 1:
            raise DraftsmithError(f"muon_ns_steps must be >= 1, got {muon_ns_steps}")
        self.online, self.count_tokens = online, count_tokens
        self.identity: dict[str, Any] | None = None
        self.aux_layer_ids: list[int] = []
        self.softcap: float | None = None
        self.forced_draft_ids: torch.Tensor | None = None  # a checkpoint's or an export's draft vocabulary
        self.target = None  # the frozen target for online features, kept out of the module tree

    # --- construction ----------------------------------------------------------------------------
    def build(self, hparams: Mapping[str, Any], trainer: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
        """Load the frozen target; return the drafter built for it (its options from `hparams`, the module's
        settings) and the target's full-vocabulary head the distillation targets come from."""
        target, self.identity = load_frozen_target(hparams)
        head, embed, kind = target.lm_head.weight.detach(), target.embed_tokens.weight.detach(), self.kind
        self.aux_layer_ids = target.check_layer_ids(hparams.get("aux_layer_ids") or target.default_aux_layer_ids(),
                                                    "model.init_args.aux_layer_ids") if kind.fused_layers else []
        drafter = kind.model_class.from_target(target.config, embed, head, target.final_norm_scale(),
                                               self._draft_ids(hparams, target) if kind.pruned_vocab else None,
                                               len(self.aux_layer_ids), target.hidden_size,
                                               **self._drafter_options(hparams, target))
        if hparams.get("init_layer") is not None:
            start = getattr(drafter, "start_from_target_layer", None)
            if start is None:
                raise DraftsmithError(f"init_layer: {kind.title} drafters start from a random layer; init_layer is "
                                      "an option of the eagle3 kinds (eagle3, peagle) and the block drafters "
                                      "(dflash, dspark)")
            start(target.decoder_layers(hparams["init_layer"], drafter.config.num_hidden_layers,
                                        "model.init_args.init_layer"), target.norm_scale)
        self.softcap = logit_softcap(target.config)
        target_head = drafter.lm_head if "lm_head.weight" in kind.frozen else frozen_linear(head)
        if self.online:
            self.target = target
        if frozen.flattens_by_dtype(trainer):  # the frozen target parts join the trainable ones' dtype
            drafter.float()
            target_head.float()
        return drafter, target_head

    def feature_layer_ids(self, hparams: Mapping[str, Any], built: bool) -> list[int]:
        """The target layers the drafter fuses (the target's defaults where the recipe names none), for the
        `draftsmith extract` command a run without features is told to run. Loads the target if need be."""
        if built or not self.kind.fused_layers:
            return list(self.aux_layer_ids)
        return list(hparams.get("aux_layer_ids") or load_frozen_target(hparams)[0].default_aux_layer_ids())

    def _drafter_options(self, hparams: Mapping[str, Any], target: Any) -> dict[str, Any]:
        """The kind's model options (`DrafterKind.options`) as the module's hyper-parameters set them."""
        options = {k: hparams.get(k, False) for k in self.kind.options}
        if "mask_token_id" in options and options["mask_token_id"] in (None, False):
            tok = target.tokenizer
            options["mask_token_id"] = next(i for i in (tok.unk_token_id, tok.pad_token_id, tok.eos_token_id, 0)
                                            if i is not None)
        return options

    def _draft_ids(self, hparams: Mapping[str, Any], target: Any) -> torch.Tensor:
        """A pruned draft vocabulary: the most frequent assistant tokens of the training data."""
        from draftsmith.models.eagle3 import draft_vocab

        if self.forced_draft_ids is not None:  # rebuilt from a checkpoint or an export
            return self.forced_draft_ids
        vd = hparams.get("draft_vocab_size") or target.vocab_size
        if vd >= target.vocab_size:
            return torch.arange(target.vocab_size)
        if self.count_tokens is None:
            raise DraftsmithError("a pruned draft vocabulary needs the training data's token counts; "
                                  "train through `draftsmith fit` with a draftsmith DataModule (or set "
                                  "draft_vocab_size: null)")
        specials = [i for i in (target.tokenizer.eos_token_id, target.tokenizer.pad_token_id) if i is not None]
        return draft_vocab(self.count_tokens(target.vocab_size), vd, always=specials)

    @staticmethod
    def muon_parameters(drafter: torch.nn.Module) -> list[torch.nn.Parameter]:
        """The matrices Muon updates: the linear maps of fc and the draft layers (not the head, the norms,
        DSpark's vocabulary-sized Markov tables or its confidence head)."""
        return [m.weight for name, m in drafter.named_modules()
                if isinstance(m, torch.nn.Linear) and (name == "fc" or name.startswith(("layer.", "layers.")))]

    # --- checkpoints leave the frozen target parts out; they come back from the target ---------------
    def save(self, checkpoint: dict[str, Any]) -> None:
        frozen.strip(checkpoint["state_dict"], self.frozen_key)
        checkpoint["draftsmith"] = {"target_identity": self.identity, "aux_layer_ids": self.aux_layer_ids,
                                    "kind": self.kind.name}

    def restore(self, checkpoint: dict[str, Any], module_state: dict[str, torch.Tensor]) -> None:
        frozen.check_identity(checkpoint.get("draftsmith", {}).get("target_identity"), self.identity)
        frozen.restore(checkpoint["state_dict"], module_state, self.frozen_key)

    def frozen_key(self, key: str) -> bool:
        """Target parts: the embedding, the full-vocabulary head, and an EAGLE drafter's (shared) head."""
        return key.startswith(FROZEN_PREFIXES) or key.removeprefix("drafter.") in self.kind.frozen

    # --- what the losses read ----------------------------------------------------------------------
    def features(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Target features (B, T, H) and fused aux (B, T, k*Ht), from the batch or the online target."""
        if "final" in batch:
            return batch["final"], batch.get("aux")
        if self.target is None:
            raise DraftsmithError("the batch holds no features and no target is loaded for online mode")
        final, extra = frozen.online_features(self.target, batch, self.aux_layer_ids)
        aux = torch.cat([extra[i] for i in self.aux_layer_ids], -1) if self.aux_layer_ids else None
        return final, aux

    @staticmethod
    def carries(batch: dict[str, Any], train_on_all: bool) -> torch.Tensor:
        """(B, L) bool: x_i is a real token that carries loss — an assistant token, or while training with
        `train_on: all` (`train_on_all`), any token of the chat."""
        valid = batch["attention_mask"].bool()
        return valid if train_on_all else batch["loss_mask"].bool() & valid

    @torch.no_grad()
    def target_table(self, drafter: torch.nn.Module, target_head: torch.nn.Module, final: torch.Tensor,
                     carries: torch.Tensor, with_top1: bool) -> tuple[torch.Tensor, ...]:
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
        rows = drafter.draft_to_target
        weight = target_head.weight if rows is None else target_head.weight[rows]
        z = soft_cap(feats.to(weight.dtype) @ weight.T, self.softcap).float()  # (M', V or Vd)
        p = torch.softmax(z, dim=-1)
        top1 = mass = None
        if rows is None:
            top1 = p.argmax(-1) if with_top1 else None
        elif with_top1:
            top1, lse = full_head_summary(feats, target_head.weight, self.softcap)
            mass = torch.exp(torch.logsumexp(z, -1) - lse).clamp_max(1.0)
        return row, p, top1, mass


# --- the Lightning steps' bookkeeping, the same for both modules ---------------------------------------
def logged_training_loss(module: Any, out: dict[str, torch.Tensor], batch: dict[str, Any], batch_idx: int
                         ) -> torch.Tensor:
    """A training step's loss from its parts `out`: refused where it is not finite, logged per loss token."""
    if not torch.isfinite(out["loss"]):
        bad = {k: float(v.detach()) for k, v in out.items()}
        raise DraftsmithError(
            f"non-finite loss at step {module.global_step} (batch {batch_idx}): {bad}; check the features "
            "for inf/NaN (bf16 overflow), lower the learning rate, or enable gradient clipping"
        )
    tokens = loss_tokens(batch)
    module.log("train/loss", out["loss"], prog_bar=True, batch_size=tokens)
    for k, v in out.items():
        if k != "loss":
            module.log(f"train/{k}", v, batch_size=tokens)
    return out["loss"]


def log_validation_metrics(module: Any, metric: Any) -> None:
    """An epoch's validation metrics (τ̂ on the progress bar), then a fresh metric."""
    for k, v in metric.compute().items():
        module.log(f"val/{k}", v, prog_bar=k == "tau", sync_dist=False)
    metric.reset()
