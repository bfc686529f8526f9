"""The drafter kinds against each other: the same features, the same training wall time, one run.

Six arms train on the eagle3-cpu recipe's features (2,400 chats, runs/smollm2-135m/features-sharegpt-2400,
extracted first when missing): eagle3 (recipes/smollm2-135m/eagle3-cpu.yaml as it is), eagle31 (the same
with EAGLE-3.1's fc_norm and norm_output), eagle3_lk (the same drafter trained on the log
acceptance-direct loss −log α alone, no cross-entropy: of the three forms the one that raised the T = 1
estimate most in 400-step trials, docs/benchmarks.md), peagle, dflash and dspark (their -cpu recipes). Every
arm gets the same wall time (`--minutes`, default the eagle3-cpu recipe's 19-minute budget) as its only
bound (`--trainer.max_time`, no step count), so its cosine schedule runs over that time and ends with
it whatever a step costs on this machine. Each arm then reports its validation τ̂ (val/tau: the greedy
chain of its trained length, or its block) and decodes the same MT-bench first turns (`--prompts`,
128 tokens each) in this process, the target's dtype chosen once (`--dtype auto`):

- greedy and T = 1 chains at the kind's length (eagle3 family 3, P-EAGLE 4, DFlash 7, DSpark 8), greedy
  chains sized by measured cost up to that length (`eval`'s default policy: a kind whose later tokens are
  rarely accepted verifies fewer), and greedy trees within `--tree`, sized by cost as well (EAGLE-2's
  for the eagle3 family; P-EAGLE's and the block drafters' grown from their one forward, P-EAGLE's no
  deeper than the 4 steps it trains, a block's no deeper than its slots);
- DSpark also with its confidence policy, its threshold tuned by `draftsmith tune --policy dspark` on
  held-out chats (never the benchmark's prompts), decoded beside its fixed block in `--passes` back-to-back
  pairs (which of the two goes first alternating, `harness.alternate`), so that the two share each pass's machine speed;
- autoregressive decoding of the same prompts before and after the arms (their mean is the baseline).

Per decode: τ, the drafter's milliseconds per round, a round's cost in target steps (round time ÷ the
autoregressive step time), tokens/s and the speedup. `ratio_<kind>` = the kind's best greedy speedup
÷ eagle3's. A plot of τ and speedup by kind goes to `--out`/drafter_kinds.png.

    python benchmarks/drafter_kinds.py [--minutes 20] [--prompts 20] [--kinds eagle3,dflash,...]
    python benchmarks/drafter_kinds.py --kinds eagle3 --lever NAME='OVERRIDES' [--lever ...] [--train_only]

`--lever` adds an arm of the eagle3-cpu recipe with `draftsmith fit` overrides (a lever: one setting changed,
the same budget), trained and decoded like the others (with `--kinds ''` the lever arms alone, against an
eagle3 arm measured before); `--train_only` stops after training and reports each arm's validation alone
(`RESULT val_tau_<arm>=... val_tau_t1_<arm>=... steps_<arm>=...`).

Ends with `RESULT tau_eagle3=... tau_dflash=... tau_dspark=... tau_peagle=... ratio_dflash=...
ratio_dspark=... ratio_peagle=... ratio_eagle3_lk=... tau_t1_eagle3_lk=... tau_t1_eagle3=...
ratio_dspark_confidence=...` (tau_*: greedy chains; ratio_dspark_confidence: the confidence policy's
tokens/s ÷ the fixed block's, the median of the passes' pairs; the ratio_<kind> keys only when the arms
include eagle3). Trained arms are kept under
`--out`/<arm>: a rerun with the same settings and recipe files reuses them, unless the module the code
builds now has other options than the checkpoint's (an option added or removed since: it trains again).
"""

from __future__ import annotations

import json
import re
import shlex
import time
from dataclasses import replace
from pathlib import Path

from harness import alternate, kept_arm, machine, parser, print_result

