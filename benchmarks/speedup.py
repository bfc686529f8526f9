"""τ and wall-clock speedup of a drafter on MT-bench, greedy and temperature 1, one run.

    python benchmarks/speedup.py [--drafter DIR] [--limit 80] [--max_new_tokens 256]
                                 [--tree 6,8,32 | --tree chain --k 4] [--policy cost|static] [--lookup 6]
                                 [--temperatures 0,1] [--repeats 1]

DIR is a native export (default: the hass-cpu-full recipe's, written by
`draftsmith run recipes/smollm2-135m/hass-cpu-full.yaml`). Both arms use the same dtype.
Drafts EAGLE-2 dynamic trees of at most depth 6, top-8 and 32 nodes, each round's tree sized by the
`cost` policy (measured verification and drafting cost against the drafter's calibrated path
probabilities), with a prompt-lookup branch of up to 6 tokens priced the same way; `--policy static`
keeps EAGLE-2's fixed tree of the given shape (e.g. `--tree 4,4,12`), `--lookup 0` drafts with the
drafter alone, `--tree chain` drafts chains of `--k`. One run means one pass of each arm over the
prompts (`--repeats 1`): 80 prompts x 256 tokens already average ~20k tokens per arm. Ends with
`RESULT tau=... speedup=...` (and `tau_t1=... speedup_t1=...` when temperature 1 is run).
"""

from __future__ import annotations

from pathlib import Path

from harness import parser, print_result

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--drafter", default=str(ROOT / "runs/smollm2-135m/hass-cpu-full/export-native"))
    ap.add_argument("--limit", type=int, default=80)
    ap.add_argument("--max_new_tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--tree", default="6,8,32", help="DEPTH,TOPK,TOKENS, or 'chain'")
    ap.add_argument("--lookup", type=int, default=6,
                    help="a prompt-lookup branch of up to N tokens on every tree (0: off)")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--policy", default="cost", help="cost: size each tree by measured cost; static: the fixed tree")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    from draftsmith.eval.evaluate import EvalConfig, evaluate

    if not (Path(args.drafter) / "config.json").is_file():
        raise SystemExit(f"no drafter export at {args.drafter}: run `draftsmith run RECIPE` or `draftsmith export`")
    figures = {}
    for temperature in (float(t) for t in args.temperatures.split(",")):
        label = "greedy" if temperature == 0 else f"t{temperature:g}"
        cfg = EvalConfig(target="embedded:smollm2-135m-instruct", drafter=args.drafter, prompts="mtbench",
                         limit=args.limit, max_new_tokens=args.max_new_tokens, temperature=temperature,
                         policy=args.policy, k=args.k, tree=None if args.tree == "chain" else args.tree,
                         lookup=args.lookup, dtype=args.dtype, repeats=args.repeats,
                         out=str(ROOT / "runs" / "bench-speedup" / label))
        r = evaluate(cfg)
        figures[label] = r
        s = r["speed"]
        alpha = [round(a, 2) for a in r['acceptance']['alpha'] if a]
        print(f"{label}: tau {r['acceptance']['tau']:.2f}, alpha {alpha}, "
              f"{s['method']['tokens_per_second']:.1f} vs {s['autoregressive']['tokens_per_second']:.1f} tok/s, "
              f"speedup {s['speedup']:.2f}x, identical outputs {r['identical_outputs']}", flush=True)
    parts = []
    for label, r in figures.items():
        suffix = "" if label == "greedy" else f"_{label}"
        parts += [f"tau{suffix}={r['acceptance']['tau']:.3f}", f"speedup{suffix}={r['speed']['speedup']:.3f}"]
    print_result(" ".join(parts))


if __name__ == "__main__":
    main()
