"""Where a speculative round's time goes on this machine, and the τ each draft shape needs, one run.

Times, side by side in one process (medians of `--repeats` after a warm-up): one autoregressive
target step; for each draft shape, the drafter's work in a round (feeding it two accepted
anchors, then drafting the chain or EAGLE-2 tree) and the target forward that verifies it. Both
with the runtime as it decodes (preallocated KV slabs, prepacked linear weights on a CPU) and with the
reference path (`fast=False`: transformers' DynamicCache and nn.Linear as they are), each
against its own autoregressive step. A round's cost over an autoregressive step is the
acceptance length τ a shape must reach just to break even; 1.5 times that is the τ a 1.5x
wall-clock speedup needs (speedup = τ · AR step / round). Costs do not depend on what the
drafter has learned, so by default the drafter is a freshly initialised EAGLE-3 drafter of the
hass-cpu-full shape (fused layers [2, 15, 27], an 8192-token head); `--drafter DIR` times a
native export instead. Cache: `--context` tokens.

    python benchmarks/round_cost.py [--drafter DIR] [--context 400] [--chains 3,4]
                                    [--trees 4,4,12 5,6,24 5,8,32 6,8,40] [--repeats 30] [--dtype float32]
                                    [--compile] [--arms runtime,reference] [--temperature 0]

Ends with `RESULT ar_ms=... ar_ms_reference=... ratio_<shape>=<round / AR step>
ratio_<shape>_reference=...`.

Every run also times the target's matrix products alone (all its linear layers, packed as the runtime
runs them) at one row and at each shape's row count, and prints `floor_<shape>` = 1 + (their extra time
over one row) / AR step: the verification's cost in steps if nothing but its matrix products grew with
its rows. Where that is above a target, no change to the rest of the runtime can meet it on that machine:
the products are compute-bound there (`matmul_gflops`, the rate of the largest shape's extra rows,
printed where they cost at least 10 % more than one row).

`--temperature T` drafts the chains by sampling at T (a chain's drafting then includes its draws; on a
GPU the graphs arm records each sampled chain whole). `--arms runtime,graphs` (say) times only the arms named, of those the other flags ask for.

`--profile` first prints where a round's time goes, by torch.profiler, for the autoregressive step,
the first chain and the first tree of each runtime: milliseconds per round in matrix products,
attention, KV-cache copies, other tensor ops, and what no tensor op accounts for (Python,
transformers' module calls, tree bookkeeping).

On a GPU the profile adds the kernels' time by kind (matrix products, attention, copies, other; kernels
replayed from CUDA graphs included) and the GPU's busy time per round, against the round's wall time.

`--compile` times the runtime with its target decoder compiled (`TargetRunner(compile=True)`, which is
`compile="cached"`: torch.compile, inductor, the packed weights inputs of the graph, which inductor's cache
keeps for later processes); `--compile --compile_mode frozen` with the weights frozen into the graph, compiled anew in
every process (`TargetRunner(compile="frozen")`). The reference path stays eager.

`--graphs` adds a third arm: `TargetRunner(graphs=True)` and `FeatureProposer.enable_graphs` (runtime/graphs.py),
fixed-capacity KV slabs and, on a GPU, each target and drafter forward replayed from a CUDA graph (keys
`ar_ms_graphs`, `ratio_<shape>_graphs`, and `ar_replay_ms_graphs`: the one-token graph's replay alone).
The graphs arm folds the query heads that share a key/value head into the rows of one attention call
(the graphs' default); `--unfolded` adds the same without (`gqa=False`: transformers copies the keys
and values per query head under the mask; `_unfolded` keys). `--compile_blocks` adds the graphs arm with
the target's norms and MLPs compiled (`TargetRunner(graphs=True, compile_blocks=True)`, `_blocks` keys; their compilation is
the arm's first calls, outside the timings).

On a GPU (`--device cuda`), with a random-weight target of a known shape (no download):

    python benchmarks/round_cost.py --device cuda --target random:llama-3.1-8b --draft_vocab 32000 --graphs

also measures the device's copy bandwidth and prints the autoregressive step against its floor, the
bytes of weights one step reads over that bandwidth (`ar_floor_ms`, `copy_gbps`). The drafter is a
fresh EAGLE-3 drafter of the target's shape (fused layers [2, N/2, N-3]). `--layers N` keeps only the
first N decoder layers of a random target (a quick check of the script on a CPU).

`--generate N` also decodes N tokens after the prompt with `generate` itself (the loop `draftsmith eval`
runs: committing, bookkeeping, one host sync a round), plainly and with the first chain and the first
tree, and prints `loop_<shape>` = generate's mean round ÷ the same round timed above (drafting and
verification alone): what the loop adds (`loop_ar` for a plain step). With `--profile`, one plain decode
is profiled too, per token (on a GPU: its kernels' busy time against its wall time).
"""

