"""Quality against latency for the lossy decoding modes: lossy speculative decoding, Chow/Diff/OPT
speculative cascades, token-specific V3, BiLD* and BiLD, with the drafter alone and the target alone
as the end points (the speculative-cascades paper's Figures 4-5, arXiv:2405.19261).

The embedded SmolLM2-135M target and the standalone-cpu draft LM, fp32, static drafts of K, at
temperature 1 and 0. For every (method, alpha):
- quality, teacher-forced on the reference answers of held-out chats (the validation split of the
  chats the drafter was trained on): at T = 1 the reference loss, mean -log pi_t(x_ref); at T = 0
  the expected accuracy, mean pi_t(x_ref) (the chance that decoding with pi emits the reference token;
  -log pi is unbounded there). One target pass and one drafter pass serve every point.
- latency: wall time per generated token decoding the held-out prompts with that mode, relative to
  the target alone, measured in this process (the target alone is timed before, between and after
  the methods; the median is the reference). The drafter alone is timed decoding by itself.

From the T = 1 curves: speedup_at_target_quality_<method> (the speedup of the fastest point whose
reference loss is no worse than the target's; none when no point gets there) and best_loss_<method>
(the lowest loss among points no slower than the target). Writes the plot and the points as JSON.

    python benchmarks/cascades.py [--drafter DIR] [--data_limit 800] [--prompts 5] [--chats 12] [--max_new_tokens 48]

DIR is a native export of the standalone drafter (by default the one `draftsmith run
recipes/smollm2-135m/standalone-cpu.yaml` writes). Ends with `RESULT speedup_at_target_quality_lossy=...`.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from harness import parser, result_line

ROOT = Path(__file__).resolve().parents[1]
# method: (mode, rule, alpha grid); lossy at T = 0 is Leviathan's greedy variant (V3 on the raw law)
METHODS = {
    "lossy": ("lossy", "beta1", [0.1, 0.3, 0.5, 0.7, 0.9]),
    "chow": ("cascade", "chow", [0.1, 0.3, 0.5, 0.7, 0.9]),
    "diff": ("cascade", "diff", [0.0, 0.1, 0.2, 0.4, 0.6]),
    "opt": ("cascade", "opt", [0.0, 0.2, 0.5, 0.8, 0.95]),
    "token": ("token", "v3", [0.1, 0.3, 0.5, 0.7, 0.9]),
    "bild_star": ("bild", "star", [0.1, 0.2, 0.3, 0.5, 0.7]),
    "bild": ("bild", "rollback", [0.5, 0.8, 0.9, 0.95, 0.99]),
}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--drafter", default=str(ROOT / "runs/smollm2-135m/standalone-cpu/export-native"))
    ap.add_argument("--data_limit", type=int, default=800, help="the recipe's data.limit (its validation split)")
    ap.add_argument("--prompts", type=int, default=5, help="held-out prompts decoded per point")
    ap.add_argument("--max_prompt_tokens", type=int, default=128,
                    help="decode prompts no longer than this (a long prefill would hide the decoding's latency)")
    ap.add_argument("--chats", type=int, default=12, help="held-out chats whose reference answers score quality")
    ap.add_argument("--max_new_tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--fallback", type=float, default=0.4, help="BiLD's fallback threshold")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.0])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--out", default=str(ROOT / "runs/bench/cascades"))
    args = ap.parse_args()
    from rich.progress import track

    from draftsmith.eval.prompts import load_prompts
    from draftsmith.eval.quality import reference_chats, reference_quality, reference_rows
    from draftsmith.runtime.loading import load_proposer
    from draftsmith.models.target import load_target
    from draftsmith.runtime.generate import generate
    from draftsmith.runtime.runner import TargetRunner
    from draftsmith.runtime.policies import Static
    from draftsmith.runtime.proposers import NoProposer
    from draftsmith.runtime.sampling import SamplingConfig, seeded
    from draftsmith.runtime.targets import target_rule

    if not (Path(args.drafter) / "draftsmith.json").is_file():
        raise SystemExit(f"no drafter export at {args.drafter}: run `draftsmith run recipes/smollm2-135m/standalone-cpu.yaml`")
    target = load_target("embedded:smollm2-135m-instruct", dtype="float32")
    proposer, description = load_proposer(args.drafter, target, 0)  # the full head: q is defined everywhere
    runner, eos = TargetRunner(target.model, proposer.aux_layer_ids), target.eos_token_ids
    held_out = load_prompts("heldout", data_limit=args.data_limit)
    with_answer = [p for p in held_out if p.get("reference")]
    encoded = [target.encode_chat([{"role": "user", "content": p["turns"][0]}]) for p in with_answer]
    decoded = [ids for ids in encoded if len(ids) <= args.max_prompt_tokens][: args.prompts]
    chats = reference_chats(target.tokenizer, with_answer[: args.chats], max_length=384)
    rows = reference_rows(runner, proposer, list(track(chats, description="reference answers")))
    print(f"{description}; {len(decoded)} prompts x {args.max_new_tokens} tokens; quality on {len(rows.tokens)} "
          f"reference tokens of {len(chats)} held-out chats")

    def seconds_per_token(proposer_, rule, sampling, seed=0, runner_=runner) -> float:
        g, tokens, seconds = seeded(seed, runner_.device), 0, 0.0
        for ids in decoded:
            out = generate(runner_, proposer_, ids, args.max_new_tokens, Static(args.k), sampling, rule=rule,
                           eos_token_ids=eos, generator=g)
            tokens, seconds = tokens + len(out.tokens), seconds + out.seconds
        return seconds / tokens

    baseline = NoProposer(target.vocab_size)
    drafter_runner = TargetRunner(proposer.model) if hasattr(proposer, "model") else None
    report: dict = {"config": vars(args), "drafter": description, "temperatures": {}}
    for temperature in args.temperatures:
        sampling = SamplingConfig(temperature)
        measure_q = "loss" if temperature > 0 else "expected_accuracy"
        seconds_per_token(proposer, None, sampling)  # warm-up
        ar = [seconds_per_token(baseline, None, sampling)]
        curves: dict[str, list[dict]] = {}
        for i, name in enumerate(args.methods):
            mode, rule_name, alphas = METHODS[name]
            curves[name] = []
            for alpha in track(alphas, description=f"T={temperature:g} {name}"):
                rule = target_rule(mode, rule_name, alpha, greedy=temperature == 0, fallback=args.fallback)
                latency = seconds_per_token(proposer, rule, sampling)
                curves[name].append({"alpha": alpha, "seconds_per_token": latency,
                                     **reference_quality(rows, rule, sampling)})
            if i == len(args.methods) // 2:
                ar.append(seconds_per_token(baseline, None, sampling))
        ar.append(seconds_per_token(baseline, None, sampling))
        ar_seconds = statistics.median(ar)
        for points in curves.values():
            for p in points:
                p["latency"] = p["seconds_per_token"] / ar_seconds
        ends = {arm: reference_quality(rows, arm, sampling) for arm in ("target", "drafter")}
        ends["target"]["latency"] = 1.0
        if drafter_runner is not None:
            ends["drafter"]["latency"] = seconds_per_token(baseline, None, sampling, runner_=drafter_runner) / ar_seconds
        report["temperatures"][f"{temperature:g}"] = {"quality": measure_q, "target_seconds_per_token": ar,
                                                      "ends": ends, "curves": curves}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cascades.json").write_text(json.dumps(report, indent=2) + "\n")
    png = plot(report, out / "cascades.png")
    print(f"points: {out / 'cascades.json'}" + (f"\nplot: {png}" if png else ""))
    print(summary(report))


def better(measure: str, a: float, b: float) -> bool:
    """a at least as good as b."""
    return a <= b + 1e-9 if measure == "loss" else a >= b - 1e-9


def summary(report: dict) -> str:
    keys = {}
    for label, run in report["temperatures"].items():
        suffix = "" if label == "1" else f"_t{label}"
        measure, ends = run["quality"], run["ends"]
        short = "loss" if measure == "loss" else "acc"
        keys[f"{short}_target{suffix}"] = f"{ends['target'][measure]:.4f}"
        keys[f"{short}_drafter{suffix}"] = f"{ends['drafter'][measure]:.4f}"
        for name, points in run["curves"].items():
            reach = [1 / p["latency"] for p in points if better(measure, p[measure], ends["target"][measure])]
            keys[f"speedup_at_target_quality_{name}{suffix}"] = f"{max(reach):.3f}" if reach else "none"
            within = [p[measure] for p in points if p["latency"] <= 1.0]
            best = (min if measure == "loss" else max)(within) if within else None
            keys[f"best_{short}_{name}{suffix}"] = f"{best:.4f}" if best is not None else "none"
    return result_line(keys)


def plot(report: dict, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = report["temperatures"]
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4.4), squeeze=False)
    for ax, (label, run) in zip(axes[0], runs.items()):
        measure, ends = run["quality"], run["ends"]
        for name, points in run["curves"].items():
            ax.plot([p["latency"] for p in points], [p[measure] for p in points], "o-", ms=3.5, label=name)
        ax.axhline(ends["target"][measure], color="black", ls="--", lw=0.9, label="target alone")
        ax.plot([1.0], [ends["target"][measure]], "k*", ms=10)
        if "latency" in ends["drafter"]:
            ax.plot([ends["drafter"]["latency"]], [ends["drafter"][measure]], "rs", ms=7, label="drafter alone")
        ax.set_xlabel("latency relative to the target alone")
        ax.set_ylabel("reference loss (lower is better)" if measure == "loss" else "expected accuracy on the reference")
        ax.set_title(f"T = {label}")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{report['drafter']} drafting for SmolLM2-135M (held-out chats)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


if __name__ == "__main__":
    main()
