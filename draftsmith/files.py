"""Files written whole or not at all: a reader never sees half a shard, manifest or export; and the
lines of a JSON Lines file.

Each writer writes under a temporary name in the same directory and renames it into place
(`os.replace` is atomic on one filesystem); a crash leaves the old file or none, and a
`.NAME.tmp.PID` that the next run may delete.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """`with atomic_path(p) as tmp:` write the file tmp; it becomes `p` when the block ends without an
    exception, and is removed otherwise."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json_atomic(path: str | Path, obj: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def save_tensors_atomic(tensors: dict[str, Any], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' `save_file`, atomically."""
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)


def json_lines(text: str) -> list[str]:
    """The lines of a JSON Lines text, each with its "\n" (the last may lack one). A JSON line ends at
    "\n" only: a string inside a record may hold U+2028, U+0085 or a form feed, where `str.splitlines`
    would cut the record in two."""
    lines = text.split("\n")
    return [line + "\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])
