"""LightningDataModules over feature shards: length-bucketed batches, split by conversation id.

Batch keys (B batch, T the longest record in the batch rounded up to a multiple of 64, H hidden, k extra layers):
input_ids (B, T) long, attention_mask (B, T) bool, loss_mask (B, T) bool,
final (B, T, H), aux (B, T, k*H) when layer ids are asked for, ids (list of str).
"""

from __future__ import annotations

import functools
import json
from typing import Any, Iterator, Protocol, runtime_checkable

import numpy as np
import pytorch_lightning as pl
import torch

from draftsmith import DraftsmithError
from draftsmith.data.conversations import VAL_FRACTION, split_of
from draftsmith.data.features import FeatureReader, read_manifest
from draftsmith.data.mixing import Directories, Mix, MixedFeatures
from draftsmith.models.target import identity_differences


class LengthBatchSampler(torch.utils.data.Sampler):
    """Batches of similar length within a padded-token budget, reshuffled every epoch.

    With `world_size` > 1 each rank takes every world_size-th batch of the same shuffled
    order, truncated so that all ranks run the same number of steps. `multiple`: the batch's width is
    its longest record rounded up to a multiple of this (as `pad_collate` pads it), and the budget
    counts that width.
    """

    def __init__(self, lengths: np.ndarray, indices: np.ndarray | Mix, max_tokens: int, max_batch_size: int,
                 shuffle: bool, seed: int = 0, rank: int = 0, world_size: int = 1, multiple: int = 1):
        self.lengths = np.asarray(lengths)
        self.indices = indices if isinstance(indices, Mix) else np.asarray(indices)
        self.widths = -(-self.lengths // multiple) * multiple
        self.max_tokens, self.max_batch_size = max_tokens, max_batch_size
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self.rank, self.world_size = rank, world_size
        self.resume: dict[str, int] | None = None  # {"epoch", "batches_done"} from a checkpoint

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self) -> list[list[int]]:
        rng = np.random.default_rng(self.seed + self.epoch)
        indices = self.indices.draw(self.epoch, rng) if isinstance(self.indices, Mix) else self.indices
        order = rng.permutation(indices) if self.shuffle else indices.copy()
        order = order[np.argsort(-self.lengths[order], kind="stable")]
        batches, current = [], []
        for i in order.tolist():
            width = self.widths[current[0]] if current else self.widths[i]
            if current and (len(current) >= self.max_batch_size or (len(current) + 1) * width > self.max_tokens):
                batches.append(current)
                current = []
            current.append(i)
        if current:
            batches.append(current)
        if self.shuffle:
            batches = [batches[j] for j in rng.permutation(len(batches))]
        usable = len(batches) - len(batches) % self.world_size if self.world_size > 1 else len(batches)
        return batches[self.rank : usable : self.world_size]

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._batches()
        if self.resume is not None and self.resume["epoch"] == self.epoch:  # mid-epoch restart
            batches = batches[self.resume["batches_done"]:]
        self.resume = None
        return iter(batches)

    def __len__(self) -> int:
        return len(self._batches())


PAD_MULTIPLE = 64  # a batch's width is a multiple of this: see `pad_collate`


