"""Which draft shape pays best for a drafter on this machine: τ and speedup per shape, one process.

    python benchmarks/draft_shapes.py [--drafter DIR] [--shapes chain3 3,4,8 4,4,12 5,6,24]
                                      [--limit 20] [--max_new_tokens 128] [--passes 2]

Loads the target and the drafter once, then decodes the same MT-bench first turns greedily with
every shape (`chainK`: static chains of K; `D,K,T`: EAGLE-2 trees of depth D, top-k K, T tokens;
`D,K,T,L`: the same with a prompt-lookup branch of up to L tokens grafted on; `costD,K,T[,L]`: trees
sized every round by the cost policy within that shape, one meter per arm)
and with the target alone, in `--passes` passes (each opens with the target alone, then runs the
shapes, in reverse order on every other pass so that drift within a pass evens out). Speedup =
a shape's tokens/s over the target-alone tokens/s of the same pass, median over passes. τ does not depend
on timing; speed does: run it with nothing else on the CPU. DIR defaults to the hass-cpu-full
recipe's native export. Ends with `RESULT best=<shape> tau_<shape>=... speedup_<shape>=... ...`.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from harness import parser, print_result

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--drafter", default=str(ROOT / "runs/smollm2-135m/hass-cpu-full/export-native"))
    ap.add_argument("--shapes", nargs="+", default=["chain3", "3,4,8", "4,4,12", "5,6,24"])
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max_new_tokens", type=int, default=128)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--compile", action="store_true", help="the target's decoder through torch.compile (the warm-up compiles)")
    args = ap.parse_args()
    if not (Path(args.drafter) / "config.json").is_file():
        raise SystemExit(f"no drafter export at {args.drafter}: run `draftsmith run RECIPE` or `draftsmith export`")

    from draftsmith.eval.acceptance import acceptance_stats, decode_all
    from draftsmith.runtime.loading import load_proposer
    from draftsmith.eval.prompts import load_prompts
    from draftsmith.models.target import load_target
    from draftsmith.runtime.runner import TargetRunner
    from draftsmith.runtime.policies import Static
    from draftsmith.runtime.cost import TreeCost, TreeCostMeter
    from draftsmith.runtime.proposers import NoProposer
    from draftsmith.runtime.sampling import SamplingConfig
    from draftsmith.runtime.tree import TreeShape

    target = load_target("embedded:smollm2-135m-instruct", dtype=args.dtype)
    proposer, what = load_proposer(args.drafter, target)
    runner = TargetRunner(target.model, proposer.aux_layer_ids, compile=args.compile)
    prompts = [target.encode_chat([{"role": "user", "content": p["turns"][0]}])
               for p in load_prompts("mtbench", args.limit, "first", "sharegpt")]
    arms = {"autoregressive": (NoProposer(target.vocab_size), None, lambda _: Static(0))}
    for spec in args.shapes:
        if spec.startswith("chain"):
            arms[spec] = (proposer, None, lambda _, k=int(spec[len("chain"):]): Static(k))
        else:
            shape = TreeShape(*(int(x) for x in spec.removeprefix("cost").split(",")))
            sized = spec.startswith("cost")
            arms[spec] = (proposer, shape, (lambda _, meter=TreeCostMeter(): TreeCost(meter=meter)) if sized
                          else (lambda _: Static(0)))
    sampling, eos = SamplingConfig(), target.eos_token_ids
    print(f"drafter: {what}; {len(prompts)} MT-bench first turns x {args.max_new_tokens} tokens, greedy, "
          f"{args.dtype}, {args.passes} passes{', decoder compiled' if args.compile else ''}", flush=True)

    def decode(name: str, limit: int | None = None, max_new: int | None = None):
        arm, tree, policy = arms[name]
        return decode_all(runner, arm, prompts[:limit], max_new or args.max_new_tokens, policy, sampling,
                          eos, 0, tree=tree)

    start = time.perf_counter()
    for name in arms:  # warm-up (and compilation)
        decode(name, 1, 16)
    print(f"warm-up {time.perf_counter() - start:.0f} s", flush=True)

    def rate(results) -> float:
        return sum(len(r.tokens) for r in results) / sum(r.seconds for r in results)

    speedups: dict[str, list[float]] = {name: [] for name in arms if name != "autoregressive"}
    taus: dict[str, float] = {}
    ar_rates = []
    for p in range(args.passes):
        ar = rate(decode("autoregressive"))
        ar_rates.append(ar)
        for name in list(speedups)[:: -1 if p % 2 else 1]:  # odd passes run the shapes in reverse (drift)
            results = decode(name)
            speedups[name].append(rate(results) / ar)
            taus[name] = acceptance_stats(results)["tau"]
            print(f"pass {p + 1}: {name:<8} τ {taus[name]:.2f}  speedup {speedups[name][-1]:.2f}x "
                  f"(target alone {ar:.1f} tok/s)", flush=True)
    print(f"{'shape':<10}{'τ':>6}{'speedup':>9}   (median of {args.passes}; target alone "
          f"{min(ar_rates):.1f}-{max(ar_rates):.1f} tok/s)")
    median = {name: statistics.median(s) for name, s in speedups.items()}
    for name in speedups:
        print(f"{name:<10}{taus[name]:>6.2f}{median[name]:>8.2f}x")
    best = max(median, key=median.get)
    keys = {name: name.replace(",", "_") for name in speedups}
    print_result(f"best={keys[best]} " + " ".join(f"tau_{keys[n]}={taus[n]:.3f} speedup_{keys[n]}={median[n]:.3f}"
                                                   for n in speedups))


if __name__ == "__main__":
    main()