ROOT = Path(__file__).resolve().parents[1]
EAGLE3 = "recipes/smollm2-135m/eagle3-cpu.yaml"
ARMS = {  # arm: (recipe, overrides, chain length, deepest tree: None for --tree's depth)
    "eagle3": (EAGLE3, (), 3, None),
    "eagle31": (EAGLE3, ("--model.init_args.fc_norm", "true", "--model.init_args.norm_output", "true"), 3, None),
    "eagle3_lk": (EAGLE3, ("--model.init_args.ce_weight", "0.0", "--model.init_args.acceptance_weight", "1.0",
                           "--model.init_args.acceptance_loss", "log"), 3, None),
    "peagle": ("recipes/smollm2-135m/peagle-cpu.yaml", (), 4, 4),
    "dflash": ("recipes/smollm2-135m/dflash-cpu.yaml", (), 7, None),
    "dspark": ("recipes/smollm2-135m/dspark-cpu.yaml", (), 8, None),
}


def lever_arms(specs: list[str]) -> dict[str, tuple]:
    """`--lever NAME=OVERRIDES` → {NAME: an eagle3-cpu arm with those `draftsmith fit` overrides}; a malformed
    one stops the script before it extracts or trains."""
    arms = {}
    for spec in specs:
        name, eq, text = spec.partition("=")
        overrides = tuple(shlex.split(text))
        problem = None
        if not eq:
            problem = "expected NAME=OVERRIDES"
        elif not re.fullmatch(r"[a-z][a-z0-9_]*", name):
            problem = f"{name!r} is not a lower-case name (letters, digits, _)"
        elif name in ARMS or name in arms:
            problem = f"{name} is already an arm"
        elif not overrides or not overrides[0].startswith("--"):
            problem = "the overrides must start with an option (--section.name VALUE)"
        if problem:
            raise SystemExit(f"--lever {spec}: {problem}")
        arms[name] = (EAGLE3, overrides, *ARMS["eagle3"][2:])  # eagle3's chain length and trees
    return arms


def build(recipe: str, overrides: tuple[str, ...], out: Path, minutes: float):
    """The arm's LightningCLI, bounded by `minutes` of wall time alone (no step count)."""
    from draftsmith.train.cli import lightning_cli

    whole = int(minutes * 60)  # Lightning's DD:HH:MM:SS
    args = ["--config", str(ROOT / recipe), "--trainer.max_steps", "-1", "--trainer.default_root_dir", str(out),
            "--trainer.logger", "false", "--trainer.callbacks", "[]", "--trainer.enable_checkpointing", "false",
            "--trainer.val_check_interval", str(10**9), "--trainer.enable_progress_bar", "false", *overrides,
            "--trainer.max_time", f"00:{whole // 3600:02d}:{whole // 60 % 60:02d}:{whole % 60:02d}"]
    return lightning_cli(args, run=False)


def train_arm(name: str, minutes: float, out: Path) -> tuple[object, dict]:
    """Train arm `name` for `minutes` of wall time (reused when trained before with the same settings)."""
    recipe, overrides, _, _ = ARMS[name]
    out.mkdir(parents=True, exist_ok=True)
    done, record = out / "trained.ckpt", out / "arm.json"
    cli = build(recipe, overrides, out, minutes=minutes)
    key, kept = kept_arm(done, record, ROOT / recipe, options=dict(cli.model.hparams), recipe=recipe,
                         overrides=list(overrides), minutes=minutes)
    if kept is not None:
        print(f"{name}: reusing the arm trained earlier ({done})", flush=True)
        # restored at the step it stopped at, as a run of that many steps (the bound Lightning's own learning-rate
        # finder sets): fit returns without a step
        cli.trainer.fit_loop.epoch_loop.max_steps = kept["trained_steps"]
        cli.trainer.fit(cli.model, cli.datamodule, ckpt_path=done, weights_only=True)
        if cli.trainer.global_step != kept["trained_steps"]:
            raise RuntimeError(f"{name}: the kept arm restored at step {cli.trainer.global_step}, "
                               f"not the {kept['trained_steps']} it trained")
        info = kept
    else:  # the arm kept before is not this one: drop it and its log first, so a killed run leaves no stale pair
        for stale in (done, record, out / "train.log"):
            stale.unlink(missing_ok=True)
        start = time.perf_counter()
        cli.trainer.fit(cli.model, cli.datamodule)
        seconds = time.perf_counter() - start
        info = {"key": key, "trained_steps": cli.trainer.global_step, "seconds": seconds,
                "seconds_per_step": seconds / max(cli.trainer.global_step, 1)}
        cli.trainer.save_checkpoint(done, weights_only=False)
        record.write_text(json.dumps(info))
    # fit validates once as its time runs out (Lightning's stop check); a kept arm's fit takes no step
    metrics = {k: float(v) for k, v in cli.trainer.callback_metrics.items() if k.startswith("val/")}
    if kept is not None or "val/tau" not in metrics:
        metrics = cli.trainer.validate(cli.model, cli.datamodule, verbose=False)[0]
    info = {**info, "val_tau": metrics["val/tau"], "val_tau_t1": metrics["val/tau_t1"],
            **{key.removeprefix("val/"): metrics[key] for key in ("val/confidence_auroc", "val/confidence_ece")
               if key in metrics}}
    print(f"{name}: {info['trained_steps']} steps in {info['seconds']:.0f} s, val tau {info['val_tau']:.3f} "
          f"(T=1 {info['val_tau_t1']:.3f})", flush=True)
    return cli.model, info


