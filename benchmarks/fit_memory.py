"""Peak memory and step time of `draftsmith fit` with and without handing freed memory back.

`draftsmith fit` adds `ReleaseFreedMemory` (`train/trainer.py`: glibc's `malloc_trim` every 10 steps and
after each validation). The arm `kept` runs the same recipe with that callback removed; the arm
`mapped` instead has glibc serve every block of 64 KiB or more by its own mapping (`M_MMAP_THRESHOLD`),
the other way to bound the heap. Each arm is its own process (its peak resident memory from the kernel's
rusage of that process); the arms alternate over `--passes`. Ends with

    RESULT peak_gib_<arm>=... s_per_step_<arm>=... step_time_ratio_<arm>=<÷ kept's> ...

    python benchmarks/fit_memory.py --steps 120 --arms kept released
"""

from __future__ import annotations

import itertools
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import alternate, clock_seconds, newest_train_log, parser, print_result

ROOT = Path(__file__).resolve().parent.parent
FIT = """
import ctypes, sys
arm = sys.argv.pop(1)
if arm == "mapped":
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
from draftsmith.train.cli import lightning_cli
from draftsmith.train.trainer import ReleaseFreedMemory
cli = lightning_cli(sys.argv[1:], run=False)
if arm != "released":
    cli.trainer.callbacks[:] = [c for c in cli.trainer.callbacks if not isinstance(c, ReleaseFreedMemory)]
cli.trainer.fit(cli.model, cli.datamodule)
"""
DONE = re.compile(r"done: (\d+) steps in ([0-9:]+)")


def fit(arm: str, recipe: str, steps: int, root: Path) -> tuple[float, float]:
    """(peak GiB, seconds a step) of one `fit` of `steps` steps."""
    args = [sys.executable, "-c", FIT, arm, "--config", recipe, "--trainer.max_steps", str(steps),
            "--trainer.val_check_interval", str(steps), "--trainer.limit_val_batches", "4",
            "--trainer.default_root_dir", str(root), "--trainer.enable_progress_bar", "false"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"fit failed ({proc.returncode}): {' '.join(args)}")
    log = newest_train_log(root).read_text()
    m = DONE.search(log)
    return usage.ru_maxrss / 2**20, clock_seconds(m[2]) / int(m[1])


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--recipe", default="recipes/smollm2-135m/eagle3-cpu.yaml")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--passes", type=int, default=1)
    p.add_argument("--arms", nargs="+", default=["kept", "released", "mapped"], choices=["kept", "released", "mapped"])
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = itertools.count()
        results = alternate({arm: (lambda arm=arm: fit(arm, args.recipe, args.steps, Path(tmp) / f"run{next(runs)}"))
                             for arm in args.arms}, args.passes)
    out, step = {}, {arm: statistics.median(v[1] for v in values) for arm, values in results.items()}
    for arm, values in results.items():
        out[f"peak_gib_{arm}"] = f"{max(v[0] for v in values):.2f}"
        out[f"s_per_step_{arm}"] = f"{step[arm]:.2f}"
        if arm != "kept" and "kept" in step:
            out[f"step_time_ratio_{arm}"] = f"{step[arm] / step['kept']:.3f}"
    print_result(out)


if __name__ == "__main__":
    main()