def pad_collate(items: list[dict[str, Any]], multiple: int = 1) -> dict[str, Any]:
    """Right-pad records to the longest in the batch, rounded up to a multiple of `multiple`.

    The rounding keeps a training step's products to a few shapes: on a CPU oneDNN builds a kernel for
    each new shape it meets, which costs several times the product itself (benchmarks/step_shapes.py)."""
    lengths = [len(it["input_ids"]) for it in items]
    b, t = len(items), -(-max(lengths) // multiple) * multiple
    out: dict[str, Any] = {
        "input_ids": torch.zeros((b, t), dtype=torch.long),
        "attention_mask": torch.zeros((b, t), dtype=torch.bool),
        "loss_mask": torch.zeros((b, t), dtype=torch.bool),
        "ids": [it["id"] for it in items],
    }
    for key in ("final", "aux"):
        if key in items[0]:
            out[key] = torch.zeros((b, t, items[0][key].shape[-1]), dtype=items[0][key].dtype)
    for row, (it, n) in enumerate(zip(items, lengths)):
        out["input_ids"][row, :n] = it["input_ids"]
        out["attention_mask"][row, :n] = True
        out["loss_mask"][row, :n] = it["loss_mask"]
        for key in ("final", "aux"):
            if key in it:
                out[key][row, :n] = it[key]
    return out


@runtime_checkable
class ChecksTarget(Protocol):
    """A datamodule that refuses data made for another target than the drafter's (draftsmith's own)."""

    def check_compatible(self, identity: dict[str, Any], aux_layer_ids: list[int]) -> None: ...


@runtime_checkable
class ReadsFeatureLayers(Protocol):
    """A LightningModule that names the target layers its drafter fuses (draftsmith's drafter modules), so that
    the `draftsmith extract` command a datamodule prints for missing features extracts them."""

    def feature_layer_ids(self) -> list[int]: ...


def check_datamodule(trainer: Any, identity: dict[str, Any], aux_layer_ids: list[int]) -> None:
    """Refuse the trainer's datamodule where it holds another target's data; a user's own module, which
    cannot tell, passes."""
    data = getattr(trainer, "datamodule", None)
    if isinstance(data, ChecksTarget):
        data.check_compatible(identity, aux_layer_ids)


class _LengthBatched(pl.LightningDataModule):
    """Shared loaders: length-bucketed batches over `self.dataset` split into train/val indices."""

    online = False
    _train_sampler: LengthBatchSampler | None = None

    def state_dict(self) -> dict[str, int]:
        """Where training stands in the epoch, so that a mid-epoch resume skips the batches done."""
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return {}
        return {"epoch": trainer.current_epoch,
                "batches_done": trainer.fit_loop.epoch_loop.batch_progress.current.ready}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume = dict(state) if state else None
        if self._train_sampler is not None:
            self._train_sampler.resume = self._resume

    def _split(self, ids: list[str]) -> None:
        splits = np.array([split_of(i, self.val_fraction) for i in ids])
        self.train_indices = np.flatnonzero(splits == "train")
        self.val_indices = np.flatnonzero(splits == "val")
        if len(self.train_indices) == 0:
            raise DraftsmithError(f"no training records ({len(ids)} in all, val_fraction {self.val_fraction})")

    def _loader(self, indices: np.ndarray, shuffle: bool) -> torch.utils.data.DataLoader:
        trainer = getattr(self, "trainer", None)
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        sampler = LengthBatchSampler(self.lengths, indices, self.max_tokens, self.max_batch_size,
                                     shuffle=shuffle, seed=self.seed, rank=rank, world_size=world,
                                     multiple=PAD_MULTIPLE)
        return torch.utils.data.DataLoader(self.dataset, batch_sampler=sampler,
                                           collate_fn=functools.partial(pad_collate, multiple=PAD_MULTIPLE),
                                           num_workers=self.num_workers,
                                           persistent_workers=self.num_workers > 0)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        loader = self._loader(self.train_indices, shuffle=True)
        self._train_sampler = loader.batch_sampler
        self._train_sampler.resume = getattr(self, "_resume", None)
        return loader

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return self._loader(self.val_indices, shuffle=False)


class FeatureDataModule(_LengthBatched):
    """Offline features: reads the shards written by `draftsmith extract`.

    Args:
        features_dir: the directory `draftsmith extract --out` wrote.
        layer_ids: hidden-state layers (besides the final one) the features must hold; loaded as `aux`
            unless a drafter names the layers it fuses. `draftsmith run` extracts them, so recipes
            sharing a directory can each ask for the layers all of them need.
        val_fraction: share of conversations (by id hash) held out for validation.
        max_tokens: padded tokens per batch (B * T, T a multiple of 64).
        max_batch_size: records per batch at most.
        num_workers: DataLoader worker processes.
        seed: shuffling seed (the batch order changes every epoch).
        target: the target, for the `draftsmith extract` hint when no features exist yet.
        data: the chat source, for that hint.
        max_length: the max length, for that hint.
        limit: the conversation limit, for that hint.
        chat_template: the target's chat template, for that hint (the CLI links it from the model's).
        template_kwargs: the variables set in it, for that hint (the CLI links them from the model's).
        mix: more feature directories of the same target and layers trained on beside `features_dir`, each
            with the share of its training records an epoch draws (`weight`, 1.0 = each once, as
            `features_dir`'s) and the epoch it joins from (`from_epoch`: a length curriculum), e.g. packed
            long chats beside short ones (docs/training.md, Long contexts). Validation reads every
            directory's held-out records once.
    """

    def __init__(self, features_dir: str, layer_ids: list[int] | None = None, val_fraction: float = VAL_FRACTION,
                 max_tokens: int = 16384, max_batch_size: int = 64, num_workers: int = 0, seed: int = 0,
                 target: str | None = None, data: str = "sharegpt", max_length: int = 2048, limit: int | None = None,
                 chat_template: str | None = None, template_kwargs: dict[str, Any] | None = None,
                 mix: list[MixedFeatures] | None = None):
        super().__init__()
        self.features_dir, self.layer_ids = features_dir, list(layer_ids or [])
        self.mix = [MixedFeatures(**m) if isinstance(m, dict) else m for m in mix or []]
        for m in self.mix:
            m.check()
        self.val_fraction, self.max_tokens, self.max_batch_size = val_fraction, max_tokens, max_batch_size
        self.num_workers, self.seed = num_workers, seed
        self.hint = dict(target=target, data=data, max_length=max_length, limit=limit, chat_template=chat_template,
                         template_kwargs=template_kwargs)
        self.reader: FeatureReader | None = None

    def extract_command(self, layer_ids: list[int] | None = None) -> str:
        h = self.hint
        cmd = (f"draftsmith extract --target {h['target'] or 'TARGET'} --data {h['data']} "
               f"--out {self.features_dir} --max_length {h['max_length']}")
        if h["limit"] is not None:
            cmd += f" --limit {h['limit']}"
        if h["chat_template"] is not None:
            cmd += f" --chat_template {h['chat_template']}"
        if h["template_kwargs"]:
            cmd += f" --template_kwargs '{json.dumps(h['template_kwargs'])}'"
        ids = layer_ids if layer_ids is not None else self.layer_ids
        return cmd + (f" --layer_ids [{','.join(map(str, ids))}]" if ids else "")

    def setup(self, stage: str | None = None) -> None:
        if self.reader is not None:
            return
        try:
            read_manifest(self.features_dir)
        except DraftsmithError as e:
            module = getattr(getattr(self, "trainer", None), "lightning_module", None)
            layers = self.layer_ids or (module.feature_layer_ids() if isinstance(module, ReadsFeatureLayers) else [])
            raise DraftsmithError(f"{e}\nmake the features with:\n  {self.extract_command(layers)}") from None
        self.reader = FeatureReader(self.features_dir, self.layer_ids)
        self.readers = [self.reader] + [FeatureReader(m.features_dir, self.layer_ids) for m in self.mix]
        self.dataset = self.reader if not self.mix else Directories(self.readers)
        self.lengths = np.concatenate([r.lengths for r in self.readers])
        self._split(self.dataset.ids)
        if self.mix:
            starts = np.cumsum([0] + [len(r) for r in self.readers])
            groups = [(1.0, 0)] + [(m.weight, m.from_epoch) for m in self.mix]
            self.train_indices = Mix([(self.train_indices[(self.train_indices >= a) & (self.train_indices < b)], w, e)
                                      for a, b, (w, e) in zip(starts[:-1], starts[1:], groups)])

    def check_compatible(self, identity: dict[str, Any], aux_layer_ids: list[int]) -> None:
        """Refuse features from another target; load the aux layers the drafter fuses."""
        for directory, reader in zip([self.features_dir] + [m.features_dir for m in self.mix], self.readers):
            manifest = reader.manifest
            diffs = identity_differences(manifest["target"], identity, "in the features", "for the drafter")
            if diffs:
                raise DraftsmithError(
                    f"features in {directory} come from another target ({'; '.join(diffs)}); "
                    f"re-extract them for this target:\n  {self.extract_command(aux_layer_ids)}"
                )
            missing = [i for i in aux_layer_ids if i not in manifest["layer_ids"]]
            if missing:
                raise DraftsmithError(
                    f"features in {directory} hold layers {manifest['layer_ids']}, the drafter fuses "
                    f"{aux_layer_ids} (missing {missing}); re-extract:\n  {self.extract_command(aux_layer_ids)}"
                )
        for reader in self.readers:
            reader.layer_ids = list(aux_layer_ids)

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each token id is an assistant token in the training split (of every directory), (V,)."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        train = self.train_indices
        train = set((np.concatenate([g[0] for g in train.groups]) if isinstance(train, Mix) else train).tolist())
        start = 0
        for reader in self.readers:
            for s in range(len(reader.manifest["shards"])):
                f = reader._file(s)
                ids, mask = f.get_tensor("input_ids").long(), f.get_tensor("loss_mask").bool()
                offsets = f.get_tensor("offsets")
                keep = torch.zeros_like(mask)
                for r in range(len(offsets) - 1):
                    if start + r in train:
                        keep[offsets[r]:offsets[r + 1]] = True
                start += len(offsets) - 1
                counts += torch.bincount(ids[mask & keep], minlength=vocab_size)[:vocab_size]
        return counts


class ChatDataModule(_LengthBatched):
    """Online features: tokenized chats; the frozen target runs inside the training step.

    Args:
        target: the target whose tokenizer and chat template to use.
        data: the chat source (as for `draftsmith data stats`).
        max_length: tokens per chat.
        limit: use only the first LIMIT kept conversations.
        val_fraction: share of conversations (by id hash) held out for validation.
        max_tokens: padded tokens per batch (B * T, T a multiple of 64).
        max_batch_size: records per batch at most.
        num_workers: DataLoader worker processes.
        seed: shuffling seed.
        chat_template: the chat template in place of the tokenizer's own (the CLI links it from the model's).
        template_kwargs: the variables set in it (the CLI links them from the model's).
    """

    online = True

    def __init__(self, target: str, data: str = "sharegpt", max_length: int = 2048, limit: int | None = None,
                 val_fraction: float = VAL_FRACTION, max_tokens: int = 16384, max_batch_size: int = 64,
                 num_workers: int = 0, seed: int = 0, chat_template: str | None = None,
                 template_kwargs: dict[str, Any] | None = None):
        super().__init__()
        self.target, self.data, self.max_length, self.limit = target, data, max_length, limit
        self.chat_template, self.template_kwargs = chat_template, template_kwargs
        self.val_fraction, self.max_tokens, self.max_batch_size = val_fraction, max_tokens, max_batch_size
        self.num_workers, self.seed = num_workers, seed
        self.dataset = None

    def setup(self, stage: str | None = None) -> None:
        if self.dataset is not None:
            return
        from collections import Counter

        from draftsmith.data.chat import MaskAudit, tokenize_many
        from draftsmith.models.tokenizer import tokenizer_hash
        from draftsmith.data.conversations import load_conversations
        from draftsmith.models.target import load_tokenizer

        tokenizer = load_tokenizer(self.target, chat_template=self.chat_template, template_kwargs=self.template_kwargs)
        self.tokenizer_hash = tokenizer_hash(tokenizer)
        convs, _ = load_conversations(self.data, limit=self.limit)
        audit = MaskAudit()
        chats = tokenize_many(tokenizer, convs, self.max_length, Counter(), Counter(), audit)
        audit.check(self.data)
        self.dataset = [{"id": c.id, "input_ids": torch.tensor(c.input_ids), "loss_mask": torch.tensor(c.loss_mask).bool()}
                        for c in chats]
        self.lengths = np.array([len(c.input_ids) for c in chats])
        self._split([c.id for c in chats])

    def check_compatible(self, identity: dict[str, Any], aux_layer_ids: list[int]) -> None:
        if identity["tokenizer_hash"] != self.tokenizer_hash:
            raise DraftsmithError(f"tokenizer of {self.target} (hash {self.tokenizer_hash}) differs from the "
                                  f"drafter's target ({identity['tokenizer_hash']}); use the same target for both")

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for i in self.train_indices:
            item = self.dataset[i]
            counts += torch.bincount(item["input_ids"][item["loss_mask"]], minlength=vocab_size)[:vocab_size]
        return counts