def timed(proposer: object) -> list[float]:
    """Wrap the proposer's propose (and tree drafting) to record each call's seconds."""
    spent: list[float] = []
    for method in ("propose", "propose_tree"):
        inner = getattr(proposer, method, None)
        if inner is None:
            continue

        def wrapper(*a, _inner=inner, **k):
            start = time.perf_counter()
            try:
                return _inner(*a, **k)
            finally:
                spent.append(time.perf_counter() - start)
        setattr(proposer, method, wrapper)
    return spent


def decode(runner, proposer, prompts, policy, sampling, eos, tree=None) -> dict:
    from draftsmith.eval.acceptance import acceptance_stats, decode_all

    spent = timed(proposer)
    start = time.perf_counter()
    results = decode_all(runner, proposer, prompts, 128, lambda _: policy(), sampling, eos, seed=0, tree=tree)
    seconds = time.perf_counter() - start
    stats = acceptance_stats(results)
    rounds = sum(len(r.rounds) for r in results)
    tokens = sum(len(r.tokens) for r in results)
    return {"tau": stats["tau"], "alpha": stats["alpha"], "tokens_per_second": tokens / seconds,
            "seconds_per_round": seconds / max(rounds, 1), "drafter_ms": 1e3 * sum(spent) / max(len(spent), 1)}


