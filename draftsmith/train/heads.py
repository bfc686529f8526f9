"""Training stop heads on labels (`draftsmith labels`): SpecDec++ acceptance heads and DISCO classifiers.

A row is one drafted token: what the policy would see when deciding after it (the drafter's hidden
state, or its distribution's top-k probabilities, entropy and the token's position) and what
verification made of it (`soft` = min(1, p/q) of a token sampled at T = 1, `hard` = the greedy token
is the target's). The loss is SpecDec++'s class-weighted binary cross-entropy mixed by the label a:

    Σ r·[w(1−a)(−log(1−â)) + a(−log â)] / Σ r·[w(1−a) + a]

w weighs rejections (6 in SpecDec++'s recipe; a stop decision that misses a rejection costs a
wasted verification row, one that misses an acceptance only a shorter draft) and r = (1−m)^(j−1)
weighs depth j as SpecDec++'s training data does, where a position keeps the target's token with
probability m (the mixing ratio) and so a drafted run reaches depth j with probability (1−m)^(j−1).
Validation (torchmetrics): the mixed loss, BCE and binary KL against the label, and AUROC, F1 and
expected calibration error against the label rounded to 0/1. Every row is a drafted token; the
train/validation split is by chat id.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Callable

import pytorch_lightning as pl
import torch
from torchmetrics import MeanMetric
from torchmetrics.classification import BinaryAUROC, BinaryCalibrationError, BinaryF1Score

from draftsmith import DraftsmithError
from draftsmith.data.conversations import split_of
from draftsmith.models.heads import head_config
from draftsmith.models.registry import HEAD_KINDS, SPECDEC, HeadKind, head_kind
from draftsmith.train.optim import clip_gradients, warmup_cosine_optimizers

LABELS = ("soft", "hard")


class LabelDataModule(pl.LightningDataModule):
    """Label rows from a `draftsmith labels` directory, split by chat id, in shuffled batches.

    Args:
        labels: the label directory.
        target: the target model (the CLI links it from the model; checked against the labels').
        chat_template: its chat template (the CLI links it from the model's).
        template_kwargs: the variables set in it (the CLI links them from the model's).
        val_fraction: share of chats held out for validation.
        batch_size: rows per batch.
        max_depth: use rows up to this draft depth (None: every depth labelled).
        seed: shuffling seed.
    """

    online = False
    token_counts = None

    def __init__(self, labels: str, target: str | None = None, val_fraction: float = 0.1, batch_size: int = 2048,
                 max_depth: int | None = None, seed: int = 0, chat_template: str | None = None,
                 template_kwargs: dict[str, Any] | None = None):
        super().__init__()
        self.labels, self.target, self.val_fraction = labels, target, val_fraction
        self.batch_size, self.max_depth, self.seed = batch_size, max_depth, seed
        self.run: dict[str, Any] | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.run is not None:
            return
        from draftsmith.data.labels import read_labels

        self.run, self.rows, ids, chat_of = read_labels(self.labels)
        keep = torch.ones(len(chat_of), dtype=torch.bool)
        if self.max_depth is not None:
            if self.max_depth > self.run["k"]:
                raise DraftsmithError(f"--data.max_depth {self.max_depth}: {self.labels} labels depths up to {self.run['k']}")
            keep = self.rows["depth"].long() <= self.max_depth
        val_chat = torch.tensor([split_of(i, self.val_fraction) == "val" for i in ids], dtype=torch.bool)
        in_val = val_chat[chat_of] if len(ids) else keep
        self.train_rows = torch.nonzero(keep & ~in_val)[:, 0]
        self.val_rows = torch.nonzero(keep & in_val)[:, 0]
        if not len(self.train_rows) or not len(self.val_rows):
            raise DraftsmithError(f"{self.labels}: {len(self.train_rows)} training and {len(self.val_rows)} validation rows "
                                  f"from {len(ids)} chats (val_fraction {self.val_fraction}); label more chats")

    def _collate(self, index: list[int]) -> dict[str, torch.Tensor]:
        idx = torch.tensor(index)
        return {k: v[idx] for k, v in self.rows.items()}

    def _loader(self, rows: torch.Tensor, shuffle: bool) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(self.seed)
        return torch.utils.data.DataLoader(rows.tolist(), batch_size=self.batch_size, shuffle=shuffle, generator=g,
                                           collate_fn=self._collate)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return self._loader(self.train_rows, shuffle=True)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return self._loader(self.val_rows, shuffle=False)


def mixed_bce(logits: torch.Tensor, label: torch.Tensor, rejection_weight: float, weight: torch.Tensor) -> torch.Tensor:
    """SpecDec++'s loss: Σ r·[w(1−a)(−log(1−â)) + a(−log â)] / Σ r·[w(1−a) + a], â = sigmoid(logits)."""
    a = label.float()
    nll_accept, nll_reject = torch.nn.functional.softplus(-logits), torch.nn.functional.softplus(logits)
    num = (weight * (rejection_weight * (1 - a) * nll_reject + a * nll_accept)).sum()
    return num / (weight * (rejection_weight * (1 - a) + a)).sum().clamp_min(1e-12)


class StopHeadModule(pl.LightningModule):
    """Fit a stop head on label rows; the drafter and the target stay out of training entirely.

    Args:
        target: the target model the labels were made with (checked by identity).
        chat_template: a chat template in place of the target tokenizer's own (as `--chat_template`).
        template_kwargs: variables set in the chat template (as `--template_kwargs`).
        kind: specdec (acceptance head on the drafter's hidden state) or disco (stop classifier on the
            drafter's top-k probabilities, entropy and position).
        label: soft (min(1, p/q) at T = 1, SpecDec++'s) or hard (the greedy token is the target's, DISCO's).
        num_layers: residual blocks of the acceptance head.
        normalize: the acceptance head scales each hidden state to unit RMS before its blocks.
        draft_features: the acceptance head also reads DISCO's features of the drafter's distribution
            (this many of its largest probabilities, its entropy, the position); 0: the hidden state alone.
        top_k: probabilities the stop classifier reads.
        width: the stop classifier's hidden width.
        rejection_weight: w, the weight of rejected tokens in the loss.
        mixing_ratio: m; depth j weighs (1 − m)^(j−1), as SpecDec++'s mixed sequences do (0: all depths alike).
        lr: peak AdamW learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: linear warm-up steps, then cosine decay to min_lr_ratio * lr.
        min_lr_ratio: final learning rate as a fraction of lr.
        online: unused (stop heads train on stored labels); the CLI links it for every recipe.
        count_tokens: unused; the CLI links it for every recipe.
    """

    def __init__(self, target: str, kind: str = SPECDEC.name, label: str = "soft", num_layers: int = 3, normalize: bool = True,
                 draft_features: int = 0, top_k: int = 10, width: int = 64, rejection_weight: float = 6.0,
                 mixing_ratio: float = 0.15, lr: float = 1e-3, weight_decay: float = 0.0, warmup_steps: int = 20,
                 min_lr_ratio: float = 0.1, chat_template: str | None = None, template_kwargs: dict[str, Any] | None = None,
                 online: bool = False, count_tokens: Callable[[int], torch.Tensor] | None = None):
        super().__init__()
        self.save_hyperparameters(ignore=["online", "count_tokens"])
        if kind not in HEAD_KINDS:
            raise DraftsmithError(f"--model.kind must be {' or '.join(HEAD_KINDS)}, got {kind!r}")
        if label not in LABELS:
            raise DraftsmithError(f"--model.label must be one of {LABELS}, got {label!r}")
        if rejection_weight <= 0 or not 0 <= mixing_ratio < 1:
            raise DraftsmithError("rejection_weight must be > 0 and mixing_ratio in [0, 1)")
        self.head: torch.nn.Module | None = None
        self.labels_run: dict[str, Any] | None = None
        self.val_metrics = torch.nn.ModuleDict({"auroc": BinaryAUROC(), "f1": BinaryF1Score(),
                                                "ece": BinaryCalibrationError(n_bins=10)})
        self.val_means = torch.nn.ModuleDict({k: MeanMetric() for k in ("loss", "bce", "kl", "predicted", "label")})

    @property
    def kind(self) -> HeadKind:
        return head_kind(self.hparams.kind)

    def build(self, labels_run: dict[str, Any]) -> None:
        """The head for labels made with `labels_run` (its drafter's hidden size, its top-k)."""
        config = self.kind.config_from(self.hparams, labels_run["hidden_size"])
        if config.probabilities > labels_run["top_k"]:
            raise DraftsmithError(f"--model.{self.kind.probabilities_option} {config.probabilities}: the labels keep "
                                  f"{labels_run['top_k']} probabilities per token")
        self.labels_run = labels_run
        self.head = self.kind.build(asdict(config))

    def setup(self, stage: str) -> None:
        if self.head is not None:
            return
        data = self.trainer.datamodule
        data.setup(stage)
        from draftsmith.models.target import load_target

        target = load_target(self.hparams.target, dtype="float32", chat_template=self.hparams.chat_template,
                             template_kwargs=self.hparams.get("template_kwargs"))
        diffs = target.identity.differences(data.run["target"])
        if diffs:
            raise DraftsmithError(f"{data.labels} was labelled with another target: {'; '.join(diffs)}")
        self.build(data.run)

    def _loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.head(*self.head.stored_inputs(batch))
        label = batch[self.hparams.label].float()
        weight = (1 - self.hparams.mixing_ratio) ** (batch["depth"].float() - 1)
        return mixed_bce(logits, label, self.hparams.rejection_weight, weight), logits, label

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, _, _ = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch["depth"]))
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, logits, label = self._loss(batch)
        n = len(label)
        logits = self.head.calibrated(logits)  # the metrics judge the predicted probability itself
        prob = torch.sigmoid(logits)
        bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, label, reduction="none")
        entropy = torch.nn.functional.binary_cross_entropy(label, label, reduction="none")  # H(a), 0 for 0/1 labels
        self.val_means["loss"].update(loss, n)
        self.val_means["bce"].update(bce)
        self.val_means["kl"].update(bce - entropy)
        self.val_means["predicted"].update(prob)
        self.val_means["label"].update(label)
        binary = (label > 0.5).long()
        for metric in self.val_metrics.values():
            metric.update(prob, binary)

    def on_validation_epoch_end(self) -> None:
        for name, metric in {**self.val_means, **self.val_metrics}.items():
            self.log(f"val/{name}", metric.compute(), prog_bar=name in ("auroc", "loss"))
            metric.reset()

    def configure_optimizers(self) -> dict[str, Any]:
        return warmup_cosine_optimizers(self, self.head.parameters())

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["draftsmith"] = {"kind": self.hparams.kind, "labels_run": self.labels_run,
                                    "head_config": head_config(self.head), "target_identity": self.labels_run["target"]}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "normalize" not in checkpoint.get("hyper_parameters", {}):
            self.hparams.normalize = False  # trained before the option: its blocks read the raw hidden state
        if self.head is None:
            self.build(checkpoint["draftsmith"]["labels_run"])
