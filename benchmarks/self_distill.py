"""A drafter trained on the target's own answers against one trained on the dataset's answers, one run.

Both arms: one recipe (`--recipe`, default recipes/smollm2-135m/eagle-cpu.yaml; eagle3-cpu.yaml works
too), the same step budget, the user turns of the same `--limit` ShareGPT chats. One arm's features come from the chats' own
(ShareGPT) answers, the other's from the target's greedy answers (`draftsmith regenerate`).
Both then decode the same MT-bench prompts greedily with EAGLE-2 trees through the runtime
(greedy decoding commits the target's tokens, so both see the same text): τ and the ratio.

    python benchmarks/self_distill.py [--limit 400] [--self_limit N] [--steps 240] [--decode_prompts 20]
                                      [--tree 6,10,60] [--recipe R] [--engine transformers|vllm]

`--engine vllm` regenerates through vLLM's offline engine (`draftsmith regenerate --engine vllm`; run the
script with .venv-engines/bin/python, where vLLM is installed) into sharegpt-self-vllm.jsonl.

The target's first-turn answers (≤ 256 tokens) are shorter than ShareGPT's whole chats: at the
same --limit the self arm has about half the loss tokens. `--self_limit` (default --limit) gives
the self arm more chats; the script prints both arms' loss tokens.

Makes what is missing first, resumably (the same commands a user would run):
runs/smollm2-135m/sharegpt-self.jsonl (regenerate: first turns, 256 new tokens; a larger
--self_limit extends it), features-self-SELF_LIMIT and features-sharegpt-LIMIT (extract, max length 512).
Ends with `RESULT tau_sharegpt=... tau_self=... ratio=<self/sharegpt>`.
"""

from __future__ import annotations

import json
from pathlib import Path

from harness import parser, print_result

ROOT = Path(__file__).resolve().parents[1]
TARGET = "embedded:smollm2-135m-instruct"


def ensure_features(data: str, limit: int, out: Path) -> None:
    from draftsmith.jobs.extract import ExtractConfig, extract

    if not (out / "manifest.json").is_file():
        extract(ExtractConfig(target=TARGET, data=data, out=str(out), limit=limit, max_length=512,
                              layer_ids=[2, 15, 27]))


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--limit", type=int, default=400)
    ap.add_argument("--self_limit", type=int, default=None,
                    help="chats regenerated for the self arm (default: --limit)")
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--decode_prompts", type=int, default=20)
    ap.add_argument("--max_new_tokens", type=int, default=128)
    ap.add_argument("--tree", default="6,10,60")
    ap.add_argument("--recipe", default="recipes/smollm2-135m/eagle-cpu.yaml")
    ap.add_argument("--engine", choices=("transformers", "vllm"), default="transformers",
                    help="who regenerates the self arm's answers")
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench-self-distill"))
    args = ap.parse_args()
    from hass_vs_eagle import decode_tau, train_and_score

    from draftsmith.jobs.regenerate import RegenerateConfig, regenerate
    from draftsmith.eval.prompts import first_turn_ids
    from draftsmith.models.target import load_target

    self_limit = args.self_limit or args.limit
    runs = ROOT / "runs" / "smollm2-135m"
    tag = "" if args.engine == "transformers" else f"-{args.engine}"
    chats = runs / f"sharegpt-self{tag}.jsonl"
    summary = regenerate(RegenerateConfig(target=TARGET, data="sharegpt", out=str(chats), limit=self_limit,
                                          max_new_tokens=256, max_length=1024, engine=args.engine))
    conversations = summary['already_done'] + summary['conversations']
    print(f"regenerated chats: {chats} ({conversations} conversations, {summary['seconds']} s, "
          f"{summary.get('answer_tokens_per_second')} answer tok/s, {args.engine})", flush=True)
    arms = {"sharegpt": ("sharegpt", args.limit, runs / f"features-sharegpt-{args.limit}"),
            "self": (str(chats), self_limit, runs / f"features-self{tag}-{self_limit}")}
    for name, (data, limit, features) in arms.items():
        ensure_features(data, limit, features)
        manifest = json.loads((features / "manifest.json").read_text())
        print(f"{name}: {manifest['num_records']} chats, {manifest['num_tokens']} tokens, "
              f"{manifest['num_loss_tokens']} loss tokens", flush=True)
    target = load_target(TARGET, dtype="bfloat16")
    prompts = first_turn_ids(target, "mtbench", args.decode_prompts)
    taus = {}
    for name, (_, _, features) in arms.items():
        figures, module = train_and_score(args.recipe, args.steps, 3, Path(args.out) / f"{Path(args.recipe).stem}-{name}{tag}",
                                          overrides=("--data.init_args.features_dir", str(features)))
        stats = decode_tau(module, target, prompts, args.max_new_tokens, args.tree)
        taus[name] = stats["tau"]
        print(f"{name}: val tau {figures['tau']:.3f} (own validation split), MT-bench decoding {len(prompts)} x "
              f"{args.max_new_tokens} tokens, trees {args.tree}: tau {stats['tau']:.3f}, alpha by depth "
              f"{[round(a, 3) for a in stats['alpha'] if a is not None]}, {figures['seconds']:.0f} s training",
              flush=True)
    print_result(f"tau_sharegpt={taus['sharegpt']:.3f} tau_self={taus['self']:.3f} "
          f"ratio={taus['self'] / taus['sharegpt']:.3f} steps={args.steps} limit={args.limit} self_limit={self_limit} "
          f"engine={args.engine} recipe={Path(args.recipe).stem}")


if __name__ == "__main__":
    main()
