"""τ and wall-clock speedup of a drafter on MT-bench, greedy and temperature 1, one run.

    python benchmarks/speedup.py [--drafter DIR] [--limit 80] [--max-new-tokens 256] [--k 4]

DIR is a native export (default: the hass-cpu-full recipe's, written by
`draftsmith run recipes/smollm2-135m/hass-cpu-full.yaml`). Both arms use the same dtype.
Ends with `RESULT tau=... speedup=... tau_t1=... speedup_t1=...`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default=str(ROOT / "runs/smollm2-135m/hass-cpu-full/export-native"))
    ap.add_argument("--limit", type=int, default=80)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--policy", default="static")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from draftsmith.eval.evaluate import EvalConfig, evaluate

    if not (Path(args.drafter) / "config.json").is_file():
        raise SystemExit(f"no drafter export at {args.drafter}: run `draftsmith run RECIPE` or `draftsmith export`")
    figures = {}
    for label, temperature in (("greedy", 0.0), ("t1", 1.0)):
        cfg = EvalConfig(target="embedded:smollm2-135m-instruct", drafter=args.drafter, prompts="mtbench",
                         limit=args.limit, max_new_tokens=args.max_new_tokens, temperature=temperature,
                         policy=args.policy, k=args.k, dtype=args.dtype, repeats=args.repeats,
                         out=str(ROOT / "runs" / "bench-speedup" / label))
        r = evaluate(cfg)
        figures[label] = r
        s = r["speed"]
        print(f"{label}: tau {r['acceptance']['tau']:.2f}, alpha {[round(a, 2) for a in r['acceptance']['alpha'] if a]}, "
              f"{s['method']['tokens_per_second']:.1f} vs {s['autoregressive']['tokens_per_second']:.1f} tok/s, "
              f"speedup {s['speedup']:.2f}x", flush=True)
    g, t = figures["greedy"], figures["t1"]
    print(f"RESULT tau={g['acceptance']['tau']:.3f} speedup={g['speed']['speedup']:.3f} "
          f"tau_t1={t['acceptance']['tau']:.3f} speedup_t1={t['speed']['speedup']:.3f}")


if __name__ == "__main__":
    main()
