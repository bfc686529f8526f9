"""LightningModule for standalone draft LMs distilled from the target (forward KL).

Position t of the student predicts x_{t+1}, as the target's p_t = softmax(head(f_t)) does;
loss where x_{t+1} is an assistant token. Offline, p comes from the stored final features
and the target's head; online, from the target run inside the step.

Notation: B batch, T sequence, V vocab.
"""

from __future__ import annotations

from typing import Any, Callable

import pytorch_lightning as pl
import torch

from draftsmith import DraftsmithError
from draftsmith.data.modules import check_datamodule
from draftsmith.models.common import frozen_linear, logit_softcap, soft_cap
from draftsmith.models.registry import STANDALONE
from draftsmith.train import frozen
from draftsmith.train.alignment import Rows, bucketed_rows, gather_rows
from draftsmith.train.frozen import load_frozen_target
from draftsmith.train.losses import forward_kl, head_forward_kl, loss_tokens
from draftsmith.train.metrics import DraftAcceptance
from draftsmith.train.optim import clip_gradients, warmup_cosine_optimizers


class DistillModule(pl.LightningModule):
    """Distil a small causal LM from `target`.

    Args:
        target: the target model (as for `draftsmith extract --target`).
        num_layers: decoder layers of the draft LM (copied from the target's first layers).
        layer_ids: copy these target decoder layers instead (e.g. [0, 1, 2, 29]); sets the layer count.
        shape: a smaller configured shape (hidden_size, intermediate_size, heads...); layers start random.
        lora_rank: train LoRA adapters of this rank instead of all weights (None = full training).
        kl_top_k: restrict the target distribution to its top-K (None = full vocabulary).
        chain_length: K of the greedy chain whose simulated acceptance τ̂ is logged.
        lr: peak AdamW learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: linear warm-up steps, then cosine decay to min_lr_ratio * lr.
        min_lr_ratio: final learning rate as a fraction of lr.
        target_dtype: dtype the target is loaded in.
        chat_template: a chat template in place of the target tokenizer's own (as `--chat_template`).
        template_kwargs: variables set in the chat template (as `--template_kwargs`).
        online: the data holds no features: run the frozen target inside each step (the CLI links it
            from the DataModule's `online`).
        count_tokens: vocabulary size → the training data's assistant-token counts, kept with the
            checkpoint and the export for the runtime's frequency-ranked head (the CLI links it from the
            DataModule's `token_counts`).
    """

    def __init__(self, target: str, num_layers: int = 4, shape: dict[str, int] | None = None,
                 layer_ids: list[int] | None = None, lora_rank: int | None = None, kl_top_k: int | None = None,
                 chain_length: int = 4,
                 lr: float = 5e-4, weight_decay: float = 0.0, warmup_steps: int = 50, min_lr_ratio: float = 0.1,
                 target_dtype: str = "float32", chat_template: str | None = None,
                 template_kwargs: dict[str, Any] | None = None, online: bool = False,
                 count_tokens: Callable[[int], torch.Tensor] | None = None):
        super().__init__()
        self.save_hyperparameters(ignore=["online", "count_tokens"])  # what the data gave, not settings
        self.online, self.count_tokens = online, count_tokens
        self.student = None
        self.val_metric = DraftAcceptance(1)
        self._target = None
        self.token_counts: torch.Tensor | None = None  # assistant-token counts of the training data (V,)

    kind = STANDALONE

    def configure_model(self) -> None:
        if self.student is not None:
            return
        from draftsmith.models.standalone import add_lora, build_standalone

        target, self.identity = load_frozen_target(self.hparams)
        self.aux_layer_ids: list[int] = []
        self.target_head = frozen_linear(target.lm_head.weight.detach())
        self.softcap = logit_softcap(target.config)
        student = build_standalone(target.model, self.hparams.num_layers, self.hparams.shape, self.hparams.layer_ids)
        self.student = add_lora(student, self.hparams.lora_rank) if self.hparams.lora_rank else student
        warn_large_vocabulary(student, self.hparams.lora_rank)
        if self.online:
            self._target = target

    def setup(self, stage: str) -> None:
        self.configure_model()
        check_datamodule(self.trainer, self.identity, [])
        if stage == "fit" and self.token_counts is None and self.count_tokens is not None:
            # kept with the checkpoint and the export: the runtime's frequency-ranked head reads them
            self.token_counts = self.count_tokens(self.target_head.weight.shape[0])

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        frozen.strip(checkpoint["state_dict"], self._frozen_key)
        checkpoint["draftsmith"] = {"target_identity": self.identity, "kind": self.kind.name}
        if self.token_counts is not None:
            checkpoint["draftsmith"]["token_counts"] = self.token_counts

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.configure_model()
        frozen.check_identity(checkpoint.get("draftsmith", {}).get("target_identity"), self.identity)
        self.token_counts = checkpoint.get("draftsmith", {}).get("token_counts")
        frozen.restore(checkpoint["state_dict"], self.state_dict(), self._frozen_key)

    @staticmethod
    def _frozen_key(key: str) -> bool:
        """The target's head (the student's own weights are all trained)."""
        return key == "target_head.weight"

    def _target_logits(self, batch: dict[str, Any], at: Rows) -> torch.Tensor:
        """The target's logits (N', V) at the selected positions `at` of the (B, T) anchors."""
        with torch.no_grad():
            if "final" in batch:
                final = batch["final"]
            elif self._target is not None:
                final, _ = frozen.online_features(self._target, batch)
            else:
                raise DraftsmithError("the batch holds no features and no target is loaded for online mode")
            picked = gather_rows(final[:, :-1], at).to(self.target_head.weight.dtype)
            return soft_cap(self.target_head(picked), self.softcap)

    def _step(self, batch: dict[str, Any], with_metrics: bool) -> torch.Tensor:
        valid = batch["attention_mask"].bool()
        sel = valid[:, :-1] & batch["loss_mask"].bool()[:, 1:] & valid[:, 1:]  # x_{t+1} is an assistant token
        # both heads run on the loss positions only (a quarter of the rows are prompts here)
        hidden = self.student.get_decoder()(input_ids=batch["input_ids"], attention_mask=valid.long()).last_hidden_state
        at = bucketed_rows(sel)  # the N loss positions, padded to a few shapes; `every` marks the real ones
        x, head = gather_rows(hidden[:, :-1], at), self.student.get_output_embeddings()  # (N', H)
        target = self._target_logits(batch, at)  # (N', V)
        every = at.real
        if self.hparams.kl_top_k is None and head.bias is None:  # the student's (N, V) logits are never formed
            loss = head_forward_kl(x, head.weight, target, every)
        else:
            loss = forward_kl(head(x), target, every, self.hparams.kl_top_k)
        if with_metrics and at.n:
            with torch.no_grad():
                n = at.n
                p = torch.softmax(target[:n].float(), -1)
                self.val_metric.update_from_head(0, x[:n], head.weight, p, torch.arange(n, device=x.device),
                                                 target[:n].argmax(-1), bias=head.bias)
        return loss

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss = self._step(batch, with_metrics=False)
        if not torch.isfinite(loss):
            raise DraftsmithError(f"non-finite loss at step {self.global_step}: {float(loss)}; lower the learning rate")
        self.log("train/kl", loss, prog_bar=True, batch_size=loss_tokens(batch))
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.log("val/kl", self._step(batch, with_metrics=True), sync_dist=True, batch_size=loss_tokens(batch))

    def on_validation_epoch_end(self) -> None:
        m = self.val_metric.compute()
        acc = float(m["acc_0"])
        k = self.hparams.chain_length
        self.log("val/acc", acc)
        self.log("val/tau", 1 + sum(acc**i for i in range(1, k + 1)), prog_bar=True)  # i.i.d. chain of K
        self.val_metric.reset()

    def configure_optimizers(self) -> dict[str, Any]:
        return warmup_cosine_optimizers(self, self.student.parameters())

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm)


LARGE_VOCABULARY_WEIGHTS = 50_000_000  # embedding + head weights from which a full standalone fit is slow


def warn_large_vocabulary(student: Any, lora_rank: int | None) -> None:
    """Say so when a fully trained draft LM's embedding and head dwarf its layers (Gemma's 262k vocabulary:
    2 × 168M weights, each with its AdamW state, updated every step)."""
    from pytorch_lightning.utilities.rank_zero import rank_zero_warn

    vocab, hidden = student.get_input_embeddings().weight.shape
    tied = student.get_output_embeddings().weight is student.get_input_embeddings().weight
    weights = vocab * hidden * (1 if tied else 2)
    if lora_rank or weights < LARGE_VOCABULARY_WEIGHTS:
        return
    rank_zero_warn(f"the draft LM trains its {vocab:,}-token embedding and head in full ({weights / 1e6:.0f}M weights "
                   "and their optimizer state, every step): expect slow steps and several GB; "
                   "--model.init_args.lora_rank 16 trains adapters instead, a feature drafter (eagle3) drafts "
                   "from a pruned vocabulary")
