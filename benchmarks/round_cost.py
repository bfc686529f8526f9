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
                                    [--compile]

Ends with `RESULT ar_ms=... ar_ms_reference=... ratio_<shape>=<round / AR step>
ratio_<shape>_reference=...`.

`--profile` first prints where a round's time goes, by torch.profiler, for the autoregressive step,
the first chain and the first tree of each runtime: milliseconds per round in matrix products,
attention, KV-cache copies, other tensor ops, and what no tensor op accounts for (Python,
transformers' module calls, tree bookkeeping).

`--compile` times the runtime with its target decoder compiled (`TargetRunner(compile=True)`:
torch.compile, inductor, weights frozen); the reference path stays eager.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch


def median_ms(fn, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


CATEGORIES = {  # ATen / oneDNN op name → part of a round
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "mkldnn::_linear_pointwise"),
    "attention": ("aten::_scaled_dot_product", "aten::scaled_dot_product", "aten::_softmax"),
    "kv cache": ("aten::cat", "aten::index_select", "aten::index_copy", "aten::copy_", "aten::clone"),
}


def profile_ms(fn, repeats: int) -> dict[str, float]:
    """Milliseconds per call of `fn` by category (self time of the ops), plus the wall time no op accounts for."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        wall = (time.perf_counter() - start) * 1e3 / repeats
    parts: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        category = next((c for c, names in CATEGORIES.items() if event.key.startswith(names)), "other ops")
        parts[category] += event.self_cpu_time_total / 1e3 / repeats
    parts["python & framework"] = max(0.0, wall - sum(parts.values()))
    parts["wall"] = wall
    return dict(parts)


def fresh_eagle3(target, layer_ids: list[int], draft_vocab: int):
    from draftsmith.models.eagle3 import Eagle3Drafter

    torch.manual_seed(0)
    norm = getattr(target.decoder, "norm", None)
    drafter = Eagle3Drafter(target.config, target.embed_tokens.weight.detach(), target.lm_head.weight.detach(),
                            norm.weight if norm is not None else None, torch.arange(draft_vocab), len(layer_ids),
                            target.hidden_size)
    return drafter.to(dtype=target.dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default=None,
                    help="a native feature-drafter export (default: a fresh EAGLE-3 drafter)")
    ap.add_argument("--context", type=int, default=400, help="tokens in the caches")
    ap.add_argument("--chains", default="3,4", help="chain lengths K")
    ap.add_argument("--trees", nargs="*", default=["4,4,12", "5,6,24", "5,8,32", "6,8,40"], help="DEPTH,TOPK,TOKENS")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--profile", action="store_true", help="also print where a round's time goes (torch.profiler)")
    ap.add_argument("--compile", action="store_true",
                    help="time the runtime with its decoder compiled (torch.compile, inductor); the reference stays eager")
    args = ap.parse_args()

    from draftsmith.eval.evaluate import EvalConfig
    from draftsmith.models.loading import load_proposer
    from draftsmith.models.target import load_target
    from draftsmith.runtime.generate import TargetRunner
    from draftsmith.runtime.policies import Static
    from draftsmith.runtime.proposers import FeatureProposer
    from draftsmith.runtime.sampling import SamplingConfig

    target = load_target("embedded:smollm2-135m-instruct", dtype=args.dtype)

    if args.drafter:
        loaded, what = load_proposer(args.drafter, target)
        if not isinstance(loaded, FeatureProposer):
            raise SystemExit(f"{args.drafter}: round costs are timed for feature drafters (EAGLE/HASS/EAGLE-3)")
        drafter, layer_ids = loaded.drafter, loaded.aux_layer_ids
    else:
        layer_ids = [2, 15, 27]
        drafter, what = fresh_eagle3(target, layer_ids, 8192), "fresh EAGLE-3, fused [2, 15, 27], 8192-token head"

    torch.manual_seed(0)
    prompt = torch.randint(1000, target.vocab_size, (args.context,)).tolist()
    sampling = SamplingConfig()
    shapes = [(f"chain {k}", k) for k in (int(x) for x in args.chains.split(",") if x)]
    shapes += [(f"tree {spec}", EvalConfig(target="", tree=spec).tree_shape()) for spec in args.trees]

    def time_runtime(fast: bool) -> list[tuple[str, int, float, float]]:
        """Rows (shape, verified tokens, draft ms, verify ms) of one runtime."""
        proposer = FeatureProposer(drafter, target.vocab_size, layer_ids, fast=fast)
        runner = TargetRunner(target.model, proposer.aux_layer_ids, fast=fast, compile=fast and args.compile)
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
                tokens, tree = draft()[0], None
            else:
                draft = drafter_round(lambda shape=shape: proposer.propose_tree(shape))
                tree = draft()
                tokens = tree.tokens.tolist()
            rows.append((name, len(tokens), median_ms(draft, args.repeats), median_ms(verify(tokens, tree), args.repeats)))
            if not any(n.startswith(name.split()[0]) for n in profiled):
                profiled[name] = lambda draft=draft, check=verify(tokens, tree): (draft(), check())
        if args.profile:
            label = "runtime" if fast else "reference"
            for name, fn in profiled.items():
                parts = profile_ms(fn, max(3, args.repeats // 2))
                print(f"profile {label:<10}{name:<16}" + "  ".join(f"{k} {v:.1f}" for k, v in parts.items()), flush=True)
        return rows

    start = time.perf_counter()
    rows = time_runtime(True)
    runtime_s = time.perf_counter() - start
    reference = time_runtime(False)
    reference_s = time.perf_counter() - start - runtime_s
    compiled = (f"; decoder compiled: the runtime's arm took {runtime_s:.0f} s in all against the reference's "
                f"{reference_s:.0f} s, the difference being mostly compilation") if args.compile else ""
    print(f"drafter: {what}; {args.context} cached tokens; {args.dtype}; medians of {args.repeats}{compiled}")
    print(f"{'shape':<16}{'verified':>9}{'draft ms':>10}{'verify ms':>11}{'round ms':>10}{'round/AR':>10}"
          f"{'τ for 1.5x':>12}{'reference round/AR':>20}")
    ar, ar_reference = rows[0][3], reference[0][3]
    parts = [f"ar_ms={ar:.1f}", f"ar_ms_reference={ar_reference:.1f}"]
    for (name, n, draft_ms, verify_ms), (_, _, ref_draft, ref_verify) in zip(rows, reference):
        ratio, ref_ratio = (draft_ms + verify_ms) / ar, (ref_draft + ref_verify) / ar_reference
        print(f"{name:<16}{n:>9}{draft_ms:>10.1f}{verify_ms:>11.1f}{draft_ms + verify_ms:>10.1f}{ratio:>10.2f}"
              f"{1.5 * ratio:>12.2f}{ref_ratio:>20.2f}")
        if name != "autoregressive":
            key = name.replace(" ", "").replace(",", "_")
            parts += [f"ratio_{key}={ratio:.3f}", f"ratio_{key}_reference={ref_ratio:.3f}"]
    print("RESULT " + " ".join(parts))


if __name__ == "__main__":
    main()