def confidence_pairs(name: str, out: Path, k: int, args, decode_with) -> dict:
    """The arm's confidence policy, its threshold tuned by `draftsmith tune --policy dspark` on held-out chats,
    decoded beside its fixed block in `args.passes` back-to-back pairs: the median pair's tokens/s ratio."""
    from draftsmith.eval.tune import TuneConfig, tune
    from draftsmith.export import export
    from draftsmith.runtime.policies import BlockConfidence, Static

    native = out / "native"
    export(str(out / "trained.ckpt"), "native", str(native))
    chosen = tune(TuneConfig(target="embedded:smollm2-135m-instruct", drafter=str(native), policy="dspark",
                             ks=[k], limit=4, repeats=1, max_new_tokens=64, dtype=args.dtype))
    confidence = lambda: BlockConfidence(threshold=chosen["threshold"], k=k)  # noqa: E731
    runs = alternate({"fixed": lambda: decode_with(lambda: Static(k)), "confidence": lambda: decode_with(confidence)},
                     args.passes)  # each pass's two decodes back to back
    ratios = [c["tokens_per_second"] / f["tokens_per_second"] for f, c in zip(runs["fixed"], runs["confidence"])]
    middle = sorted(range(len(ratios)), key=ratios.__getitem__)[len(ratios) // 2]
    print(f"{name}: confidence policy (threshold {chosen['threshold']}) ÷ fixed block, tokens/s by pass: "
          + ", ".join(f"{r:.3f}" for r in ratios), flush=True)
    return {"confidence_threshold": chosen["threshold"], "confidence": runs["confidence"][middle],
            "confidence_ratio": ratios[middle], "confidence_ratios": ratios}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--minutes", type=float, default=19.0, help="training wall time per arm")
    ap.add_argument("--prompts", type=int, default=20, help="MT-bench first turns decoded (128 tokens each)")
    ap.add_argument("--kinds", default=",".join(ARMS),
                    help="the arms, comma-separated (may be empty with --lever: the lever arms alone)")
    ap.add_argument("--passes", type=int, default=3,
                    help="DSpark's fixed block and confidence policy decoded back to back this many times")
    ap.add_argument("--tree", default="6,8,32", help="DEPTH,TOPK,TOKENS: the largest tree decoded (cost policy)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench" / "drafter_kinds"))
    ap.add_argument("--lever", action="append", default=[], metavar="NAME=OVERRIDES",
                    help="an extra eagle3-cpu arm trained with these fit overrides, e.g. "
                         "min_lr='--model.init_args.min_lr_ratio 0.0' (repeatable)")
    ap.add_argument("--train_only", action="store_true", help="report each arm's validation and stop before decoding")
    args = ap.parse_args()
    named = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in named if k not in ARMS]
    if unknown or not (named or args.lever):
        raise SystemExit(f"--kinds: {', '.join(unknown) or 'no arm named'}; the arms are {', '.join(ARMS)}")
    levers = lever_arms(args.lever)
    ARMS.update(levers)
    arms = [k for k in ARMS if k in named or k in levers]
    import copy

    from rich.console import Console

    from draftsmith.eval.prompts import first_turn_ids
    from draftsmith.models.target import load_target
    from draftsmith.pipeline import ensure_features
    from draftsmith.runtime.cost import CostAware, CostMeter, TreeCost, TreeCostMeter
    from draftsmith.runtime.policies import Static
    from draftsmith.runtime.loading import feature_proposer
    from draftsmith.runtime.proposers import NoProposer
    from draftsmith.runtime.runner import TargetRunner
    from draftsmith.runtime.sampling import SamplingConfig
    from draftsmith.runtime.tree import TreeShape

    out = Path(args.out)
    ensure_features(ROOT / EAGLE3, Console(stderr=True), "extract for the drafter kinds")
    trained = {name: train_arm(name, args.minutes, out / name) for name in arms}
    if args.train_only:
        keys = {}
        for name, (_, info) in trained.items():
            keys |= {f"val_tau_{name}": f"{info['val_tau']:.3f}", f"val_tau_t1_{name}": f"{info['val_tau_t1']:.3f}",
                     f"steps_{name}": info["trained_steps"]}
        print_result(keys | {"minutes": f"{args.minutes:g}"})
        return

    target = load_target("embedded:smollm2-135m-instruct", dtype=args.dtype)
    prompts = first_turn_ids(target, "mtbench", args.prompts)
    eos = target.eos_token_ids
    greedy, t1 = SamplingConfig(), SamplingConfig(temperature=1.0)
    plain = NoProposer(target.vocab_size)
    base_runner = TargetRunner(target.model, [])
    baseline = [decode(base_runner, plain, prompts, lambda: Static(0), greedy, eos)]
    rows: dict[str, dict] = {}
    for name in arms:
        module, info = trained[name]
        _, _, k, deepest = ARMS[name]
        drafter = copy.deepcopy(module.drafter).to(dtype=target.dtype).eval()
        make = lambda: feature_proposer(module.kind, drafter, target.vocab_size, module.aux_layer_ids)  # noqa: E731
        runner = TargetRunner(target.model, module.aux_layer_ids)
        row = {"val_tau": info["val_tau"], "val_tau_t1": info["val_tau_t1"], "steps": info["trained_steps"],
               "chain": decode(runner, make(), prompts, lambda: Static(k), greedy, eos),
               "chain_t1": decode(runner, make(), prompts, lambda: Static(k), t1, eos)}
        chain_meter = CostMeter()  # chains sized by cost, one meter for the arm's prompts, as `eval` shares one
        row["chain_cost"] = decode(runner, make(), prompts, lambda: CostAware(k=k, meter=chain_meter), greedy, eos)
        shape, tree_meter = TreeShape.parse(args.tree), TreeCostMeter()  # sized by measured cost, as `eval` does
        shape = replace(shape, depth=min(shape.depth, deepest or shape.depth))
        row["tree"] = decode(runner, make(), prompts, lambda: TreeCost(meter=tree_meter), greedy, eos, tree=shape)
        if getattr(module.drafter, "confidence_head", None) is not None:  # DSpark's, tuned on held-out chats
            row |= confidence_pairs(name, out / name, k, args,
                                    lambda policy: decode(runner, make(), prompts, policy, greedy, eos))
        rows[name] = row
        print(f"{name}: " + "; ".join(f"{mode} tau {r['tau']:.3f}, {r['tokens_per_second']:.1f} tok/s, drafter "
                                      f"{r['drafter_ms']:.1f} ms a round" for mode, r in row.items() if isinstance(r, dict)),
              flush=True)
    baseline.append(decode(base_runner, plain, prompts, lambda: Static(0), greedy, eos))
    ar_tps = sum(b["tokens_per_second"] for b in baseline) / len(baseline)
    ar_step = sum(b["seconds_per_round"] for b in baseline) / len(baseline)
    for row in rows.values():
        for r in row.values():
            if isinstance(r, dict):
                r["speedup"] = r["tokens_per_second"] / ar_tps
                r["round_cost"] = r["seconds_per_round"] / ar_step
    best = {name: max(r["speedup"] for mode, r in row.items() if isinstance(r, dict) and mode != "chain_t1")
            for name, row in rows.items()}
    (out / "results.json").write_text(json.dumps({"rows": rows, "autoregressive": baseline, "machine": machine(),
                                                  "minutes": args.minutes, "dtype": target.dtype_name}, indent=2))
    print(f"autoregressive: {ar_tps:.1f} tok/s ({target.dtype_name}, {machine()})")
    for name, row in rows.items():
        for mode, r in row.items():
            if isinstance(r, dict):
                print(f"{name:10s} {mode:10s} tau {r['tau']:.3f}  {r['tokens_per_second']:6.1f} tok/s  "
                      f"speedup {r['speedup']:.2f}x  round {r['round_cost']:.2f} target steps  "
                      f"drafter {r['drafter_ms']:.1f} ms")
    plot(rows, out / "drafter_kinds.png")
    keys = {f"tau_{n}": f"{rows[n]['chain']['tau']:.3f}" for n in rows}
    keys |= {f"ratio_{n}": f"{best[n] / best['eagle3']:.3f}" for n in rows if n != "eagle3" and "eagle3" in rows}
    keys |= {f"tau_t1_{n}": f"{rows[n]['chain_t1']['tau']:.3f}" for n in ("eagle3_lk", "eagle3") if n in rows}
    keys |= {f"ratio_{n}_confidence": f"{row['confidence_ratio']:.3f}" for n, row in rows.items()
             if "confidence_ratio" in row}
    keys["minutes"] = f"{args.minutes:g}"
    print("RESULT " + " ".join(f"{k}={v}" for k, v in keys.items()))


def plot(rows: dict, path: Path) -> None:
    """τ and speedup by kind, one bar per decode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = ["chain", "chain_t1", "chain_cost", "tree", "confidence"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = list(rows)
    for ax, key, title in ((axes[0], "tau", "acceptance length τ"), (axes[1], "speedup", "speedup over autoregressive")):
        width = 0.8 / len(modes)
        for i, mode in enumerate(modes):
            values = [rows[n][mode][key] if mode in rows[n] else 0 for n in names]
            ax.bar([x + i * width for x in range(len(names))], values, width, label=mode)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(names))], names)
        ax.set_title(title)
    axes[1].axhline(1.0, color="grey", linestyle="--", linewidth=1)  # break-even with autoregressive decoding
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=len(modes), frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
