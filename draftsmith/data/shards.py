"""The one shard format features and labels share: a directory of safetensors shards.

A shard directory holds:
- `run.json`: what every shard in it is made with, written by the first run and checked by
  every later one (`claim_directory`), so shards made differently never mix (where a directory is
  `extendable`, a run may take more or fewer of the same source's conversations: the first N of a
  source are a prefix of its first M > N, and each part is one fixed slice of them);
- `<prefix>-NNNNNN.safetensors`: one fixed slice of the conversations, tensors concatenated
  over its records with `offsets` (R+1,) marking each record's rows; its metadata "draftsmith"
  holds the record ids and what the slice skipped;
- `manifest.json`: the totals, written once every shard exists.

Shards are written atomically (`draftsmith.files`), so a crash leaves a whole shard or none and
a rerun resumes after the shards that exist.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from draftsmith import DraftsmithError
from draftsmith.files import save_tensors_atomic, write_json_atomic

RUN_FILE, MANIFEST_FILE = "run.json", "manifest.json"


def shard_name(prefix: str, part: int) -> str:
    return f"{prefix}-{part:06d}.safetensors"


def offsets(counts: list[int]) -> torch.Tensor:
    """(R+1,) int64 start rows of R records of `counts` rows each."""
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.tensor(counts, dtype=torch.int64).cumsum(0)])


def write_shard(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    """Write one shard atomically, `meta` (JSON) in its metadata."""
    save_tensors_atomic({k: v.contiguous() for k, v in tensors.items()}, path, metadata={"draftsmith": json.dumps(meta)})
    return path


def read_shard(path: Path, names: Iterable[str] = ()) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A shard's metadata and its tensors `names`."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["draftsmith"]), {k: f.get_tensor(k) for k in names}


def shard_meta(path: Path) -> dict[str, Any]:
    return read_shard(path)[0]


def remove_stale(out: Path, prefix: str, owns: Callable[[int], bool] = lambda part: True) -> None:
    """Delete the temporary files a killed run left of the parts this writer `owns` (each part has one
    writer at a time)."""
    for stale in out.glob(f".{prefix}-*.tmp.*"):
        if owns(int(stale.name[len(prefix) + 2:].split(".")[0])):
            stale.unlink(missing_ok=True)


SOURCE_EXTENT = ("limit", "num_conversations")  # how many of a source's conversations a run takes


def comparable_run(run: dict[str, Any], extendable: bool = False) -> dict[str, Any]:
    """The part of a run description that must agree for shards to mix (not the target's name; where
    `extendable`, not how many of the source's conversations the run takes)."""
    out = {k: v for k, v in run.items() if k != "target"}
    out["target"] = {k: v for k, v in run["target"].items() if k != "name"}
    if extendable and isinstance(out.get("data"), dict):
        out["data"] = {k: v for k, v in out["data"].items() if k not in SOURCE_EXTENT}
    return out


def run_mismatch(mine: dict[str, Any], theirs: dict[str, Any], extendable: bool = False) -> list[str]:
    from draftsmith.models.target import identity_differences

    a, b = comparable_run(mine, extendable), comparable_run(theirs, extendable)
    diffs = [f"target.{d}" for d in identity_differences(b["target"], a["target"], ignore=())]
    diffs += [f"{k}: {b.get(k)!r} there, {a[k]!r} here" for k in a if k != "target" and a[k] != b.get(k)]
    return diffs


def recorded(out: Path, key: str) -> Any:
    """What an earlier run into `out` recorded under `key` in its run record (None: no run there yet)."""
    path = out / RUN_FILE
    return json.loads(path.read_text()).get(key) if path.is_file() else None


def claim_directory(out: Path, run: dict[str, Any], what: str, extendable: bool = False) -> None:
    """Create `out` for this run, or check that the `what` (features, labels) already there were made the
    same way; `extendable`: from more or fewer of the same source's conversations too (run.json then
    records this run's)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / RUN_FILE
    if not path.exists():
        write_json_atomic(path, run)
        return
    old = json.loads(path.read_text())
    diffs = run_mismatch(run, old, extendable)
    if diffs:
        raise DraftsmithError(
            f"{out} holds {what} made differently ({'; '.join(diffs)}); "
            "refusing to mix them: choose another --out, or delete that directory to start over"
        )
    if old.get("data") != run.get("data"):  # extended (or cut): unfinished until its manifest is rebuilt
        (out / MANIFEST_FILE).unlink(missing_ok=True)
        write_json_atomic(path, run)


def read_manifest(directory: str | Path, what: str, unfinished: str, missing: str) -> dict[str, Any]:
    """manifest.json of a finished shard directory of `what`; the error says `unfinished` where a run
    started there and has not finished, `missing` where none did."""
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        hint = unfinished if (Path(directory) / RUN_FILE).exists() else missing
        raise DraftsmithError(f"no {what} manifest at {path}: {hint}")
    return json.loads(path.read_text())
