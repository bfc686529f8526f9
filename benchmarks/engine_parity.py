"""The τ draftsmith reports against the τ vLLM gets serving the same exports, one run.

For each native drafter export given (all of one target: the one their configs name), the engine
formats its kind has are written from the checkpoint the export names (EAGLE-1/HASS: `eagle`; EAGLE-3:
`eagle3` and `speculators`; P-EAGLE, DFlash, DSpark: `speculators`). The same
target (the dequantized directory the speculators config names as its verifier), prompts (MT-bench
first turns, the target's chat template) and chain length K are then decoded greedily in fp32,
batch 1, one prompt at a time:

- by draftsmith's runtime (chain drafts of K, static policy), in this process;
- by vLLM (`make engines` installs its CPU build in .venv-engines), in a subprocess of that
  virtualenv per format. The speculators export is started as a user would serve it, from its
  directory alone (`LLM(model=EXPORT)`: vLLM reads the verifier and K from the config); the eagle and
  eagle3 exports through `speculative_config`. vLLM's spec-decode counters give its mean acceptance
  length (1 + accepted / drafts) and per-position acceptance (accepted at position j / drafts).

Per format it prints both τ, both per-position acceptance rates, the share of prompts whose outputs
are token-for-token identical, and both tokens/s (the same prompts, one at a time, after a warm-up).

    python benchmarks/engine_parity.py --drafter DIR [--drafter DIR2] [--limit 20] [--k 3]
                                       [--max_new_tokens 256] [--compile]

Ends with one `RESULT format=... tau_vllm=... tau_draftsmith=... identical=...` line per format, or
`RESULT format=... vllm_refused="..."` with the engine's own words where vLLM refuses the drafter or its
target (vLLM 0.32 captures no EAGLE-3 features from a Gemma 3 target).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

from harness import parser

ROOT = Path(__file__).resolve().parents[1]
ENGINES_PYTHON = ROOT / ".venv-engines" / "bin" / "python"


def vllm_worker(job_file: str) -> None:
    """Runs in .venv-engines: serve one export with vLLM and write outputs, counters and timings."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(Path(job_file).read_text())
    kwargs = dict(dtype="float32", max_model_len=job["max_model_len"], enforce_eager=not job["compile"], seed=0,
                  disable_log_stats=False)
    start = time.perf_counter()
    if job["format"] == "speculators":  # from the export directory alone, as `vllm serve EXPORT` would
        llm = LLM(model=job["export"], **kwargs)
    else:
        llm = LLM(model=job["target"], speculative_config={"method": job["format"], "model": job["export"],
                                                           "num_speculative_tokens": job["k"]}, **kwargs)
    load_seconds = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"], stop_token_ids=job["eos"])
    llm.generate([TokensPrompt(prompt_token_ids=job["prompts"][0])], params, use_tqdm=False)  # warm-up

    def counters() -> dict:
        out = {}
        for m in llm.get_metrics():
            if m.name.startswith("vllm:spec_decode"):
                out[m.name] = list(m.values) if hasattr(m, "values") else m.value
        return out

    before, outputs, seconds = counters(), [], 0.0
    for ids in job["prompts"]:
        start = time.perf_counter()
        result = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        seconds += time.perf_counter() - start
        outputs.append(list(result[0].outputs[0].token_ids))
    after = counters()
    delta = {k: ([a - b for a, b in zip(v, before.get(k, [0] * len(v)))] if isinstance(v, list) else v - before.get(k, 0))
             for k, v in after.items()}
    Path(job["out"]).write_text(json.dumps({"outputs": outputs, "seconds": seconds, "counters": delta,
                                            "load_seconds": load_seconds,
                                            "speculative_tokens": llm.llm_engine.vllm_config.speculative_config.num_speculative_tokens}))


def draftsmith_arm(drafter: str, target_name: str, prompts: list[list[int]], k: int, max_new_tokens: int,
                   eos: tuple[int, ...]) -> dict:
    """draftsmith's runtime: chain drafts of k, greedy, fp32, batch 1, after a warm-up."""
    from draftsmith.eval.acceptance import acceptance_stats
    from draftsmith.runtime.loading import load_proposer
    from draftsmith.models.target import load_target
    from draftsmith.runtime.generate import generate
    from draftsmith.runtime.runner import TargetRunner
    from draftsmith.runtime.policies import Static
    from draftsmith.runtime.sampling import SamplingConfig

    target = load_target(target_name, dtype="float32")
    proposer, _ = load_proposer(drafter, target)
    runner = TargetRunner(target.model, proposer.aux_layer_ids)
    generate(runner, proposer, prompts[0], max_new_tokens, Static(k), SamplingConfig(), eos_token_ids=eos)  # warm-up
    results, seconds = [], 0.0
    for ids in prompts:
        start = time.perf_counter()
        results.append(generate(runner, proposer, ids, max_new_tokens, Static(k), SamplingConfig(), eos_token_ids=eos))
        seconds += time.perf_counter() - start
    rounds = [r for res in results for r in res.rounds]
    stats = acceptance_stats(results)
    return {"outputs": [res.tokens for res in results], "seconds": seconds, "tau": stats["tau"],
            "per_position": [sum(r.accepted > j for r in rounds) / len(rounds) for j in range(k)]}


