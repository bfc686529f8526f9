"""Training on several feature directories at once: which records an epoch draws from each (`Mix`), and the
entries of a FeatureDataModule's `mix` (`MixedFeatures`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from draftsmith import DraftsmithError
from draftsmith.data.features import FeatureReader
from draftsmith.options import ChatOptions


class Mix:
    """Which training records an epoch draws from several feature directories.

    `groups`: one (indices, weight, from_epoch) per directory. An epoch draws each record of a group
    `floor(weight)` times, and a share `weight - floor(weight)` of them once more (another random share
    every epoch); a group is left out before its `from_epoch` (a length curriculum)."""

    def __init__(self, groups: list[tuple[np.ndarray, float, int]]):
        self.groups = [(np.asarray(i), float(w), int(e)) for i, w, e in groups]

    def draw(self, epoch: int, rng: np.random.Generator) -> np.ndarray:
        drawn = []
        for indices, weight, from_epoch in self.groups:
            if epoch < from_epoch:
                continue
            whole, part = divmod(weight, 1.0)
            drawn += [indices] * int(whole)
            if part:
                drawn.append(rng.choice(indices, size=round(part * len(indices)), replace=False))
        if not drawn:
            raise DraftsmithError(f"epoch {epoch} draws no record: every feature directory joins later")
        return np.concatenate(drawn)


class Directories(torch.utils.data.ConcatDataset):
    """Several feature directories' records as one dataset, their ids in the same order."""

    def __init__(self, readers: list[FeatureReader]):
        super().__init__(readers)
        self.ids = [i for r in readers for i in r.ids]


@dataclass(kw_only=True)
class MixedFeatures(ChatOptions):
    """A feature directory trained on beside a FeatureDataModule's own (its `mix`).

    Args:
        features_dir: the directory `draftsmith extract --out` wrote (the same target and layers).
        weight: the share of its training records an epoch draws (1.0: each once; 2.0: each twice).
        from_epoch: the first epoch that draws from it (0: from the start).
        data: the chat source `draftsmith run` extracts it from when it is missing.
        limit: the conversation limit of that extraction.
        max_length: its max length.
        pack: its packing (`extract --pack`; 0: each chat alone).
    """

    features_dir: str
    weight: float = 1.0
    from_epoch: int = 0
    data: str = "sharegpt"  # limit and max_length: ChatOptions'
    pack: int = 0

    def check(self) -> None:
        if not self.weight > 0 or self.from_epoch < 0:
            raise DraftsmithError(f"data.mix: {self.features_dir} has weight {self.weight} and from_epoch "
                                  f"{self.from_epoch}; a weight must be > 0 and from_epoch >= 0")