from __future__ import annotations

import time

import torch

from harness import median_ms, parser, print_result
from round_parts import (RANDOM_TARGETS, copy_bandwidth, floor_keys, fresh_eagle3, profile_ms, random_target, shape_key,
                         step_bytes)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--drafter", default=None,
                    help="a native feature-drafter export (default: a fresh EAGLE-3 drafter)")
    ap.add_argument("--context", type=int, default=400, help="tokens in the caches")
    ap.add_argument("--chains", default="3,4", help="chain lengths K")
    ap.add_argument("--trees", nargs="*", default=["4,4,12", "5,6,24", "5,8,32", "6,8,40"], help="DEPTH,TOPK,TOKENS")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="draft chains by sampling at this temperature (0: greedy); trees draft their top-k either way")
    ap.add_argument("--profile", action="store_true", help="also print where a round's time goes (torch.profiler)")
    ap.add_argument("--compile", action="store_true",
                    help="time the runtime with its decoder compiled (torch.compile, inductor), as eval --compile does")
    ap.add_argument("--compile_mode", default="cached", choices=["cached", "frozen"],
                    help="with --compile: cached (the graphs inductor's cache keeps) or frozen (weights folded in), as eval's")
    ap.add_argument("--compile_blocks", action="store_true",
                    help="add the fixed-shape runner with the target's norms and MLPs compiled (graphs=True, compile_blocks=True)")
    ap.add_argument("--arms", default=None, help="keep only these arms (comma-separated: runtime,reference,graphs,...)")
    ap.add_argument("--target", default="embedded:smollm2-135m-instruct",
                    help=f"the embedded target, or random:<shape> with shape one of {sorted(RANDOM_TARGETS)}")
    ap.add_argument("--layers", type=int, default=None, help="a random target's decoder layers (default: the shape's)")
    ap.add_argument("--draft_vocab", type=int, default=8192, help="the fresh drafter's head size")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--generate", type=int, default=0,
                    help="also decode this many tokens with generate (plain, first chain, first tree): the loop's share")
    args = ap.parse_args()

    from draftsmith.runtime.tree import TreeShape
    from draftsmith.runtime.loading import load_proposer
    from draftsmith.models.target import DTYPES, load_target
    from draftsmith.runtime.generate import generate
    from draftsmith.runtime.runner import TargetRunner
    from draftsmith.runtime.policies import Static
    from draftsmith.runtime.proposers import FeatureProposer, NoProposer
    from draftsmith.runtime.sampling import SamplingConfig
    from draftsmith.runtime.tree import DraftTree

    if args.target.startswith("random:"):
        target = random_target(args.target.split(":", 1)[1], DTYPES[args.dtype], args.device, args.layers)
    else:
        target = load_target(args.target, dtype=args.dtype, device=args.device)
    floor = ""
    if args.device.startswith("cuda"):
        gbps = copy_bandwidth(args.device)
        floor_ms = step_bytes(target.model) / gbps / 1e6
        floor = f"ar_floor_ms={floor_ms:.2f} copy_gbps={gbps:.0f}"
        print(f"device: {torch.cuda.get_device_name()}; copy bandwidth {gbps:.0f} GB/s (read + written); "
              f"a step reads {step_bytes(target.model) / 1e9:.2f} GB of weights: floor {floor_ms:.2f} ms", flush=True)

    if args.drafter:
        loaded, what = load_proposer(args.drafter, target)
        if not isinstance(loaded, FeatureProposer):
            raise SystemExit(f"{args.drafter}: round costs are timed for feature drafters (EAGLE/HASS/EAGLE-3)")
        drafter, layer_ids = loaded.drafter, loaded.aux_layer_ids
    else:
        n = target.num_layers
        layer_ids = [2, n // 2, n - 3]
        drafter = fresh_eagle3(target, layer_ids, args.draft_vocab)
        what = f"fresh EAGLE-3, fused {layer_ids}, {args.draft_vocab}-token head"

    torch.manual_seed(0)
    prompt = torch.randint(1000, target.vocab_size, (args.context,)).tolist()
    sampling = SamplingConfig(temperature=args.temperature)
    shapes = [(f"chain {k}", k) for k in (int(x) for x in args.chains.split(",") if x)]
    shapes += [(f"tree {spec}", TreeShape.parse(spec)) for spec in args.trees]
    failures: list[str] = []
    replays: dict[str, float] = {}
    loops: dict[str, list[tuple[str, float, float]]] = {}  # arm → (shape, generate's ms a round, tokens a round)

    def time_runtime(arm: str) -> list[tuple[str, int, float, float]]:
        """Rows (shape, verified tokens, draft ms, verify ms) of one runtime: runtime, graphs or reference."""
        fast = arm != "reference"
        proposer = FeatureProposer(drafter, target.vocab_size, layer_ids, fast=fast)
        if arm in ("graphs", "unfolded", "blocks"):
            proposer.enable_graphs()
            # the last arm compiles the model's blocks, which stay compiled
            runner = TargetRunner(target.model, proposer.aux_layer_ids, graphs=True,
                                  capacity=args.context + 256 + args.generate, gqa=arm != "unfolded",
                                  compile_blocks=arm == "blocks")
        else:
            runner = TargetRunner(target.model, proposer.aux_layer_ids, fast=fast,
                                  compile=args.compile and fast and args.compile_mode)
        with torch.no_grad():
            runner.reset()
            _, final, aux = runner.forward(prompt, last_logits=True)
            proposer.reset()
            proposer.observe(prompt[1:] + [prompt[0]], final, aux)
        start, anchors = runner.cached(), proposer.anchors
        feed = (final[-2:], aux[-2:] if aux is not None else None)

        def drafter_round(draft):
            """Feed two accepted anchors (crop them off again), then draft."""
            def run():
                proposer.anchors = anchors - 2  # observe crops the buffer to its anchors first
                proposer.observe(prompt[-2:], *feed)
                return draft()
            return run

        def verify(tokens: list[int], tree=None):
            def run():
                runner.forward([prompt[-1]] + tokens, tree)
                runner.rollback(runner.cached() - start)
            return run

        rows = [("autoregressive", 1, 0.0, median_ms(verify([]), args.repeats))]
        profiled = {"autoregressive": verify([])}  # and the first chain and the first tree
        for name, shape in shapes:
            if isinstance(shape, int):
                draft = drafter_round(lambda k=shape: proposer.propose(prompt, Static(k), k, sampling, None))
            else:
                draft = drafter_round(lambda shape=shape: proposer.propose_tree(shape))
            try:
                drafted = draft()
                draft_ms = median_ms(draft, args.repeats)
            except Exception as e:  # noqa: BLE001 - time the verification anyway, report the drafter's failure
                failures.append(f"{arm} {name}: drafting failed: {type(e).__name__}: {e}")
                drafted, draft_ms = None, float("nan")
            if isinstance(shape, int):
                tree, tokens = None, drafted[0] if drafted is not None else prompt[:shape]
            else:  # a stand-in tree of the shape's node count (a chain under a tree mask) if drafting failed
                size = shape.total_tokens
                tree = drafted if drafted is not None else DraftTree(
                    torch.tensor(prompt[:size], device=runner.device), torch.arange(-1, size - 1, device=runner.device),
                    torch.arange(1, size + 1, device=runner.device), torch.zeros(size, device=runner.device))
                tokens = tree.tokens.tolist()
            rows.append((name, len(tokens), draft_ms, median_ms(verify(tokens, tree), args.repeats)))
            if not any(n.startswith(name.split()[0]) for n in profiled):
                profiled[name] = lambda draft=draft, check=verify(tokens, tree): (draft(), check())
        if getattr(runner, "capture", False):  # the one-token graph's replay alone: the GPU's share of a step
            replays[f"ar_replay_ms_{arm}"] = median_ms(runner.graphs.recorded.graphs[1][0].replay, args.repeats)
        if args.generate:
            first_chain = next(((n, s) for n, s in shapes if isinstance(s, int)), None)
            first_tree = next(((n, s) for n, s in shapes if not isinstance(s, int)), None)
            decodes = [("autoregressive", NoProposer(target.vocab_size), Static(0), None)]
            if first_chain:
                decodes.append((first_chain[0], proposer, Static(first_chain[1]), None))
            if first_tree:
                decodes.append((first_tree[0], proposer, Static(first_tree[1].depth), first_tree[1]))
            loops[arm] = []
            for name, source, policy, tree in decodes:
                def decode(source=source, policy=policy, tree=tree):
                    return generate(runner, source, prompt, args.generate, policy, sampling, tree=tree)
                decode()  # a warm-up: graphs for the prompt and each round's shapes are recorded here
                rounds = min((decode().rounds for _ in range(3)), key=lambda r: sum(x.seconds for x in r))
                loops[arm].append((name, 1e3 * sum(r.seconds for r in rounds) / len(rounds),
                                   sum(r.committed for r in rounds) / len(rounds)))
            if args.profile:  # a plain decode, per token (its prefill is one forward against N)
                parts = profile_ms(lambda: generate(runner, decodes[0][1], prompt, args.generate, Static(0)), 2)
                print(f"profile {arm:<10}{'generate':<16}" + "  ".join(f"{k} {v / args.generate:.2f}" for k, v in parts.items())
                      + " (ms a token)", flush=True)
        if args.profile:
            for name, fn in profiled.items():
                parts = profile_ms(fn, max(3, args.repeats // 2))
                print(f"profile {arm:<10}{name:<16}" + "  ".join(f"{k} {v:.1f}" for k, v in parts.items()), flush=True)
        return rows

    arms = ["runtime", "reference"] + (["graphs"] if args.graphs else []) + (["unfolded"] if args.unfolded else [])
    arms += ["blocks"] if args.compile_blocks else []
    if args.arms:
        arms = [arm for arm in arms if arm in args.arms.split(",")]
    timed, seconds = {}, {}
    for arm in arms:
        start = time.perf_counter()
        try:
            timed[arm] = time_runtime(arm)
        except Exception as e:  # noqa: BLE001 - report the other arms
            failures.append(f"{arm}: {type(e).__name__}: {e}")
            import traceback

            traceback.print_exc()
        seconds[arm] = time.perf_counter() - start
    for failure in failures:
        print("FAILED " + failure)
    compiled = ""
    if args.compile and "runtime" in seconds:
        compiled = f"; decoder compiled ({args.compile_mode}): the runtime's arm took {seconds['runtime']:.0f} s in all"
        if "reference" in seconds:
            compiled += f" against the reference's {seconds['reference']:.0f} s, the difference being mostly compilation"
    print(f"target: {args.target}; drafter: {what}; {args.context} cached tokens; {args.dtype}; {args.device}; "
          f"medians of {args.repeats}{compiled}")
    print(f"{'arm':<10}{'shape':<16}{'verified':>9}{'draft ms':>10}{'verify ms':>11}{'round ms':>10}{'round/AR':>10}"
          f"{'τ for 1.5x':>12}")
    parts = [floor] if floor else []
    for arm, rows in timed.items():
        suffix = "" if arm == "runtime" else f"_{arm}"
        ar = rows[0][3]
        parts.append(f"ar_ms{suffix}={ar:.2f}")
        for name, n, draft_ms, verify_ms in rows:
            ratio = (draft_ms + verify_ms) / ar
            print(f"{arm:<10}{name:<16}{n:>9}{draft_ms:>10.2f}{verify_ms:>11.2f}{draft_ms + verify_ms:>10.2f}{ratio:>10.2f}"
                  f"{1.5 * ratio:>12.2f}")
            if name != "autoregressive":
                key = shape_key(name)
                parts += [f"ratio_{key}{suffix}={ratio:.3f}", f"verify_{key}{suffix}={verify_ms / ar:.3f}"]
    parts += [f"{key}={ms:.2f}" for key, ms in replays.items()]
    for arm, decoded in loops.items():
        suffix = "" if arm == "runtime" else f"_{arm}"
        alone = {name: draft_ms + verify_ms for name, _, draft_ms, verify_ms in timed.get(arm, [])}
        for name, ms, committed in decoded:
            print(f"generate  {arm:<10}{name:<16}{ms:8.2f} ms a round ({committed:.2f} tokens); the round alone "
                  f"{alone[name]:.2f} ms")
            parts.append(f"loop_{'ar' if name == 'autoregressive' else shape_key(name)}{suffix}={ms / alone[name]:.3f}")
    parts += floor_keys(target.model, timed, args.repeats)
    print_result(" ".join(parts))




if __name__ == "__main__":
    main()
