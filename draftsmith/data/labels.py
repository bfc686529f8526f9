"""Label shards: the rows `draftsmith labels` writes and the stop heads train on (`data/shards.py`'s
format; the fields are listed in `jobs/labels.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftsmith.data import shards

LABELS_FORMAT = "draftsmith-labels/1"
PREFIX = "labels"
ROW_FIELDS = ("anchor", "depth", "hidden", "top_probs", "entropy", "token_greedy", "token_sampled", "q_greedy",
              "q_sampled", "p_greedy", "p_sampled", "target_argmax", "soft", "hard", "reached")


def shard_name(part: int) -> str:
    return shards.shard_name(PREFIX, part)


def write_label_shard(out: Path, part: int, chats: list[tuple[str, dict[str, torch.Tensor]]], meta: dict[str, Any],
                      hidden_dtype: torch.dtype) -> None:
    """One shard, written under a temporary name and renamed when whole."""
    rows = [r for _, r in chats]
    counts = [len(r["depth"]) for r in rows]
    tensors = {"offsets": shards.offsets(counts)}
    types = {"hidden": hidden_dtype, "top_probs": torch.float32, "entropy": torch.float32, "anchor": torch.int32,
             "depth": torch.uint8, "token_greedy": torch.int32, "token_sampled": torch.int32, "target_argmax": torch.int32,
             "hard": torch.uint8, "reached": torch.uint8}
    for name in ROW_FIELDS:
        dtype = types.get(name, torch.float32)
        tensors[name] = torch.cat([r[name].to(dtype) for r in rows]).contiguous() if rows else torch.zeros(0, dtype=dtype)
    meta = {**meta, "part": part, "ids": [i for i, _ in chats], "num_rows": sum(counts)}
    shards.write_shard(out / shard_name(part), tensors, meta)


def read_labels(directory: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], list[str], torch.Tensor]:
    """(run description, rows {field: (N, ...)}, chat ids, chat of each row (N,)) of a finished label directory."""
    directory = Path(directory)
    manifest = shards.read_manifest(directory, "label", "labelling has not finished: rerun `draftsmith labels` with the "
                                    "same options", "no labels here: make them with `draftsmith labels`")
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ROW_FIELDS}
    ids: list[str] = []
    chat_of: list[torch.Tensor] = []
    for name in manifest["shards"]:
        meta, tensors = shards.read_shard(directory / name, ("offsets", *ROW_FIELDS))
        for k in ROW_FIELDS:
            parts[k].append(tensors[k])
        chat_of.append(torch.repeat_interleave(torch.arange(len(ids), len(ids) + len(meta["ids"])),
                                               tensors["offsets"].diff()))
        ids += meta["ids"]
    rows = {k: torch.cat(v) for k, v in parts.items()}
    return manifest["run"], rows, ids, torch.cat(chat_of) if chat_of else torch.zeros(0, dtype=torch.long)


def label_manifest(out: Path, num_parts: int, run: dict[str, Any]) -> dict[str, Any]:
    """Totals over the shards, with the labelled acceptance by depth (a drafter's α_j on this data)."""
    chats, hard, soft, reached, total = 0, None, None, None, None
    for p in range(num_parts):
        meta, rows = shards.read_shard(out / shard_name(p), ("depth", "hard", "soft", "reached"))
        chats += len(meta["ids"])
        depth = rows["depth"].long() - 1
        add = lambda x: torch.zeros(run["k"], dtype=torch.float64).index_add_(0, depth, x.double())  # noqa: E731
        h, s, r, n = add(rows["hard"]), add(rows["soft"]), add(rows["reached"]), add(torch.ones(len(depth)))
        hard, soft, reached, total = (h, s, r, n) if hard is None else (hard + h, soft + s, reached + r, total + n)
    n = total.clamp_min(1)
    return {"run": run, "shards": [shard_name(p) for p in range(num_parts)], "num_chats": chats,
            "num_rows": int(total.sum()) if total is not None else 0,
            "by_depth": {"rows": total.long().tolist(), "hard": (hard / n).tolist(), "soft": (soft / n).tolist(),
                         "reached": (reached / n).tolist()}}
