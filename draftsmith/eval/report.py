"""results.json, a rich table, and PNG plots (α_j by position; τ and speedup by category)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_results(results: dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    return path


def table(results: dict[str, Any]) -> Any:
    from rich.table import Table

    acc, speed = results["acceptance"], results["speed"]
    t = Table(title=f"{results['config']['prompts']}: {results['config']['drafter']} on {results['config']['target']}")
    for col in ("category", "prompts", "τ (with bonus)", "mean accepted", "tok/s", "AR tok/s", "speedup"):
        t.add_column(col, justify="right" if col != "category" else "left")
    for cat, c in results["per_category"].items():
        t.add_row(cat, str(c["prompts"]), f"{c['tau']:.2f}", f"{c['mean_accepted']:.2f}",
                  f"{c['tokens_per_second']:.1f}", f"{c['autoregressive_tokens_per_second']:.1f}", f"{c['speedup']:.2f}x")
    t.add_row("[bold]all", str(sum(c["prompts"] for c in results["per_category"].values())), f"[bold]{acc['tau']:.2f}",
              f"{acc['mean_accepted']:.2f}", f"{speed['method']['tokens_per_second']:.1f}",
              f"{speed['autoregressive']['tokens_per_second']:.1f}", f"[bold]{speed['speedup']:.2f}x")
    alpha = ", ".join(f"{a:.2f}" for a in acc["alpha"] if a is not None)
    lookup = f" + prompt lookup {results['config']['lookup']}" if results["config"].get("lookup") else ""
    drafts = f"tree {results['config']['tree']}{lookup} (mean {acc.get('mean_tree_size', 0):.1f} nodes)" \
        if results["config"].get("tree") else f"{results['config'].get('policy', 'static')} chain"
    t.caption = (f"{drafts}  α_j by depth: [{alpha}]  target forwards/token {acc.get('target_forwards_per_token', 0):.2f}  "
                 f"drafted-but-rejected {acc.get('drafted_rejected', 0)}  median of {speed['repeats']} repeats")
    if acc.get("draft_vocab_coverage") is not None:
        t.caption += f"  generated tokens inside the draft vocabulary {acc['draft_vocab_coverage']:.1%}"
    config = results["config"]
    if config.get("mode", "exact") != "exact":  # not lossless: the output is not the target's own
        t.caption += (f"  LOSSY: --mode {config['mode']} --rule {config.get('rule') or 'default'} "
                      f"--alpha {config.get('alpha')}")
    return t


def plots(results: dict[str, Any], out: Path) -> list[str]:
    """Two PNGs; returns their paths (none, with a hint, when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: pip install matplotlib")
        return []
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    alpha = [a for a in results["acceptance"]["alpha"] if a is not None]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar(range(1, len(alpha) + 1), alpha, color="#4C72B0")
    ax.set_xlabel("draft position j")
    ax.set_ylabel("α_j (accepted | reached)")
    ax.set_ylim(0, 1)
    ax.set_title(f"per-position acceptance, τ = {results['acceptance']['tau']:.2f}")
    fig.tight_layout()
    paths.append(str(out / "alpha_by_position.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    cats = list(results["per_category"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    axes[0].bar(cats, [results["per_category"][c]["tau"] for c in cats], color="#55A868")
    axes[0].set_title("τ by category")
    axes[1].bar(cats, [results["per_category"][c]["speedup"] for c in cats], color="#C44E52")
    axes[1].axhline(1.0, color="black", lw=0.8, ls="--")
    axes[1].set_title("speedup over autoregressive")
    for ax in axes:
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    paths.append(str(out / "by_category.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths
