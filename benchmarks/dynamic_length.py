"""Dynamic draft length against the best static K: SpecDec++ and DISCO stop heads, the cost policy,
transformers' confidence rules and the oracle bound, through the shared runtime.

One process, the same prompts for every arm, the arms alternating prompt by prompt, chain drafts:
- static K for K = 1..8 (the best K is chosen on held-out prompts, the validation split of the
  drafter's training chats, never on the benchmark's prompts), the +2/-1 heuristic, confidence 0.4
  (transformers' default) and at its ROC-tuned threshold (the export's `stop_heads.confidence`,
  `draftsmith tune --policy confidence`), the cost policy, specdec and disco (the stop heads and the
  thresholds tuned into the export), and the oracle (greedy only: drafts exactly the tokens the target
  will accept, charged only for what it keeps);
- per prompt set (MT-bench first turns, HumanEval) and temperature: τ, drafted-but-rejected tokens per
  committed token, target forwards per token, tokens/s, speedup over autoregressive decoding (timed in
  the same passes), and ratio_<arm> = that arm's tokens/s ÷ the best static K's.

With --tree DEPTH,TOPK,TOKENS (a feature drafter) the rounds draft EAGLE-2 trees of that shape instead:
the static arms are the fixed trees of depth 1..DEPTH (the best chosen on the held-out prompts), and cost,
specdec and disco choose each round's depth (the cost policy its node count too); the heads at the
thresholds tuned for trees (`draftsmith tune --tree DEPTH,TOPK,TOKENS`).

With --profiles measured,h100-llama8b (cost profiles, `draftsmith profile`) each arm's rounds are also priced
under each profile: the best static arm is chosen on the held-out prompts by its modelled speedup under that
profile, the heads decode at the thresholds tuned for it (`draftsmith tune --cost_profile measured,h100-llama8b`:
an arm `specdec@NAME` where they differ from the plain ones), and every arm gets ratio = its modelled speedup ÷
the best static's under that profile; the oracle's is the headroom there.

Plots: speedup by policy (dynamic_length.png) and, with --labels, each head's calibration on the
labels' validation chats (calibration.png).

    python benchmarks/dynamic_length.py --drafter DIR [--labels LABELS] [--limit 16] [--max_new_tokens 128]
        [--tree 4,4,12 --suffix _tree]

DIR is a native export carrying tuned specdec and disco heads. Ends with
`RESULT ratio_specdec=... ratio_disco=... ratio_cost=... ratio_oracle=...` (greedy, MT-bench; `_t1`
for T = 1, `_humaneval` for HumanEval; --suffix _feature for a feature drafter), then with --profiles the
same ratios modelled under each, `..._h100_llama8b`.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from harness import parser, print_result

ROOT = Path(__file__).resolve().parents[1]
STATIC = [f"static{k}" for k in range(1, 9)]
ARMS = ["heuristic", "confidence", "confidence_roc", "cost", "specdec", "disco", "oracle"]


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--drafter", required=True, help="native export carrying tuned specdec and disco heads")
    ap.add_argument("--target", default="embedded:smollm2-135m-instruct")
    ap.add_argument("--labels", default=None, help="label directory: calibration plot of each head on its validation chats")
    ap.add_argument("--data", default="sharegpt", help="the drafter's training chats (their validation split picks K)")
    ap.add_argument("--data_limit", type=int, default=None, help="the drafter recipe's data.limit")
    ap.add_argument("--sets", nargs="+", default=["mtbench", "humaneval"])
    ap.add_argument("--limit", type=int, default=16, help="MT-bench prompts (spread over categories)")
    ap.add_argument("--humaneval_limit", type=int, default=8, help="HumanEval prompts")
    ap.add_argument("--val_limit", type=int, default=8, help="held-out prompts that choose the best static K")
    ap.add_argument("--max_new_tokens", type=int, default=128)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--t1_sets", nargs="+", default=["mtbench"], help="prompt sets also run at T > 0")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--head_vocab", type=int, default=8192)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--suffix", default="", help="appended to every RESULT key, e.g. _feature")
    ap.add_argument("--tree", default=None, help="DEPTH,TOPK,TOKENS: EAGLE-2 tree rounds (feature drafters)")
    ap.add_argument("--profiles", default=None, help="cost profiles the arms are also priced under (comma-separated: "
                    "measured, a shipped name, a profile file)")
    ap.add_argument("--out", default=str(ROOT / "runs/bench/dynamic_length"))
    args = ap.parse_args()

    from draftsmith.eval.acceptance import acceptance_stats, decode_all
    from draftsmith.eval.oracle import oracle_references
    from draftsmith.runtime.tree import TreeShape
    from draftsmith.eval.prompts import load_prompts
    from draftsmith.models.loading import STOP_HEADS, native_config_path, tuned_key, tuned_settings
    from draftsmith.runtime.loading import load_proposer, load_stop_head
    from draftsmith.models.target import load_target
    from draftsmith.runtime.runner import TargetRunner
    from draftsmith.runtime.policies import PolicySettings, policy_kind
    from draftsmith.runtime.proposers import NoProposer
    from draftsmith.runtime.sampling import SamplingConfig
    from draftsmith.eval.profile import profile_names
    from draftsmith.runtime.loading import export_kind

    profiles = profile_names(args.profiles)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = load_target(args.target, dtype=args.dtype)
    proposer, description = load_proposer(args.drafter, target, args.head_vocab)
    heads = {kind: load_stop_head(args.drafter, policy_kind(kind), target, proposer) for kind in ("specdec", "disco")}
    section = json.loads(native_config_path(args.drafter).read_text()).get(STOP_HEADS, {})
    roc = section.get("confidence", {}).get("tuned", {}).get("greedy", {}).get("threshold")
    if roc is None:
        raise SystemExit(f"{args.drafter} has no ROC-tuned confidence threshold: draftsmith tune --policy confidence --labels ...")
    runner = TargetRunner(target.model, proposer.aux_layer_ids)
    plain = NoProposer(target.vocab_size)
    eos = target.eos_token_ids

    def encode(prompts):
        return [target.encode_chat([{"role": "user", "content": p["turns"][0]}]) for p in prompts]

    def tuned(kind: str, mode: str, profile: str | None = None) -> tuple[float, int]:
        tried = heads[kind][1].get("tuned", {})
        if args.tree and not any(tuned_key(greedy, True) in tried for greedy in (True, False)):
            raise SystemExit(f"the {kind} head in {args.drafter} is not tuned for trees: "
                             f"draftsmith tune --policy {kind} --tree {args.tree} ...")
        chosen = tuned_settings(heads[kind][1], mode == "greedy", tree=args.tree is not None, profile=profile)
        if chosen is None:
            raise SystemExit(f"the {kind} head in {args.drafter} is not tuned{' for ' + profile if profile else ''}: "
                             f"draftsmith tune --policy {kind} {'--cost_profile ' + profile if profile else ''} ...")
        return chosen

    shape = TreeShape.parse(args.tree)
    static = STATIC if shape is None else [f"tree{d}" for d in range(1, shape.depth + 1)]

    def head_arm(kind: str, mode: str, profile: str | None = None) -> tuple:
        threshold, k = tuned(kind, mode, profile)
        k = min(k, shape.depth) if shape is not None else k  # a tree round drafts at most its depth, as in eval
        return proposer, build(kind, head=heads[kind][0], threshold=threshold, k=k, tree=shape is not None), shape

    def profile_arms(mode: str) -> dict:
        """The heads at the thresholds tuned for each profile, where they differ from the plain arms'."""
        arms = {}
        for kind in ("specdec", "disco"):
            plain = tuned(kind, mode)
            for name in profiles:
                if tuned(kind, mode, name) != plain:
                    arms[f"{kind}@{name}"] = head_arm(kind, mode, name)
        return arms

    def build(name: str, **settings):
        """The registry's prompt → fresh policy function (a run's cost policies share one meter)."""
        return policy_kind(name).build(PolicySettings(**settings))

    def factories(mode: str, references) -> dict:
        """arm → (proposer, prompt → fresh policy, tree shape or None for chains)."""
        arms = {"autoregressive": (plain, build("static", k=0), None)}
        if shape is not None:  # the fixed trees, then the policies that size each round's
            for d in range(1, shape.depth + 1):
                arms[f"tree{d}"] = (proposer, build("static", k=0), replace(shape, depth=d))
            arms.update({"cost": (proposer, build("cost", tree=True), shape),
                         "specdec": head_arm("specdec", mode), "disco": head_arm("disco", mode), **profile_arms(mode)})
            return arms
        for k in range(1, 9):
            arms[f"static{k}"] = (proposer, build("static", k=k), None)
        arms.update({
            "heuristic": (proposer, build("heuristic", k=5), None),
            "confidence": (proposer, build("confidence", threshold=0.4, k=8), None),
            "confidence_roc": (proposer, build("confidence", threshold=roc, k=8), None),
            "cost": (proposer, build("cost", k=8), None),
            "specdec": head_arm("specdec", mode), "disco": head_arm("disco", mode), **profile_arms(mode),
        })
        if references is not None:
            arms["oracle"] = (proposer, build("oracle", references=references, k=8), None)
        return arms

    def run_arms(arms: dict, ids, sampling) -> dict:
        """Every arm on every prompt, the arms alternating prompt by prompt (a drift in the machine's speed
        falls on all of them alike), `repeats` passes after a warm-up; per-arm figures."""
        for name, (prop, make, tree) in arms.items():
            decode_all(runner, prop, ids[:1], 8, make, sampling, eos, 0, tree=tree)
        results = {name: [[] for _ in range(args.repeats)] for name in arms}
        for r in range(args.repeats):
            for i, x in enumerate(ids):
                for name, (prop, make, tree) in arms.items():
                    results[name][r] += decode_all(runner, prop, [x], args.max_new_tokens, make, sampling, eos, 1000 * r + i,
                                                   tree=tree)
            print(f"  pass {r + 1}: " + ", ".join(f"{n} {rate(v[r]):.2f}" for n, v in results.items()), flush=True)
        figures = {}
        for name, passes in results.items():
            stats = acceptance_stats(passes[0])
            committed = max(stats.get("tokens", 0) - len(ids), 1)  # tokens after each prefill's first
            figures[name] = {"tokens_per_second": statistics.median(rate(p) for p in passes), "tau": stats["tau"],
                             "rejected_per_token": stats.get("drafted_rejected", 0) / committed,
                             "target_forwards_per_token": stats.get("target_forwards_per_token", 1.0),
                             "mean_drafted": stats.get("drafted", 0) / max(stats["rounds"], 1)}
        ar = figures["autoregressive"]["tokens_per_second"]
        for f in figures.values():
            f["speedup"] = f["tokens_per_second"] / ar
        for name, speedups in modelled(results, profiles).items():
            figures[name]["modelled"] = speedups
        return figures

    priced: dict[str, Any] = {}  # profile name → CostProfile (measured: timed once, on the first arms run)

    def modelled(results: dict, names: list[str]) -> dict[str, dict[str, float | None]]:
        """arm → profile → the speedup its first pass's rounds model under that profile (None: it has no cost
        for this drafter's kind)."""
        from draftsmith import DraftsmithError
        from draftsmith.eval.machine import cpu_name
        from draftsmith.eval.profile import modelled_speedup, profile_for

        drafted = [g for name, passes in results.items() if name != "autoregressive" for g in passes[0]]
        out: dict[str, dict[str, float | None]] = {name: {} for name in results}
        for p in names:
            if p not in priced:
                priced[p] = profile_for(p, runner, drafted, kind, f"{cpu_name()}, {args.dtype}",
                                        alone=results["autoregressive"][0])
            for name, passes in results.items():
                try:
                    out[name][p] = modelled_speedup(priced[p], passes[0], kind)["speedup"]
                except DraftsmithError:
                    out[name][p] = None
        return out

    kind = export_kind(args.drafter)
    report, keys = {"drafter": description, "head_settings": {}}, {}
    for temperature in args.temperatures:
        sampling = SamplingConfig(temperature)
        mode = "greedy" if temperature == 0 else "sampling"
        tag = "" if temperature == 0 else f"_t{temperature:g}"
        report["head_settings"][mode] = {"specdec": tuned("specdec", mode), "disco": tuned("disco", mode), "confidence_roc": roc}
        val_ids = encode(load_prompts("heldout", args.val_limit, "first", args.data, data_limit=args.data_limit))
        print(f"T={temperature:g}: choosing the best static {'depth' if shape else 'K'} on {len(val_ids)} held-out prompts",
              flush=True)
        static_arms = {k: v for k, v in factories(mode, None).items() if k in static or k == "autoregressive"}
        val = run_arms(static_arms, val_ids, sampling)
        best = max(static, key=lambda k: val[k]["tokens_per_second"])
        best_under = {p: max(static, key=lambda k: val[k]["modelled"][p] or 0) for p in profiles}
        report[f"validation{tag}"] = {"figures": val, "best_static": best, "best_static_modelled": best_under}
        print(f"  best static: {best}" + "".join(f"; under {p}: {b}" for p, b in best_under.items()), flush=True)
        for name in args.sets if temperature == 0 else args.t1_sets:
            ids = encode(load_prompts(name, args.humaneval_limit if name == "humaneval" else args.limit))
            print(f"T={temperature:g} {name}: {len(ids)} prompts x {args.max_new_tokens} tokens", flush=True)
            references = (oracle_references(runner, proposer, ids, args.max_new_tokens, 8, eos)
                          if temperature == 0 and shape is None else None)
            figures = run_arms(factories(mode, references), ids, sampling)
            base = figures[best]["tokens_per_second"]
            for f in figures.values():
                f["ratio_to_best_static"] = f["tokens_per_second"] / base
            report[f"{name}{tag}"] = {"figures": figures, "best_static": best, "best_static_modelled": best_under}
            set_tag = "" if name == "mtbench" else f"_{name}"
            for arm in ("specdec", "disco", "cost", "oracle"):
                if arm in figures:
                    keys[f"ratio_{arm}{tag}{set_tag}{args.suffix}"] = round(figures[arm]["ratio_to_best_static"], 3)
            keys[f"best_static{tag}{set_tag}{args.suffix}"] = best
            print_table(name, temperature, figures, best)
            for p, chosen in best_under.items():
                ratios = modelled_ratios(figures, chosen, p)
                report[f"{name}{tag}"].setdefault("modelled_ratio", {})[p] = ratios
                for arm in ("specdec", "disco", "cost", "oracle"):
                    if ratios.get(arm) is not None:
                        keys[f"ratio_{arm}{tag}{set_tag}{args.suffix}_{p.replace('-', '_')}"] = round(ratios[arm], 3)
                print_modelled(name, temperature, p, figures, chosen, ratios)
            if figures.get("oracle", {}).get("rejected_per_token", 0) > 0:
                print(f"  note: the oracle rejected {figures['oracle']['rejected_per_token']:.3f} tokens per token: what it "
                      "knows in advance (the target's greedy text, the drafter's chains over it) came from forwards of "
                      f"other widths than decoding's, and in {args.dtype} their rounding differs, so decoding left that "
                      "text at a near-tie; here it is not a bound (run --dtype float32 for one)", flush=True)
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    speedup_plot(report, out / "dynamic_length.png")
    if args.labels:
        calibration_plot(args.labels, heads, out / "calibration.png")
    print_result(keys)


def modelled_ratios(figures: dict, best: str, profile: str) -> dict[str, float | None]:
    """arm → its modelled speedup under `profile` ÷ the best static arm's (chosen on held-out prompts); the
    heads at the thresholds tuned for that profile where the run has them (`specdec@NAME`)."""
    base = figures[best]["modelled"].get(profile)
    out = {}
    for arm, f in figures.items():
        if "@" in arm:
            continue
        chosen = figures.get(f"{arm}@{profile}", f)["modelled"].get(profile)
        out[arm] = chosen / base if chosen is not None and base else None
    return out


def print_modelled(name: str, temperature: float, profile: str, figures: dict, best: str, ratios: dict) -> None:
    print(f"{name} T={temperature:g} modelled under {profile} (best static: {best})")
    for arm, ratio in ratios.items():
        speedup = figures.get(f"{arm}@{profile}", figures[arm])["modelled"].get(profile)
        if speedup is not None:
            print(f"  {arm:<15}{speedup:>8.3f}x{ratio:>8.3f}")


def rate(results) -> float:
    return sum(len(x.tokens) for x in results) / sum(x.seconds for x in results)


def print_table(name: str, temperature: float, figures: dict, best: str) -> None:
    print(f"{name} T={temperature:g} (best static: {best})")
    print(f"  {'arm':<15}{'tok/s':>8}{'speedup':>9}{'ratio':>7}{'tau':>7}{'rej/tok':>9}{'fwd/tok':>9}{'drafted':>9}")
    for arm, f in figures.items():
        print(f"  {arm:<15}{f['tokens_per_second']:>8.2f}{f['speedup']:>9.3f}{f.get('ratio_to_best_static', 0):>7.3f}"
              f"{f['tau']:>7.2f}{f['rejected_per_token']:>9.3f}{f['target_forwards_per_token']:>9.3f}{f['mean_drafted']:>9.2f}")


def speedup_plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k, v in report.items() if isinstance(v, dict) and "figures" in v and not k.startswith("validation")]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        figures, best = report[panel]["figures"], report[panel]["best_static"]
        arms = [a for a in figures if a != "autoregressive"]
        colors = ["tab:gray" if a.startswith(("static", "tree")) and a != best else "tab:blue" if a == best else "tab:orange"
                  for a in arms]
        ax.bar(arms, [figures[a]["speedup"] for a in arms], color=colors)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_title(f"{panel}: speedup over autoregressive (blue: the best static arm)")
        ax.tick_params(axis="x", rotation=70)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def calibration_plot(labels: str, heads: dict, path: Path) -> None:
    """Reliability diagram of each head on the labels' validation chats (10 equal-width bins)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from draftsmith.data.conversations import split_of
    from draftsmith.data.labels import read_labels
    from draftsmith.models.heads import stored_inputs

    _, rows, ids, chat_of = read_labels(labels)
    val = torch.tensor([split_of(i, 0.1) == "val" for i in ids], dtype=torch.bool)[chat_of]
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], color="black", lw=0.8)
    for kind, (head, section) in heads.items():
        with torch.no_grad():
            prob = head.float().probability(*stored_inputs(head, {k: v[val] for k, v in rows.items()}))
        label = rows[section.get("label", "soft")][val].float()
        bins = torch.clamp((prob * 10).long(), max=9)
        xs, ys = [], []
        for b in range(10):
            sel = bins == b
            if sel.sum() >= 20:
                xs.append(float(prob[sel].mean()))
                ys.append(float(label[sel].mean()))
        ax.plot(xs, ys, marker="o", label=f"{kind} ({section.get('label')} label)")
    ax.set_xlabel("predicted acceptance")
    ax.set_ylabel("observed acceptance")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
