"""Our runtime against transformers' assisted generation: same target, same draft LM, one run.

The SmolLM2 target and the standalone draft LM of recipes/smollm2-135m/standalone-cpu.yaml,
greedy, fp32 (identity is an fp32 property: in bf16 near-ties can flip). Each side runs with
its own defaults (ours: `draftsmith eval`'s draft-length policy, and the drafter's head run over
its 8192 most frequent training tokens; transformers: up to 20 assistant tokens with a 0.4
confidence stop), then both with the same static K, ours with transformers' default rule
(runtime against runtime) and with the full head, and the target alone (autoregressive, the
speed any drafting has to beat; its output must match too). A short warm-up per arm, then the
arms alternate; medians of the repeats (one by default).

    python benchmarks/vs_hf_assisted.py [--drafter DIR] [--limit 8] [--max_new_tokens 64] [--k 4] [--repeats 1]

DIR is a native export of the standalone drafter; by default the one `draftsmith run
recipes/smollm2-135m/standalone-cpu.yaml` writes. Ends with `RESULT identical=... ratio=...`.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from harness import parser, print_result

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--drafter", default=str(ROOT / "runs/smollm2-135m/standalone-cpu/export-native"))
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max_new_tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from draftsmith.eval.evaluate import EvalConfig, policy_factory
    from draftsmith.runtime.loading import standalone_head_ids
    from draftsmith.eval.prompts import first_turn_ids
    from draftsmith.models.target import load_target
    from draftsmith.runtime.generate import generate
    from draftsmith.runtime.runner import TargetRunner
    from draftsmith.runtime.policies import Confidence, Static
    from draftsmith.runtime.proposers import NoProposer
    from draftsmith.runtime.standalone import ModelProposer

    if not (Path(args.drafter) / "draftsmith.json").is_file():
        raise SystemExit(f"no standalone drafter at {args.drafter}: run "
                         "`draftsmith run recipes/smollm2-135m/standalone-cpu.yaml` first")
    target = load_target("embedded:smollm2-135m-instruct", dtype="float32")
    draft = AutoModelForCausalLM.from_pretrained(args.drafter, dtype=torch.float32).eval()
    tok = target.tokenizer
    prompts = first_turn_ids(target, "mtbench", args.limit)
    eos = tok.eos_token_id
    defaults = EvalConfig(target="")
    default_policy = policy_factory(defaults)
    # our default: the drafter's head over its training data's most frequent tokens (same weights, same model)
    head_ids = standalone_head_ids(Path(args.drafter), target, defaults.head_vocab)
    runner, proposer = TargetRunner(target.model), ModelProposer(draft, target.vocab_size, head_ids)
    full_head = ModelProposer(draft, target.vocab_size)

    def ours(new_policy, batch=prompts, max_new_tokens=args.max_new_tokens, drafter=proposer):
        outs, start = [], time.perf_counter()
        for ids in batch:
            outs.append(generate(runner, drafter, ids, max_new_tokens, new_policy(ids), eos_token_ids=(eos,)).tokens)
        return outs, sum(map(len, outs)) / (time.perf_counter() - start)

    def theirs(num_assistant_tokens=None, batch=prompts, max_new_tokens=args.max_new_tokens):
        outs, start = [], time.perf_counter()
        if num_assistant_tokens is None:  # unset: transformers fills in its own defaults
            draft.generation_config.num_assistant_tokens = None
            draft.generation_config.num_assistant_tokens_schedule = None
            draft.generation_config.assistant_confidence_threshold = None
        else:
            draft.generation_config.num_assistant_tokens = num_assistant_tokens
            draft.generation_config.num_assistant_tokens_schedule = "constant"
            draft.generation_config.assistant_confidence_threshold = 0.0
        for ids in batch:
            out = target.model.generate(torch.tensor([ids]), assistant_model=draft, max_new_tokens=max_new_tokens,
                                        do_sample=False, eos_token_id=eos, pad_token_id=eos)
            outs.append(out[0, len(ids):].tolist())
        return outs, sum(map(len, outs)) / (time.perf_counter() - start)

    arms = {"ours_default": lambda **kw: ours(default_policy, **kw),
            "hf_default": lambda **kw: theirs(**kw),
            f"ours_static{args.k}": lambda **kw: ours(lambda _: Static(args.k), **kw),
            f"hf_static{args.k}": lambda **kw: theirs(args.k, **kw),
            # transformers' default rule in our runtime (stop below 0.4 confidence, at most 20): runtime against runtime
            "ours_hf_rule": lambda **kw: ours(lambda _: Confidence(0.4, 20), **kw),
            # our default policy with the drafter's full head: what the frequency-ranked head adds
            "ours_full_head": lambda **kw: ours(policy_factory(defaults), drafter=full_head, **kw),
            # the target alone (our runtime, nothing drafted): what any drafting has to beat
            "autoregressive": lambda **kw: ours(lambda _: Static(0), drafter=NoProposer(target.vocab_size), **kw)}
    for arm in arms.values():  # warm-up: first calls allocate
        arm(batch=prompts[:1], max_new_tokens=16)
    rates, outputs = {name: [] for name in arms}, {}
    for _ in range(args.repeats):
        for name, arm in arms.items():
            outputs[name], rate = arm()
            rates[name].append(rate)
    med = {name: statistics.median(r) for name, r in rates.items()}
    identical = all(outputs[n] == outputs["hf_default"] for n in outputs)
    for name, r in rates.items():
        print(f"{name:>14}: {med[name]:6.1f} tok/s (spread {min(r):.1f}-{max(r):.1f})")
    ratio = med["ours_default"] / med["hf_default"]
    ratio_static = med[f"ours_static{args.k}"] / med[f"hf_static{args.k}"]
    ratio_same_rule = med["ours_hf_rule"] / med["hf_default"]
    head = f"{len(head_ids)}-token head" if head_ids is not None else "full head (the export has no token counts)"
    print(f"{len(prompts)} MT-bench prompts, {args.max_new_tokens} new tokens, greedy fp32, our default policy "
          f"{default_policy()}, drafter {head}; outputs identical: {identical}")
    print_result(f"identical={str(identical).lower()} ratio={ratio:.3f} ratio_static={ratio_static:.3f} "
          f"ratio_same_rule={ratio_same_rule:.3f} ratio_full_head={med['ours_full_head'] / med['hf_default']:.3f} "
          f"ours_tok_s={med['ours_default']:.1f} hf_tok_s={med['hf_default']:.1f} ar_tok_s={med['autoregressive']:.1f}")


if __name__ == "__main__":
    main()
