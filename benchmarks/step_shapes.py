"""Seconds a training step with and without padding its products to a few shapes.

A training step's products change shape with every batch: the batch's width (its longest record) and the
number of positions that carry loss. On a CPU oneDNN builds a kernel for each new shape it meets, several
times the cost of the product itself (a (M, 4096) x (4096, 576) bf16 product: ~15 ms the first time, ~4 ms
after). `draftsmith fit` pads a batch's width to a multiple of 64 (`data.modules.PAD_MULTIPLE`) and the rows
each loss gathers to a multiple of 64 (`train.alignment.ROW_MULTIPLE`). The arm `exact` sets both to 1
(every shape as the data has it), `padded` runs as `fit` does. Each arm is its own process (a fresh kernel
cache), the recipe's own steps, its seconds a step read from `train.log`; the arms alternate over
`--passes`. Ends with

    RESULT s_per_step_exact=... s_per_step_padded=... speedup=<exact ÷ padded> steps=...

    python benchmarks/step_shapes.py --steps 300 --recipe recipes/smollm2-135m/eagle3-cpu.yaml
"""

from __future__ import annotations

import argparse
import itertools
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from harness import alternate, clock_seconds, newest_train_log, parser, print_result

ROOT = Path(__file__).resolve().parent.parent
ARMS = {  # what each arm changes before `fit` starts
    "exact": "from draftsmith.data import modules\nfrom draftsmith.train import alignment\n"
             "modules.PAD_MULTIPLE = alignment.ROW_MULTIPLE = 1",
    "padded": "",
}
FIT = """
import sys
from draftsmith.train.cli import lightning_cli
cli = lightning_cli(sys.argv[1:], run=False)
cli.trainer.fit(cli.model, cli.datamodule)
"""
DONE = re.compile(r"done: (\d+) steps in ([0-9:]+)")


def fit(setup: str, recipe: str, steps: int, root: Path, overrides: Sequence[str] = ()) -> float:
    """Seconds a step of one `fit` of `steps` steps (no validation), in a process that first runs `setup`;
    `overrides`: more of `fit`'s arguments (`--data.init_args.features_dir DIR`, ...)."""
    args = [sys.executable, "-c", setup + "\n" + FIT, "--config", recipe, "--trainer.max_steps", str(steps),
            "--trainer.max_time", "null", "--trainer.val_check_interval", str(steps + 1),
            "--trainer.limit_val_batches", "0", "--trainer.default_root_dir", str(root),
            "--trainer.enable_progress_bar", "false", *overrides]
    done = subprocess.run(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise SystemExit(f"fit failed ({done.returncode}): {' '.join(args)}\n{done.stderr[-3000:]}")
    m = DONE.search(newest_train_log(root).read_text())
    return clock_seconds(m[2]) / int(m[1])


def fit_arguments(doc: str | None, steps: int, overrides: bool = False) -> argparse.ArgumentParser:
    """The harness's parser with the options every step-timing script takes (`overrides`: more `fit`
    arguments after --)."""
    p = parser(doc)
    p.add_argument("--recipe", default="recipes/smollm2-135m/eagle3-cpu.yaml")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--passes", type=int, default=1)
    if overrides:
        p.add_argument("overrides", nargs="*",
                       help="more `fit` arguments, after --: --data.init_args.features_dir DIR ...")
    return p


def step_seconds(arms: dict[str, tuple[str, Sequence[str]]], recipe: str, steps: int, passes: int) -> dict[str, float]:
    """Median seconds a step of each arm, given as (set-up code, more `fit` arguments): each run its own `fit`
    process, the arms alternating over `passes`."""
    with tempfile.TemporaryDirectory() as tmp:
        runs = itertools.count()

        def run(setup: str, extra: Sequence[str]) -> float:
            return fit(setup, recipe, steps, Path(tmp) / f"run{next(runs)}", extra)

        results = alternate({arm: (lambda arm=arm: run(*arms[arm])) for arm in arms}, passes)
    return {arm: statistics.median(values) for arm, values in results.items()}


def main() -> None:
    args = fit_arguments(__doc__, 300).parse_args()
    step = step_seconds({arm: (setup, ()) for arm, setup in ARMS.items()}, args.recipe, args.steps, args.passes)
    print_result({"s_per_step_exact": f"{step['exact']:.3f}", "s_per_step_padded": f"{step['padded']:.3f}",
                  "speedup": f"{step['exact'] / step['padded']:.3f}", "steps": args.steps})


if __name__ == "__main__":
    main()
