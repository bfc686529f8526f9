"""Where a speculative round's time goes on this machine, and the τ each draft shape needs, one run.

Times, side by side in one process (medians of `--repeats` after a warm-up): one autoregressive
target step; for each draft shape, the drafter's work in a round (feeding it two accepted
anchors, then drafting the chain or EAGLE-2 tree) and the target forward that verifies it,
also with transformers' default attention for comparison (under a mask it repeats every cached
key and value per query head; the runtime lets SDPA group the query heads on a CPU). A
round's cost over an autoregressive step is the acceptance length τ a shape must reach just to
break even; 1.5 times that is the τ a 1.5x wall-clock speedup needs (speedup = τ · AR step /
round). Costs do not depend on what the drafter has learned, so by default the drafter is a
freshly initialised EAGLE-3 drafter of the hass-cpu-full shape (fused layers [2, 15, 27], an
8192-token head); `--drafter DIR` times a native export instead. Cache: `--context` tokens.

    python benchmarks/round_cost.py [--drafter DIR] [--context 400] [--chains 3,4]
                                    [--trees 4,4,12 5,6,24 5,8,32 6,8,40] [--repeats 30]

Ends with `RESULT ar_ms=... ratio_<shape>=<round / AR step> repeat_kv_<shape>=<verify with K/V repeated
/ verify> ...`.
"""

from __future__ import annotations

import argparse
import statistics
import time

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
        proposer, what = load_proposer(args.drafter, target)
        if not isinstance(proposer, FeatureProposer):
            raise SystemExit(f"{args.drafter}: round costs are timed for feature drafters (EAGLE/HASS/EAGLE-3)")
    else:
        layer_ids = [2, 15, 27]
        proposer, what = FeatureProposer(fresh_eagle3(target, layer_ids, 8192), target.vocab_size, layer_ids), \
            "fresh EAGLE-3, fused [2, 15, 27], 8192-token head"
    runner = TargetRunner(target.model, proposer.aux_layer_ids)
    torch.manual_seed(0)
    prompt = torch.randint(1000, target.vocab_size, (args.context,)).tolist()
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

    def verify(tokens: list[int], tree=None, gqa: bool = True):
        def run():
            runner.gqa = gqa
            runner.forward([prompt[-1]] + tokens, tree)
            runner.rollback(runner.cached() - start)
        return run

    print(f"drafter: {what}; {args.context} cached tokens; {args.dtype}; medians of {args.repeats}", flush=True)
    ar = median_ms(verify([]), args.repeats)
    rows = [("autoregressive", 1, 0.0, ar, ar)]
    sampling = SamplingConfig()
    drafts = []  # (name, one drafter round, whether it drafts a tree)
    for k in (int(x) for x in args.chains.split(",") if x):
        drafts.append((f"chain {k}", drafter_round(lambda k=k: proposer.propose(prompt, Static(k), k, sampling, None)),
                       False))
    for spec in args.trees:
        shape = EvalConfig(target="", tree=spec).tree_shape()
        drafts.append((f"tree {spec}", drafter_round(lambda shape=shape: proposer.propose_tree(shape)), True))
    for name, draft, is_tree in drafts:
        drafted = draft()
        tokens, tree = (drafted.tokens.tolist(), drafted) if is_tree else (drafted[0], None)
        rows.append((name, len(tokens), median_ms(draft, args.repeats), median_ms(verify(tokens, tree), args.repeats),
                     median_ms(verify(tokens, tree, gqa=False), args.repeats)))

    print(f"{'shape':<16}{'verified':>9}{'draft ms':>10}{'verify ms':>11}{'round ms':>10}{'round/AR':>10}"
          f"{'τ for 1.5x':>12}{'verify, K/V repeated':>22}")
    parts = [f"ar_ms={ar:.1f}"]
    for name, n, draft_ms, verify_ms, repeated_ms in rows:
        ratio = (draft_ms + verify_ms) / ar
        print(f"{name:<16}{n:>9}{draft_ms:>10.1f}{verify_ms:>11.1f}{draft_ms + verify_ms:>10.1f}{ratio:>10.2f}"
              f"{1.5 * ratio:>12.2f}{repeated_ms:>22.1f}")
        if name != "autoregressive":
            key = name.replace(" ", "").replace(",", "_")
            parts += [f"ratio_{key}={ratio:.3f}", f"repeat_kv_{key}={repeated_ms / verify_ms:.3f}"]
    print("RESULT " + " ".join(parts))


if __name__ == "__main__":
    main()
