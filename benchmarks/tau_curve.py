"""Validation τ̂ against training minutes: where a recipe saturates in its budget.

Trains each recipe with `draftsmith fit` (its own steps and features; validation every `--val_every`
steps), or reads the `train.log` of runs already made (`--logs NAME=PATH`, e.g. `make demo`'s
`runs/smollm2-135m/eagle3-cpu/logs/version_0/train.log`), and reads from each log the validation lines
`step S validation at M:SS: ... val/tau X` that `draftsmith fit` writes. The minutes include the
validations themselves, as a user's budget does. Prints a table, plots docs/img/tau_curve.png and
ends with

    RESULT tau_<name>=<last τ̂> minutes_<name>=<its minute> gain_last_quarter_<name>=<τ̂ gained in the
    last quarter of the run's minutes> ...

A run still gaining in its last quarter is not saturated: more minutes would buy more τ̂.

    python benchmarks/tau_curve.py --recipes eagle3=recipes/smollm2-135m/eagle3-cpu.yaml \\
        eagle31=recipes/smollm2-135m/eagle3-cpu.yaml:--model.init_args.fc_norm=true --val_every 70
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from harness import clock_seconds, newest_train_log, parser, print_result

ROOT = Path(__file__).resolve().parent.parent
LINE = re.compile(r"step (\d+) validation at ([0-9:]+): .*?val/tau ([0-9.]+)")


def read_curve(log: Path) -> list[tuple[float, int, float]]:
    """(minutes, step, τ̂) of every validation line of a `train.log`."""
    points = []
    for line in log.read_text().splitlines():
        m = LINE.search(line)
        if m:
            points.append((clock_seconds(m[2]) / 60, int(m[1]), float(m[3])))
    if not points:
        raise SystemExit(f"{log}: no validation lines with val/tau (was it written by `draftsmith fit`?)")
    return points


def train(name: str, spec: str, val_every: int, out: Path) -> Path:
    """Run `draftsmith fit` on a recipe (`PATH[:--override=value,...]`); its train.log."""
    recipe, _, extra = spec.partition(":")
    root = out / name
    args = [sys.executable, "-m", "draftsmith.cli", "fit", "--config", recipe,
            "--trainer.val_check_interval", str(val_every), "--trainer.default_root_dir", str(root),
            "--trainer.enable_progress_bar", "false", *[a for a in extra.split(",") if a]]
    print(f"{name}: {' '.join(args[2:])}", flush=True)
    subprocess.run(args, check=True, cwd=ROOT)
    return newest_train_log(root)


def gain_last_quarter(points: list[tuple[float, int, float]]) -> float:
    """τ̂ at the end minus τ̂ at three quarters of the run's minutes, read off the straight line between the
    validations either side of that minute (the first validation's τ̂ when it comes later)."""
    at = 0.75 * points[-1][0]
    before = [p for p in points if p[0] <= at]
    if not before:
        return points[-1][2] - points[0][2]
    (m0, _, t0), (m1, _, t1) = before[-1], points[min(len(before), len(points) - 1)]
    tau = t0 if m1 == m0 else t0 + (t1 - t0) * (at - m0) / (m1 - m0)
    return points[-1][2] - tau


def plot(curves: dict[str, list[tuple[float, int, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, points in curves.items():
        ax.plot([p[0] for p in points], [p[2] for p in points], marker="o", label=name)
    ax.set_xlabel("training minutes (validations included)")
    ax.set_ylabel("validation τ̂")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--recipes", nargs="*", default=[], metavar="NAME=RECIPE[:OVERRIDES]",
                   help="recipes to train, overrides comma-separated (--key=value)")
    p.add_argument("--logs", nargs="*", default=[], metavar="NAME=TRAIN_LOG", help="runs already made")
    p.add_argument("--val_every", type=int, default=70, help="steps between validations of the trained recipes")
    p.add_argument("--out", default="runs/bench/tau-curve", help="where the trained recipes' runs go")
    p.add_argument("--plot", default=str(ROOT / "docs/img/tau_curve.png"))
    args = p.parse_args()
    if not args.recipes and not args.logs:
        raise SystemExit("name at least one --recipes or --logs")
    logs = {}
    for item in args.logs:
        name, _, path = item.partition("=")
        logs[name] = Path(path)
    for item in args.recipes:
        name, _, spec = item.partition("=")
        logs[name] = train(name, spec, args.val_every, Path(args.out))
    curves = {name: read_curve(path) for name, path in logs.items()}
    result = {}
    for name, points in curves.items():
        print(f"{name}: " + "  ".join(f"{m:.1f} min (step {s}) τ̂ {t:.3f}" for m, s, t in points))
        result |= {f"tau_{name}": f"{points[-1][2]:.3f}", f"minutes_{name}": f"{points[-1][0]:.1f}",
                   f"gain_last_quarter_{name}": f"{gain_last_quarter(points):.3f}"}
    plot(curves, Path(args.plot))
    print_result(result)


if __name__ == "__main__":
    main()
