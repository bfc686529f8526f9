"""LightningDataModules over feature shards: length-bucketed batches, split by conversation id.

Batch keys (B batch, T longest record in the batch, H hidden, k extra layers):
input_ids (B, T) long, attention_mask (B, T) bool, loss_mask (B, T) bool,
final (B, T, H), aux (B, T, k*H) when layer ids are asked for, ids (list of str).
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import pytorch_lightning as pl
import torch

from draftsmith.data.conversations import split_of
from draftsmith.data.features import FeatureReader


class LengthBatchSampler(torch.utils.data.Sampler):
    """Batches of similar length within a padded-token budget, reshuffled every epoch.

    With `world_size` > 1 each rank takes every world_size-th batch of the same shuffled
    order, truncated so that all ranks run the same number of steps.
    """

    def __init__(self, lengths: np.ndarray, indices: np.ndarray, max_tokens: int, max_batch_size: int,
                 shuffle: bool, seed: int = 0, rank: int = 0, world_size: int = 1):
        self.lengths, self.indices = np.asarray(lengths), np.asarray(indices)
        self.max_tokens, self.max_batch_size = max_tokens, max_batch_size
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self.rank, self.world_size = rank, world_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self) -> list[list[int]]:
        rng = np.random.default_rng(self.seed + self.epoch)
        order = rng.permutation(self.indices) if self.shuffle else self.indices.copy()
        order = order[np.argsort(-self.lengths[order], kind="stable")]
        batches, current = [], []
        for i in order.tolist():
            width = self.lengths[current[0]] if current else self.lengths[i]
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
        return iter(self._batches())

    def __len__(self) -> int:
        return len(self._batches())


def pad_collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Right-pad records to the longest in the batch."""
    lengths = [len(it["input_ids"]) for it in items]
    b, t = len(items), max(lengths)
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


class FeatureDataModule(pl.LightningDataModule):
    """Offline features: reads the shards written by `draftsmith extract`.

    Args:
        features_dir: the directory `draftsmith extract --out` wrote.
        layer_ids: extra hidden states to load as `aux` (must have been extracted).
        val_fraction: share of conversations (by id hash) held out for validation.
        max_tokens: padded tokens per batch (B * T).
        max_batch_size: records per batch at most.
        num_workers: DataLoader worker processes.
        seed: shuffling seed (the batch order changes every epoch).
    """

    def __init__(self, features_dir: str, layer_ids: list[int] | None = None, val_fraction: float = 0.05,
                 max_tokens: int = 16384, max_batch_size: int = 64, num_workers: int = 0, seed: int = 0):
        super().__init__()
        self.features_dir, self.layer_ids = features_dir, list(layer_ids or [])
        self.val_fraction, self.max_tokens, self.max_batch_size = val_fraction, max_tokens, max_batch_size
        self.num_workers, self.seed = num_workers, seed
        self.reader: FeatureReader | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.reader is not None:
            return
        self.reader = FeatureReader(self.features_dir, self.layer_ids)
        splits = np.array([split_of(i, self.val_fraction) for i in self.reader.ids])
        self.train_indices = np.flatnonzero(splits == "train")
        self.val_indices = np.flatnonzero(splits == "val")

    def _loader(self, indices: np.ndarray, shuffle: bool) -> torch.utils.data.DataLoader:
        trainer = getattr(self, "trainer", None)
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        sampler = LengthBatchSampler(self.reader.lengths, indices, self.max_tokens, self.max_batch_size,
                                     shuffle=shuffle, seed=self.seed, rank=rank, world_size=world)
        return torch.utils.data.DataLoader(self.reader, batch_sampler=sampler, collate_fn=pad_collate,
                                           num_workers=self.num_workers,
                                           persistent_workers=self.num_workers > 0)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return self._loader(self.train_indices, shuffle=True)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return self._loader(self.val_indices, shuffle=False)