def vllm_arm(fmt: str, export_dir: Path, target_dir: str, prompts: list[list[int]], k: int, max_new_tokens: int,
             eos: tuple[int, ...], compile_: bool, work: Path) -> dict:
    job = {"format": fmt, "export": str(export_dir), "target": target_dir, "prompts": prompts, "k": k,
           "max_new_tokens": max_new_tokens, "eos": list(eos), "compile": compile_, "out": str(work / f"vllm-{fmt}.json"),
           "max_model_len": max(len(p) for p in prompts) + max_new_tokens + 2 * k + 8}
    (work / f"job-{fmt}.json").write_text(json.dumps(job))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(work / f"vllm-{fmt}.log", "w") as log:
        done = subprocess.run([str(ENGINES_PYTHON), __file__, "--vllm_worker", str(work / f"job-{fmt}.json")],
                              stdout=log, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:  # the engine's own refusal: the first error it names
        log = (work / f"vllm-{fmt}.log").read_text()
        errors = [line.split("] ", 1)[-1] for line in log.splitlines() if "Error: " in line and "File " not in line]
        # a config validation names its reason on the next line: "Value error, <reason> [type=...]"
        errors = [line.split("Value error, ", 1)[1].split(" [type=")[0] for line in log.splitlines()
                  if "Value error, " in line] + errors
        return {"refused": errors[0] if errors else log[-500:], "log": str(work / f"vllm-{fmt}.log")}
    result = json.loads(Path(job["out"]).read_text())
    c = result["counters"]
    drafts = c["vllm:spec_decode_num_drafts"]
    result["tau"] = 1 + c["vllm:spec_decode_num_accepted_tokens"] / drafts
    result["per_position"] = [a / drafts for a in c["vllm:spec_decode_num_accepted_tokens_per_pos"]]
    return result


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--drafter", action="append", help="a native feature-drafter export (repeatable)")
    ap.add_argument("--limit", type=int, default=20, help="MT-bench first turns")
    ap.add_argument("--k", type=int, default=3, help="chain length K (drafted tokens per round)")
    ap.add_argument("--max_new_tokens", type=int, default=256)
    ap.add_argument("--compile", action="store_true", help="let vLLM compile (default: eager, as draftsmith runs)")
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench" / "engine_parity"))
    ap.add_argument("--vllm_worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.vllm_worker:
        return vllm_worker(args.vllm_worker)
    if not args.drafter:
        ap.error("give at least one --drafter (a native export of an EAGLE/HASS or EAGLE-3 drafter)")
    if not ENGINES_PYTHON.is_file():
        raise SystemExit("vLLM lives in .venv-engines: run `make engines` first")
    import torch

    from draftsmith.eval.prompts import first_turn_ids
    from draftsmith.export import export
    from draftsmith.export.speculators import verifier_path
    from draftsmith.models.registry import drafter_kind
    from draftsmith.models.target import load_target

    torch.manual_seed(0)
    targets = {json.loads((Path(d) / "config.json").read_text())["target"]["name"] for d in args.drafter}
    if len(targets) != 1:
        raise SystemExit(f"the drafters were trained for different targets {sorted(targets)}: compare one target at a time")
    target_name = targets.pop()  # the name it was trained with (an embedded alias brings its chat template)
    target = load_target(target_name, dtype="float32")
    target_dir = verifier_path(target.identity.as_dict(), None)
    prompts = first_turn_ids(target, "mtbench", args.limit)
    eos = tuple(target.eos_token_ids)
    del target
    lines = []
    for drafter in args.drafter:
        config = json.loads((Path(drafter) / "config.json").read_text())
        kind, checkpoint = config["kind"], config["provenance"]["checkpoint"]
        formats = drafter_kind(kind).engine_formats()
        if not formats:
            raise SystemExit(f"{drafter}: a {kind} drafter has no vLLM format (feature drafters only)")
        work = Path(args.out) / Path(drafter).parent.name
        work.mkdir(parents=True, exist_ok=True)
        ours = draftsmith_arm(drafter, target_name, prompts, args.k, args.max_new_tokens, eos)
        ours_tps = sum(len(o) for o in ours["outputs"]) / ours["seconds"]
        print(f"{Path(drafter).parent.name} draftsmith: tau {ours['tau']:.3f}, per position "
              f"{[round(a, 3) for a in ours['per_position']]}, {ours_tps:.1f} tok/s", flush=True)
        for fmt in formats:
            export_dir = work / fmt
            export(checkpoint, fmt, str(export_dir), speculative_tokens=args.k)
            theirs = vllm_arm(fmt, export_dir / "vllm" if fmt != "speculators" else export_dir, target_dir, prompts,
                              args.k, args.max_new_tokens, eos, args.compile, work)
            if "refused" in theirs:
                print(f"  vLLM {fmt}: refused: {theirs['refused']} (log: {theirs['log']})", flush=True)
                lines.append(f"RESULT format={fmt} drafter={Path(drafter).parent.name} tau_draftsmith={ours['tau']:.3f} "
                             f"vllm_refused=\"{theirs['refused']}\"")
                continue
            if theirs["speculative_tokens"] != args.k:
                raise SystemExit(f"vLLM drafted {theirs['speculative_tokens']} tokens per round, not {args.k}")
            same = sum(a == b for a, b in zip(ours["outputs"], theirs["outputs"])) / len(prompts)
            theirs_tps = sum(len(o) for o in theirs["outputs"]) / theirs["seconds"]
            print(f"  vLLM {fmt}: tau {theirs['tau']:.3f}, per position {[round(a, 3) for a in theirs['per_position']]}, "
                  f"{theirs_tps:.1f} tok/s (loaded in {theirs['load_seconds']:.0f} s); identical outputs "
                  f"{same:.0%} of {len(prompts)} prompts", flush=True)
            lines.append(f"RESULT format={fmt} drafter={Path(drafter).parent.name} tau_vllm={theirs['tau']:.3f} "
                         f"tau_draftsmith={ours['tau']:.3f} diff={abs(theirs['tau'] - ours['tau']):.3f} "
                         f"identical={same:.2f} tps_vllm={theirs_tps:.1f} tps_draftsmith={ours_tps:.1f} k={args.k}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
