"""Feature shards on disk: an atomic writer and a memory-mapped random-access reader.

A feature directory holds:
- `run.json`: what every shard in it was made with (target identity, layer ids, dtypes,
  data source, max length, shard size); written first, checked by every later writer;
- `shard-NNNNNN.safetensors`: the records of one fixed slice of the conversations,
  tensors concatenated over records (N tokens, R records):
    input_ids int32 (N,), loss_mask uint8 (N,), offsets int64 (R+1,),
    final (N, H) the post-norm last hidden state, layer.<i> (N, H) for each extra layer id;
  its metadata "draftsmith" holds the record ids and the slice's skip counts;
- `manifest.json`: the totals, written when every shard exists.

Shards are written and read as `data/shards.py` defines for every shard directory: atomically,
so a crash leaves a whole shard or none and rerunning skips the shards that exist.
"""

from __future__ import annotations

import json
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from draftsmith import DraftsmithError
from draftsmith.data import shards
from draftsmith.data.shards import MANIFEST_FILE, RUN_FILE, run_mismatch, shard_meta
from draftsmith.files import write_json_atomic

FORMAT = "draftsmith-features/1"
PREFIX = "shard"


def shard_name(part: int) -> str:
    return shards.shard_name(PREFIX, part)


def write_shard(out: Path, part: int, records: list[dict[str, Any]], meta: dict[str, Any],
                layer_ids: list[int], hidden_size: int, dtype: torch.dtype) -> Path:
    """Write one shard atomically. A record: id, input_ids, loss_mask, final (T, H), layers {i: (T, H)}."""
    lengths = [len(r["input_ids"]) for r in records]
    offsets = shards.offsets(lengths)

    def cat(get, width=None, dt=dtype):
        if not records:
            return torch.zeros((0, width) if width else (0,), dtype=dt)
        return torch.cat([get(r) for r in records]).to(dt).contiguous()

    tensors = {
        "input_ids": cat(lambda r: torch.as_tensor(r["input_ids"]), dt=torch.int32),
        "loss_mask": cat(lambda r: torch.as_tensor(r["loss_mask"]), dt=torch.uint8),
        "offsets": offsets,
        "final": cat(lambda r: r["final"], hidden_size),
    }
    for i in layer_ids:
        tensors[f"layer.{i}"] = cat(lambda r: r["layers"][i], hidden_size)
    meta = {**meta, "part": part, "num_records": len(records), "num_tokens": int(offsets[-1]),
            "num_loss_tokens": int(tensors["loss_mask"].sum()), "ids": [r["id"] for r in records]}
    return shards.write_shard(out / shard_name(part), tensors, meta)


def build_manifest(out: Path, num_parts: int, source_report: dict[str, Any] | None) -> dict[str, Any]:
    """Sum the shards into manifest.json; refuses when a shard is missing or made differently."""
    run = json.loads((out / RUN_FILE).read_text())
    missing = [p for p in range(num_parts) if not (out / shard_name(p)).exists()]
    if missing:
        raise DraftsmithError(f"{out}: {len(missing)} of {num_parts} shards missing (first: part {missing[0]}); rerun extract to finish")
    shards, skipped, truncated = [], Counter(), Counter()
    totals = Counter()
    for p in range(num_parts):
        meta = shard_meta(out / shard_name(p))
        diffs = run_mismatch(run, meta["run"], extendable=True)
        if diffs:
            raise DraftsmithError(f"{out / shard_name(p)} was made differently from {RUN_FILE}: {'; '.join(diffs)}")
        shards.append({"file": shard_name(p), "num_records": meta["num_records"], "num_tokens": meta["num_tokens"]})
        totals.update(num_records=meta["num_records"], num_tokens=meta["num_tokens"], num_loss_tokens=meta["num_loss_tokens"])
        skipped.update(meta["skipped"])
        truncated.update(meta["truncated"])
    manifest = {
        "format": FORMAT,
        **run,
        "num_records": totals["num_records"],
        "num_tokens": totals["num_tokens"],
        "num_loss_tokens": totals["num_loss_tokens"],
        "skipped": dict(sorted(skipped.items())),
        "truncated": dict(sorted(truncated.items())),
        "source_report": source_report,
        "shards": shards,
    }
    write_json_atomic(out / MANIFEST_FILE, manifest)
    return manifest


def read_manifest(directory: str | Path) -> dict[str, Any]:
    return shards.read_manifest(directory, "feature", "extraction has not finished: rerun the same `draftsmith extract` "
                                "command to resume", "run `draftsmith extract ... --out DIR` first")


class FeatureReader(torch.utils.data.Dataset):
    """Random access to records across shards, memory-mapped, with a bounded set of open files.

    `reader[i]` is a dict: id, input_ids (T,) int64, loss_mask (T,) bool, final (T, H) and,
    when `layer_ids` is given, aux (T, k*H): those layers concatenated in the order given.
    """

    def __init__(self, directory: str | Path, layer_ids: list[int] | None = None, max_open: int = 8):
        from safetensors import safe_open  # noqa: F401  (fail early if missing)

        self.directory = Path(directory)
        self.manifest = read_manifest(self.directory)
        stored = self.manifest["layer_ids"]
        self.layer_ids = list(layer_ids or [])
        absent = [i for i in self.layer_ids if i not in stored]
        if absent:
            raise DraftsmithError(
                f"{self.directory} has no hidden states for layer ids {absent} (it stores {stored}); "
                f"re-extract with --layer_ids {sorted(set(stored) | set(self.layer_ids))}"
            )
        self.max_open = max_open
        self._open: OrderedDict[int, Any] = OrderedDict()
        lengths, shard_of, local, ids = [], [], [], []
        self._offsets = []
        for s, shard in enumerate(self.manifest["shards"]):
            offsets = self._file(s).get_tensor("offsets")
            meta = json.loads(self._file(s).metadata()["draftsmith"])
            self._offsets.append(offsets)
            n = len(offsets) - 1
            lengths.append((offsets[1:] - offsets[:-1]).numpy())
            shard_of.append(np.full(n, s, dtype=np.int32))
            local.append(np.arange(n, dtype=np.int32))
            ids.extend(meta["ids"])
        self.lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
        self._shard_of = np.concatenate(shard_of) if shard_of else np.zeros(0, dtype=np.int32)
        self._local = np.concatenate(local) if local else np.zeros(0, dtype=np.int32)
        self.ids = ids
        self._open.clear()

    def __len__(self) -> int:
        return len(self.lengths)

    def _file(self, s: int) -> Any:
        from safetensors import safe_open

        if s in self._open:
            self._open.move_to_end(s)
            return self._open[s]
        handle = safe_open(str(self.directory / self.manifest["shards"][s]["file"]), framework="pt")
        self._open[s] = handle
        while len(self._open) > self.max_open:
            self._open.popitem(last=False)
        return handle

    def __getitem__(self, index: int) -> dict[str, Any]:
        s, r = int(self._shard_of[index]), int(self._local[index])
        a, b = int(self._offsets[s][r]), int(self._offsets[s][r + 1])
        f = self._file(s)
        item = {
            "id": self.ids[index],
            "input_ids": f.get_slice("input_ids")[a:b].long(),
            "loss_mask": f.get_slice("loss_mask")[a:b].bool(),
            "final": f.get_slice("final")[a:b],
        }
        if self.layer_ids:
            item["aux"] = torch.cat([f.get_slice(f"layer.{i}")[a:b] for i in self.layer_ids], dim=-1)
        return item

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers reopen files themselves
        state = self.__dict__.copy()
        state["_open"] = OrderedDict()
        return state
