"""What drawing a token costs at temperature > 0: the runtime's `sampling.sample` (inverse-CDF, one
uniform per row) against `torch.multinomial` (an exponential per vocabulary entry), side by side in
one process, per draw and per decoding round.

    python benchmarks/sampling_cost.py [--drafter DIR] [--prompts 3] [--new_tokens 48] [--repeats 3]
                                       [--k 3] [--dtype bfloat16]

Per draw: one token from a distribution over the target's vocabulary (49,152 for the embedded
default), medians of 500. Per round: `generate` at temperature 1 on random prompts of 300 tokens,
autoregressive (one draw per token) and with a chain of `--k` drafted tokens (k draws to draft, one
or more to verify), the two samplers alternating, medians over `--repeats` passes. The drafter is a
freshly initialised EAGLE-3 drafter of the hass-cpu-full shape unless `--drafter DIR` names a
native export: a round's cost does not depend on what the drafter learned. Since the autoregressive
baseline draws too, what a cheaper draw does to a speedup is the chain's ratio over the
autoregressive one.

Ends with `RESULT draw_us=... draw_us_multinomial=... ar_ms=... ar_ms_multinomial=...
round_ms=... round_ms_multinomial=... speedup_factor=...` where speedup_factor = (ar_ms /
ar_ms_multinomial) / (round_ms / round_ms_multinomial): by how much a speedup at temperature 1 grows
with the inverse-CDF draw, at the same acceptance.
"""

from __future__ import annotations

import contextlib
import statistics

import torch

from harness import parser, print_result


def multinomial(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """The sampler the runtime used before: torch.multinomial, one row at a time."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--drafter", default=None, help="a native feature-drafter export (default: a fresh EAGLE-3)")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--new_tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, default=3, help="drafted tokens per round")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()

    from draftsmith.runtime.loading import load_proposer
    from draftsmith.models.target import load_target
    from draftsmith.runtime.generate import generate
    from draftsmith.runtime.runner import TargetRunner
    from draftsmith.runtime.policies import Static
    from draftsmith.runtime.proposers import NoProposer
    from draftsmith.runtime.sampling import SamplingConfig, drawing_with, sample
    from harness import median_ms
    from round_parts import fresh_eagle3

    samplers = {"": sample, "_multinomial": multinomial}

    target = load_target("embedded:smollm2-135m-instruct", dtype=args.dtype)
    if args.drafter:
        proposer, what = load_proposer(args.drafter, target)
    else:
        layer_ids = [2, target.num_layers // 2, target.num_layers - 3]
        from draftsmith.runtime.proposers import FeatureProposer

        proposer = FeatureProposer(fresh_eagle3(target, layer_ids, 8192), target.vocab_size, layer_ids)
        what = f"fresh EAGLE-3, fused {layer_ids}, 8192-token head"
    runner = TargetRunner(target.model, proposer.aux_layer_ids)
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(target.vocab_size) * 3, -1)
    prompts = [torch.randint(1000, target.vocab_size, (300,)).tolist() for _ in range(args.prompts)]
    cfg = SamplingConfig(temperature=1.0)
    arms = {"ar": (NoProposer(target.vocab_size), Static(0)), "round": (proposer, Static(args.k))}

    draw = {suffix: median_ms(lambda s=s, g=torch.Generator().manual_seed(0): s(probs, g), 500) * 1e3
            for suffix, s in samplers.items()}
    timed: dict[str, list[float]] = {}
    for rep in range(args.repeats):
        for suffix, sampler in samplers.items():
            for arm, (drafting, policy) in arms.items():
                g, seconds, count = torch.Generator().manual_seed(rep), 0.0, 0
                # every draw of the loop, the drafter's and the verifier's
                with drawing_with(sampler) if sampler is not sample else contextlib.nullcontext():
                    for prompt in prompts:  # the rounds' time: the prefill left out (an autoregressive round is a token)
                        out = generate(runner, drafting, prompt, args.new_tokens, policy, cfg, generator=g)
                        seconds += sum(r.seconds for r in out.rounds)
                        count += len(out.rounds)
                timed.setdefault(arm + suffix, []).append(seconds / count * 1e3)
    ms = {key: statistics.median(values) for key, values in timed.items()}
    factor = (ms["ar"] / ms["ar_multinomial"]) / (ms["round"] / ms["round_multinomial"])
    print(f"target: embedded:smollm2-135m-instruct ({target.vocab_size} tokens), {args.dtype}; drafter: {what}; "
          f"{args.prompts} prompts x {args.new_tokens} tokens at temperature 1, chains of {args.k}")
    print(f"one draw: {draw['']:.0f} us (inverse CDF) against {draw['_multinomial']:.0f} us (multinomial)")
    print(f"autoregressive ms/token: {ms['ar']:.2f} against {ms['ar_multinomial']:.2f}; "
          f"chain round ms: {ms['round']:.2f} against {ms['round_multinomial']:.2f}")
    print_result(f"draw_us={draw['']:.0f} draw_us_multinomial={draw['_multinomial']:.0f} ar_ms={ms['ar']:.2f} "
          f"ar_ms_multinomial={ms['ar_multinomial']:.2f} round_ms={ms['round']:.2f} "
          f"round_ms_multinomial={ms['round_multinomial']:.2f} speedup_factor={factor:.3f}")


if __name__ == "__main__":
    main()
