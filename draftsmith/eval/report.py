"""results.json, rich tables, and PNG plots (α_j by position; τ and speedup by category; acceptance by context
position)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_results(results: dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    return path


def quality_line(quality: dict[str, Any], said: tuple[str, ...] = ()) -> str:
    """The generated text's quality, method against the target alone, in a line (less the measures `said`
    already)."""
    quality = {k: v for k, v in quality.items() if k not in said}
    parts = []
    if "rouge_l" in quality:
        parts.append(f"ROUGE-L {quality['rouge_l']['method']:.3f} (target {quality['rouge_l']['autoregressive']:.3f})")
    if "humaneval_pass_at_1" in quality:
        q = quality["humaneval_pass_at_1"]
        parts.append(f"HumanEval pass@1 {q['method']:.3f} (target {q['autoregressive']:.3f})")
    if "agreement" in quality:
        parts.append(f"agreement with the target's greedy text {quality['agreement']:.1%}")
    if "reference" in quality:
        r = quality["reference"]
        parts.append(f"reference loss {r['loss']:.3f}, top-1 {r['top1']:.3f}, deferral {r['deferral']:.2f}")
    return "  ".join(parts)


def not_valid_because(results: dict[str, Any]) -> str:
    """Why a run's speed is not this machine's (results.json's `machine`)."""
    machine = results.get("machine", {})
    if machine.get("not_valid_because"):
        return machine["not_valid_because"]
    load = max((x for x in machine.get("load_average", []) if x is not None), default=0.0)
    return f"other work shared the CPU (load average {load:.1f})"


def speedup_cell(speedup: float, valid: bool, style: str = "") -> str:
    """A speedup as the tables print it; struck as not valid when other work shared the CPU while it was timed."""
    return f"{style}{speedup:.2f}x" if valid else f"[red]({speedup:.2f}x) not valid"


WIDE = 160  # the width a table is printed at off a terminal (a log file, a pipe), where nothing wraps it


def print_table(console: Any, results: dict[str, Any]) -> None:
    """Print a run's table; off a terminal (a log file, a pipe) at least `WIDE` columns wide, where rich would
    otherwise squeeze it into 80 and cut every header short."""
    if not console.is_terminal and console.width < WIDE:
        console.width = WIDE
    console.print(table(results))
    where = breakdown_table(results)
    if where is not None:
        console.print(where)


BREAKDOWNS = {"per_set": "prompt set", "per_turn": "turn", "per_position": "context position"}


def breakdown_table(results: dict[str, Any]) -> Any:
    """Where τ is lost: τ, α_1 (the first drafted token's acceptance) and speedup by prompt set, turn and the
    context position a round drafted at (`eval/breakdown.py`); None when each holds one group only."""
    from rich.table import Table

    shown = {key: results[key] for key in BREAKDOWNS if len(results.get(key, {})) > 1}
    if not shown or "points" in results:
        return None
    t = Table(title="where τ is lost")
    for col in ("by", "group", "rounds", "τ", "α_1", "speedup"):
        t.add_column(col, justify="left" if col in ("by", "group") else "right")
    valid = results["speed"].get("valid", True)
    for key, groups in shown.items():
        for label, g in groups.items():
            first = g["alpha"][0] if g.get("alpha") and g["alpha"][0] is not None else None
            t.add_row(BREAKDOWNS[key], label, str(g["rounds"]), f"{g['tau']:.2f}",
                      f"{first:.2f}" if first is not None else "–",
                      speedup_cell(g["speedup"], valid) if "speedup" in g else "–")
    t.caption = ("context position: the sequence length at which a round drafted (prompt and tokens committed before); "
                 "its speedup: decoding rounds only, against the target alone's rounds there (prefills left out)")
    return t


def sweep_table(results: dict[str, Any]) -> Any:
    """One row per alpha of a --sweep, with the target alone and the drafter alone where measured."""
    from rich.table import Table

    config = results["config"]
    t = Table(title=f"{config['prompts']}: --mode {config['mode']} --rule {config.get('rule') or 'default'} sweep, "
                    f"{config['drafter']} on {config['target']}")
    for col in ("alpha", "τ", "tok/s", "speedup", "latency vs target", "ref. loss", "top-1", "deferral",
                "rejection", "ROUGE-L", "agreement"):
        t.add_column(col, justify="right")
    ends = results.get("reference_ends", {})

    def ref_cells(r: dict[str, Any] | None) -> list[str]:
        return [f"{r['loss']:.3f}", f"{r['top1']:.3f}", f"{r['deferral']:.2f}", f"{r['rejection']:.2f}"] if r else ["–"] * 4

    first = results["points"][0]["quality"]
    if "target" in ends:
        rouge = first.get("rouge_l", {}).get("autoregressive")
        t.add_row("target", "1.00", f"{results['points'][0]['speed']['autoregressive']['tokens_per_second']:.1f}",
                  "1.00x", "1.00", *ref_cells(ends["target"]), f"{rouge:.3f}" if rouge is not None else "–",
                  "100%" if "agreement" in first else "–")
    for point in results["points"]:
        q, speed = point["quality"], point["speed"]
        rouge = q.get("rouge_l", {}).get("method")
        t.add_row(f"{point['alpha']:g}", f"{point['acceptance']['tau']:.2f}", f"{speed['method']['tokens_per_second']:.1f}",
                  speedup_cell(speed["speedup"], speed.get("valid", True)), f"{1 / speed['speedup']:.2f}", *ref_cells(q.get("reference")),
                  f"{rouge:.3f}" if rouge is not None else "–",
                  f"{q['agreement']:.0%}" if "agreement" in q else "–")
    if "drafter" in ends:
        t.add_row("drafter", "–", "–", "–", "–", *ref_cells(ends["drafter"]), "–", "–")
    t.caption = (f"LOSSY (--mode {config['mode']}): the output is not the target's own. latency = wall time per token "
                 f"relative to the target alone in the same process, median of {config['repeats']} repeats")
    if not all(point["speed"].get("valid", True) for point in results["points"]):
        t.caption += "  SPEEDUP NOT VALID where marked: other work shared the CPU; rerun on a quiet machine"
    return t


def table(results: dict[str, Any]) -> Any:
    from rich.table import Table

    if "points" in results:
        return sweep_table(results)
    acc, speed = results["acceptance"], results["speed"]
    config = results["config"]
    mode = ", ".join(f"{k}={json.dumps(v)}" for k, v in sorted((config.get("template_kwargs") or {}).items()))
    t = Table(title=f"{config['prompts']}: {config['drafter']} on {config['target']}" + (f" ({mode})" if mode else ""))
    for col in ("category", "prompts", "τ (with bonus)", "mean accepted", "tok/s", "AR tok/s", "speedup"):
        t.add_column(col, justify="right" if col != "category" else "left")
    valid = speed.get("valid", True)  # False: other work shared the CPU while the arms were timed
    for cat, c in results["per_category"].items():
        t.add_row(cat, str(c["prompts"]), f"{c['tau']:.2f}", f"{c['mean_accepted']:.2f}",
                  f"{c['tokens_per_second']:.1f}", f"{c['autoregressive_tokens_per_second']:.1f}", speedup_cell(c["speedup"], valid))
    t.add_row("[bold]all", str(sum(c["prompts"] for c in results["per_category"].values())), f"[bold]{acc['tau']:.2f}",
              f"{acc['mean_accepted']:.2f}", f"{speed['method']['tokens_per_second']:.1f}",
              f"{speed['autoregressive']['tokens_per_second']:.1f}", speedup_cell(speed["speedup"], valid, "[bold]"))
    for name, m in results.get("modelled", {}).items():  # the same rounds, under a cost profile
        rate = f"{m['tokens_per_second']:.1f}" if m.get("tokens_per_second") else ""
        t.add_row(f"[italic]modelled: {name}", "", "", "", rate, "",
                  f"[italic]{m['speedup']:.2f}x" if m.get("speedup") else "—")
    alpha = ", ".join(f"{a:.2f}" for a in acc["alpha"] if a is not None)
    lookup = f" + prompt lookup {results['config']['lookup']}" if results["config"].get("lookup") else ""
    from draftsmith.runtime.policies import POLICY_KINDS

    policy = POLICY_KINDS.get(results["config"].get("policy", ""))
    sized = f"sized by {policy.name} within " if policy is not None and policy.sizes_trees else ""
    drafts = f"tree {sized}{results['config']['tree']}{lookup} (mean {acc.get('mean_tree_size', 0):.1f} nodes)" \
        if results["config"].get("tree") else f"{results['config'].get('policy', 'static')} chain"
    t.caption = (f"{drafts}  α_j by depth: [{alpha}]  target forwards/token {acc.get('target_forwards_per_token', 0):.2f}  "
                 f"drafted-but-rejected {acc.get('drafted_rejected', 0)}  median of {speed['repeats']} repeats")
    unpriced = [f"{name}: {m['why']}" for name, m in results.get("modelled", {}).items() if m.get("why")]
    if results.get("modelled"):
        t.caption += ("  modelled: the rounds counted, priced by the cost profile (eval/profile.py), not timed"
                      + (f" ({'; '.join(unpriced)})" if unpriced else ""))
    if results["config"].get("compile") and speed.get("warmup_seconds") is not None:
        t.caption += f"  compiled: warm-up (compiling) {speed['warmup_seconds']:.0f} s"
    if acc.get("draft_vocab_coverage") is not None:
        t.caption += f"  generated tokens inside the draft vocabulary {acc['draft_vocab_coverage']:.1%}"
    config = results["config"]
    if not valid:
        t.caption += f"  SPEEDUP NOT VALID: {not_valid_because(results)}; rerun on a quiet machine"
    agreement = results.get("quality", {}).get("agreement", 1.0)  # measured at temperature 0
    differ = config.get("mode", "exact") == "exact" and agreement < 1
    if differ:
        t.caption += (f"  OUTPUTS DIFFER from the target's greedy text (agreement {agreement:.0%}): rounding near ties "
                      f"in {config.get('dtype', 'this type')}, where a many-row product does not round as a one-row one")
    if config.get("mode", "exact") != "exact":  # not lossless: the output is not the target's own
        t.caption += (f"  LOSSY: --mode {config['mode']} --rule {config.get('rule') or 'default'} "
                      f"--alpha {config.get('alpha')}")
    if results.get("quality"):
        t.caption += "  " + quality_line(results["quality"], said=("agreement",) if differ else ())
    return t


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: pip install matplotlib")
        return None
    return plt


def sweep_plot(results: dict[str, Any], out: Path) -> list[str]:
    """Quality against latency relative to the target alone, a point per alpha (reference loss where measured,
    else ROUGE-L or agreement), the target's quality dashed."""
    plt = _pyplot()
    points = results["points"]
    metric = next((m for m in ("reference", "rouge_l", "agreement") if m in points[0]["quality"]), None)
    if plt is None or metric is None:
        return []

    def value(q: dict[str, Any]) -> float:
        return q["reference"]["loss"] if metric == "reference" else q["rouge_l"]["method"] if metric == "rouge_l" \
            else q["agreement"]
    target = {"reference": results.get("reference_ends", {}).get("target", {}).get("loss"),
              "rouge_l": points[0]["quality"].get("rouge_l", {}).get("autoregressive"), "agreement": 1.0}[metric]
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    xs, ys = [1 / p["speed"]["speedup"] for p in points], [value(p["quality"]) for p in points]
    ax.plot(xs, ys, "o-", label=f"{results['config']['mode']} {results['config'].get('rule') or ''}")
    for p, x, y in zip(points, xs, ys):
        ax.annotate(f"{p['alpha']:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    if target is not None:
        ax.axhline(target, color="black", ls="--", lw=0.8, label="target alone")
    ax.set_xlabel("latency relative to the target alone")
    ax.set_ylabel({"reference": "reference loss (−log π, lower is better)", "rouge_l": "ROUGE-L",
                   "agreement": "agreement with the target's greedy text"}[metric])
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = str(out / "quality_vs_latency.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


def plots(results: dict[str, Any], out: Path) -> list[str]:
    """PNGs of a run (α_j by position, τ and speedup by category; a sweep's quality against latency);
    returns their paths (none, with a hint, when matplotlib is missing)."""
    if "points" in results:
        return sweep_plot(results, out)
    plt = _pyplot()
    if plt is None:
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
    if results["speed"].get("valid", True):
        axes[1].bar(cats, [results["per_category"][c]["speedup"] for c in cats], color="#C44E52")
        axes[1].axhline(1.0, color="black", lw=0.8, ls="--")
    else:  # a ratio timed beside other work is not this machine's: no bar to misread
        axes[1].text(0.5, 0.5, "not valid:\nother work shared the CPU", ha="center", va="center",
                     transform=axes[1].transAxes, color="#C44E52")
    axes[1].set_title("speedup over autoregressive")
    for ax in axes:
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    paths.append(str(out / "by_category.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    positions = results.get("per_position", {})
    if positions:
        labels = list(positions)
        fig, ax = plt.subplots(figsize=(1.5 + 0.9 * len(labels), 3.2))
        first = [g["alpha"][0] if g["alpha"] and g["alpha"][0] is not None else 0.0 for g in positions.values()]
        ax.plot(labels, first, "o-", color="#4C72B0", label="α_1, the first drafted token")
        ax.set_ylim(0, 1)
        ax.set_xlabel("context position (tokens) at which the round drafted")
        ax.set_ylabel("acceptance")
        twin = ax.twinx()
        taus = [g["tau"] for g in positions.values()]
        twin.plot(labels, taus, "s--", color="#55A868", label="τ")
        twin.set_ylabel("τ (tokens a round)")
        twin.set_ylim(1.0, max(taus) + 1.0)
        for label, g, y in zip(labels, positions.values(), first):
            ax.annotate(f"{g['rounds']} rounds", (label, y), textcoords="offset points", xytext=(0, 6), fontsize=7,
                        ha="center")
        ax.legend(ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0],
                  ax.get_legend_handles_labels()[1] + twin.get_legend_handles_labels()[1], loc="upper right", fontsize=7)
        ax.set_title("acceptance by context position")
        fig.tight_layout()
        paths.append(str(out / "by_context_position.png"))
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    modelled = {f"modelled:\n{name}": m["speedup"] for name, m in results.get("modelled", {}).items() if m.get("speedup")}
    if modelled:
        timed = {"timed here": results["speed"]["speedup"]} if results["speed"].get("valid", True) else {}
        fig, ax = plt.subplots(figsize=(1.6 + 1.3 * (len(timed) + len(modelled)), 3.2))
        ax.bar(list(timed) + list(modelled), list(timed.values()) + list(modelled.values()),
               color=["#C44E52"] * len(timed) + ["#8172B2"] * len(modelled))
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_ylabel("speedup over autoregressive")
        ax.set_title("timed and modelled (cost profiles)")
        fig.tight_layout()
        paths.append(str(out / "speedup_modelled.png"))
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths
