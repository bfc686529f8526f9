"""HASS against EAGLE on the same SmolLM2 features and the same step budget, one run.

Trains the drafter of recipes/smollm2-135m/eagle-cpu.yaml and of hass-cpu.yaml for the
same number of optimizer steps over the same batches (same seed, same features), then
scores both on the same validation chats with the same yardstick: the simulated
acceptance length τ̂ of a greedy chain of `--chain` drafted tokens, where every drafted
token after the first is made from the drafter's own features (as at decoding time).

    python benchmarks/hass_vs_eagle.py [--steps 240] [--chain 3]

Ends with `RESULT tau_eagle=... tau_hass=... ratio=<HASS/EAGLE>`; the target is ratio >= 1.05.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train_and_score(recipe: str, steps: int, chain: int, out: Path, overrides: tuple[str, ...] = ()) -> dict[str, float]:
    from draftsmith.cli import lightning_cli
    from draftsmith.train.metrics import DraftAcceptance

    cli = lightning_cli(["--config", str(ROOT / recipe), "--trainer.max_steps", str(steps),
                         "--trainer.default_root_dir", str(out), "--trainer.logger", "false",
                         "--trainer.callbacks", "[]", "--trainer.enable_checkpointing", "false",
                         "--trainer.val_check_interval", str(steps), "--trainer.enable_progress_bar", "false",
                         *overrides], run=False)
    start = time.perf_counter()
    cli.trainer.fit(cli.model, cli.datamodule)
    seconds = time.perf_counter() - start
    model = cli.model
    model.hparams.alignment_steps = chain  # the same chain for both drafters
    model.val_metric = DraftAcceptance(chain, model.hparams.metric_top_k)
    metrics = cli.trainer.validate(model, cli.datamodule, verbose=False)[0]
    return {"tau": metrics["val/tau"], "tau_t1": metrics["val/tau_t1"], "seconds": seconds,
            **{f"acc_{j}": metrics[f"val/acc_{j}"] for j in range(chain)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--chain", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench-hass-vs-eagle"))
    args = ap.parse_args()
    results = {}
    for name, recipe in (("eagle", "recipes/smollm2-135m/eagle-cpu.yaml"), ("hass", "recipes/smollm2-135m/hass-cpu.yaml")):
        results[name] = train_and_score(recipe, args.steps, args.chain, Path(args.out) / name)
        r = results[name]
        print(f"{name}: tau {r['tau']:.3f} (T=1: {r['tau_t1']:.3f}), per-step top-1 "
              f"{[round(r[f'acc_{j}'], 3) for j in range(args.chain)]}, {r['seconds']:.0f} s training", flush=True)
    ratio = results["hass"]["tau"] / results["eagle"]["tau"]
    print(f"same features, {args.steps} steps each, greedy chain of {args.chain}: HASS/EAGLE tau ratio {ratio:.3f}")
    print(f"RESULT tau_eagle={results['eagle']['tau']:.3f} tau_hass={results['hass']['tau']:.3f} ratio={ratio:.3f} "
          f"steps={args.steps}")


if __name__ == "__main__":
    main()
