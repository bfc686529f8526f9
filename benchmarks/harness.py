"""What every benchmark shares: its command line, arms measured side by side, medians, the RESULT line.

Each script in this folder measures its arms in one process, alternating them so that a busy neighbour
or a warming CPU weighs on every arm alike, and ends with one line `RESULT key=value ...` that scripts
read. Run one as `python benchmarks/NAME.py` (this folder is then on the import path).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class _Parser(argparse.ArgumentParser):
    """Options spelled as draftsmith's commands spell them, `--max_new_tokens`; `--max-new-tokens` is taken too,
    as the command line takes it (up to a bare `--`, after which arguments are another program's)."""

    def parse_known_args(self, args=None, namespace=None):
        import sys

        args = list(sys.argv[1:] if args is None else args)
        end = args.index("--") if "--" in args else len(args)
        for i, arg in enumerate(args[:end]):
            if arg.startswith("--"):
                name, eq, value = arg.partition("=")
                args[i] = "--" + name[2:].replace("-", "_") + eq + value
        return super().parse_known_args(args, namespace)


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's command line, its module docstring as the help."""
    return _Parser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def synchronize() -> None:
    """Wait for a GPU's queued work, so that a timer measures it (nothing on a CPU)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_ms(fn: Callable[[], Any], repeats: int, warmup: int = 3) -> float:
    """The median of `repeats` timed calls of fn after `warmup` untimed ones, in milliseconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def alternate(arms: dict[str, Callable[[], T]], passes: int) -> dict[str, list[T]]:
    """Each arm's results over `passes` passes, the arms run in turn within a pass and the order rotated
    from pass to pass (no arm always runs first, on a cold or a warm machine)."""
    names, out = list(arms), {name: [] for name in arms}
    for p in range(passes):
        for name in names[p % len(names):] + names[: p % len(names)]:
            out[name].append(arms[name]())
    return out


def medians(results: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in results.items()}


def machine() -> str:
    """The processor and torch build a figure came from (benchmarks.md names them with every row)."""
    import torch

    from draftsmith.eval.machine import cpu_model

    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{cpu_model()}{gpu}, torch {torch.__version__}"


def kept_arm(done: Path, record: Path, recipe_file: Path, /, options: dict[str, Any] | None = None,
             **settings: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """An arm trained earlier (its checkpoint `done`, its `record` json) and what defines it: `settings` (which
    may name the recipe too) and the recipe file's contents, so that an edited recipe trains again instead of
    reusing stale weights; with `options` (the hyper-parameters of the module the arm's recipe and overrides
    build now), also the options the code gives that module (`changed_options`).
    Returns (key, the record if its key is this one, else None); write the key into the record."""
    key = {**settings, "recipe_sha256": hashlib.sha256(Path(recipe_file).read_bytes()).hexdigest()}
    kept = json.loads(record.read_text()) if record.is_file() and done.is_file() else {}
    if kept.get("key") != key:
        return key, None
    changed = changed_options(done, options) if options is not None else []
    if changed:
        print(f"{done}: trained with other options than this code's ({', '.join(changed)}): training it again",
              flush=True)
        return key, None
    return key, kept


def changed_options(done: Path, options: dict[str, Any]) -> list[str]:
    """The hyper-parameters of the module that wrote checkpoint `done` that differ from `options` (the module
    the same recipe and overrides build now): an option added, removed or given a new default by the code
    since, which the recipe's contents do not show. Empty: the kept weights are this code's arm."""
    from draftsmith.train.checkpoints import checkpoint_state

    kept = checkpoint_state(done).get("hyper_parameters", {})
    names = {k for k in [*kept, *options] if not k.startswith("_")}
    return sorted(k for k in names if k not in kept or k not in options or repr(kept[k]) != repr(options[k]))


def newest_train_log(root: Path) -> Path:
    """The `train.log` of the newest run `draftsmith fit` made under `--trainer.default_root_dir` `root`."""
    return max(root.glob("logs/version_*/train.log"), key=lambda p: p.stat().st_mtime)


def clock_seconds(clock: str) -> int:
    """Seconds of a `train.log` clock as `draftsmith fit` writes it: "M:SS" or "H:MM:SS"."""
    seconds = 0
    for part in clock.split(":"):
        seconds = seconds * 60 + int(part)
    return seconds


def result_line(keys: dict[str, Any] | str) -> str:
    """`RESULT key=value ...` from a dict (values as the caller formatted them) or a ready "k=v ..." string."""
    return "RESULT " + (keys if isinstance(keys, str) else " ".join(f"{k}={v}" for k, v in keys.items()))


def print_result(keys: dict[str, Any] | str) -> None:
    """The machine the figures came from, then the RESULT line."""
    print(f"machine: {machine()}")
    print(result_line(keys))
