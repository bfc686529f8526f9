"""Does a cost profile predict the speedup? The speedup `draftsmith eval` times against the one it models
under this machine's `measured` profile (the run's rounds as counted — rows verified, drafter forwards —
priced by the target's timed forwards over 1..64 rows and the rounds' drafting seconds a forward), for
several drafters and decoding shapes, and the same rounds under the shipped `h100-llama8b` profile.

Each arm is one `draftsmith eval` (MT-bench, greedy, static drafts so the shape is fixed), run in this
process one after another. Arms: NAME=DIR:SHAPE, SHAPE one of chainK, tree:D,K,N or tree:D,K,N+L (a
lookup branch of L); a standalone export decodes with its full head.

    python benchmarks/cost_model.py --arm e3_chain=EXPORT:chain3 --arm e3_tree=EXPORT:tree:4,4,12 \
        --arm e3_lookup=EXPORT:tree:6,8,32+6 --arm sa6=STANDALONE_DIR:chain3 [--limit 8] [--max_new_tokens 96]

Ends with `RESULT timed_<arm>=... modelled_<arm>=... ratio_<arm>=modelled/timed h100_<arm>=...`; the
target: every ratio within 0.90–1.10.
"""

from __future__ import annotations

import json
from pathlib import Path

from harness import machine, parser, print_result

ROOT = Path(__file__).resolve().parents[1]


def shape_options(shape: str) -> dict:
    if shape.startswith("chain"):
        return {"policy": "static", "k": int(shape[5:])}
    spec = shape.removeprefix("tree:")
    tree, _, lookup = spec.partition("+")
    return {"policy": "static", "tree": tree, "lookup": int(lookup or 0)}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--arm", action="append", required=True, help="NAME=DIR:SHAPE")
    ap.add_argument("--target", default="embedded:smollm2-135m-instruct")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max_new_tokens", type=int, default=96)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=str(ROOT / "runs/bench/cost_model"))
    args = ap.parse_args()
    from draftsmith.eval.evaluate import EvalConfig, evaluate

    keys: dict[str, float | str] = {}
    for arm in args.arm:
        name, _, rest = arm.partition("=")
        drafter, _, shape = rest.partition(":")
        cfg = EvalConfig(target=args.target, drafter=drafter, prompts="mtbench", limit=args.limit,
                         max_new_tokens=args.max_new_tokens, dtype=args.dtype, head_vocab=0, temperature=0.0,
                         cost_profile="measured,h100-llama8b", out=str(Path(args.out) / name), **shape_options(shape))
        results = evaluate(cfg)
        timed, modelled = results["speed"]["speedup"], results["modelled"]
        keys[f"timed_{name}"] = round(timed, 3)
        keys[f"modelled_{name}"] = round(modelled["measured"]["speedup"], 3)
        keys[f"ratio_{name}"] = round(modelled["measured"]["speedup"] / timed, 3)
        keys[f"tau_{name}"] = round(results["acceptance"]["tau"], 3)
        if modelled["h100-llama8b"].get("speedup"):
            keys[f"h100_{name}"] = round(modelled["h100-llama8b"]["speedup"], 3)
        if not results["speed"].get("valid", True):
            keys[f"not_valid_{name}"] = 1
        print(f"{name}: τ {keys[f'tau_{name}']}, timed {timed:.3f}x, modelled (measured) "
              f"{keys[f'modelled_{name}']}x, ratio {keys[f'ratio_{name}']}; measured profile "
              f"{json.dumps(modelled['measured']['profile']['verify'])} draft {modelled['measured']['profile']['draft']}",
              flush=True)
    keys["machine"] = machine().replace(" ", "_")
    print_result(keys)


if __name__ == "__main__":
    main()
