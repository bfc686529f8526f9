"""Drafters trained at other context lengths, side by side: α_1 and τ by context position and τ by prompt set.

Each arm is the results.json of one `draftsmith eval --prompts mtbench,humaneval,long` of a drafter (the same
options for every arm). Prints, per arm, α_1 and τ by context-position bucket, α_1 of the deepest bucket over
that of the shortest, and each prompt set's τ over the first arm's; draws α_1 by position and τ by set for every
arm in one figure.

    python benchmarks/context_arms.py --out docs/img/context_arms.png \\
        short-512=runs/pack-eval/eagle3-cpu/results.json packed-2k=runs/pack-eval/eagle3-cpu-pack2048/results.json

Ends with `RESULT <arm>_alpha1_deep_over_short=... <arm>_tau_<set>=... <arm>_tau_<set>_over_first=...`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from harness import parser, print_result


def main() -> None:
    p = parser(__doc__)
    p.add_argument("arms", nargs="+", help="NAME=results.json, the first the reference")
    p.add_argument("--out", type=Path, default=Path("context_arms.png"))
    args = p.parse_args()
    arms = {}
    for arm in args.arms:
        name, _, path = arm.partition("=")
        if not path:
            raise SystemExit(f"{arm!r}: give NAME=results.json")
        results = json.loads(Path(path).read_text())
        if not results.get("per_position"):
            raise SystemExit(f"{path} holds no per_position breakdown: an eval of draftsmith 2026-12 or later")
        arms[name] = results
    out: dict[str, str] = {}
    first = next(iter(arms.values()))
    for name, results in arms.items():
        key = re.sub(r"\W+", "_", name)
        positions = results["per_position"]
        alpha1 = {bucket: g["alpha"][0] or 0.0 for bucket, g in positions.items()}
        short, deep = alpha1[next(iter(alpha1))], alpha1[list(alpha1)[-1]]
        print(f"{name}: " + ", ".join(f"{b} α_1 {a:.3f} τ {positions[b]['tau']:.2f} ({positions[b]['rounds']} rounds)"
                                      for b, a in alpha1.items()))
        out[f"{key}_alpha1_deep_over_short"] = f"{deep / short:.3f}" if short else "nan"
        for s, g in results["per_set"].items():
            out[f"{key}_tau_{s}"] = f"{g['tau']:.3f}"
            if results is not first and s in first["per_set"]:
                out[f"{key}_tau_{s}_over_first"] = f"{g['tau'] / first['per_set'][s]['tau']:.3f}"
    plot(arms, args.out)
    print(f"plot: {args.out}")
    print_result(out)


def plot(arms: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.9))
    sets = list(next(iter(arms.values()))["per_set"])
    width = 0.8 / len(arms)
    for i, (name, results) in enumerate(arms.items()):
        positions = results["per_position"]
        ax.plot(list(positions), [g["alpha"][0] or 0.0 for g in positions.values()], "o-", label=name)
        bx.bar([j + i * width for j in range(len(sets))], [results["per_set"].get(s, {}).get("tau", 0) for s in sets],
               width, label=name)
    ax.set_ylim(0, 1)
    ax.set_xlabel("context position (tokens) at which the round drafted")
    ax.set_ylabel("α_1, the first drafted token")
    ax.set_title("acceptance by context position")
    bx.set_xticks([j + 0.4 - width / 2 for j in range(len(sets))], sets)
    bx.set_ylim(1.0, max(r["per_set"][s]["tau"] for r in arms.values() for s in r["per_set"]) + 0.3)
    bx.set_ylabel("τ (tokens a round)")
    bx.set_title("τ by prompt set")
    handles, labels = ax.get_legend_handles_labels()  # one legend for both panels, below them
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 7), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
