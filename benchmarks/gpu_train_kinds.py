"""DFlash and P-EAGLE trained online on one GPU against a random-weight 8B-shaped target.

The 8B GPU recipes (recipes/llama-3.1-8b-instruct/dflash-8gpu-fsdp.yaml: FSDP, and peagle-8gpu-ddp.yaml:
DDP) run as written, on one device, for a few hundred steps: the target (random weights of the
Llama-3.1-8B shape, `--shape`; nothing is downloaded, and no weights travel) runs inside every step
(online features of its layers 2, 16, 29), the drafter trains under the recipe's strategy and bf16-mixed
precision. Each arm prints its training tokens/s (the real tokens of the batches, after `--warmup`
steps), seconds per step, peak GPU memory (`torch.cuda.max_memory_allocated`) and its loss at the start
and the end.

The chats and the tokenizer come from the embedded default (SmolLM2's tokenizer, its ids inside the 8B
shape's vocabulary; ShareGPT), written once where the package is installed:

    python benchmarks/gpu_train_kinds.py --prepare .gpu          # here: tokenizer, config, chats
    python benchmarks/gpu_train_kinds.py --assets .gpu           # on the GPU: both arms, RESULT line

Each arm runs in its own process (a clean peak-memory reading) and stops at `--steps` or `--minutes`,
whichever comes first. Ends with `RESULT gpu=... dflash_fsdp_tokens_per_s=... dflash_fsdp_peak_gib=...
dflash_fsdp_loss_first=... dflash_fsdp_loss_last=... peagle_ddp_...`. Arguments after `--` go to every
arm's `draftsmith fit` (a CPU dry run of the plumbing: `--device cpu --shape smollm2-135m --layers 4 --
--trainer.strategy auto --model.init_args.aux_layer_ids [0,1,2]`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from harness import parser, print_result

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes" / "llama-3.1-8b-instruct"
ARMS = {"dflash_fsdp": RECIPES / "dflash-8gpu-fsdp.yaml", "peagle_ddp": RECIPES / "peagle-8gpu-ddp.yaml"}


def prepare(assets: Path, chats: int) -> None:
    """The embedded tokenizer (with its chat template) and the first `chats` ShareGPT conversations."""
    from draftsmith.data.conversations import load_conversations
    from draftsmith.models.sources import EMBEDDED_TARGETS
    from draftsmith.models.target import load_tokenizer

    assets.mkdir(parents=True, exist_ok=True)
    load_tokenizer(next(iter(EMBEDDED_TARGETS))).save_pretrained(assets / "tokenizer")
    convs, _ = load_conversations("sharegpt", limit=chats)
    with open(assets / "chats.jsonl", "w") as f:
        for c in convs:
            f.write(json.dumps({"id": c.id, "messages": c.messages}) + "\n")
    print(f"wrote {assets}/tokenizer and {len(convs)} chats to {assets}/chats.jsonl")


def random_target_dir(assets: Path, shape: str, layers: int | None) -> Path:
    """A model directory of the shape's config and the embedded tokenizer: its weights are made on load."""
    import shutil

    from round_parts import RANDOM_TARGETS
    from transformers import LlamaConfig

    from draftsmith.models.target import load_tokenizer

    out = assets / f"target-{shape}-{layers or 'all'}"
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(assets / "tokenizer", out)
    tok = load_tokenizer(str(out))
    config = LlamaConfig(**{**RANDOM_TARGETS[shape], **({"num_hidden_layers": layers} if layers else {})},
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    config.save_pretrained(out)
    return out


def random_weights_on_load(device: str) -> None:
    """`from_pretrained` of a directory without weights builds the model from its config, on `device`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    def build(source, dtype=None, **_):
        config = AutoConfig.from_pretrained(source)
        torch.manual_seed(0)
        with torch.device(device):
            return AutoModelForCausalLM.from_config(config, dtype=dtype)

    AutoModelForCausalLM.from_pretrained = build


class Throughput:
    """Tokens/s, s/step, peak memory and loss of a training run, after `warmup` steps (a Lightning callback)."""

    def __init__(self, warmup: int):
        import pytorch_lightning as pl

        class Callback(pl.Callback):
            def on_train_start(cb, trainer, module):
                self._reset()

            def on_train_batch_start(cb, trainer, module, batch, batch_idx):
                self.tokens_now = int(batch["attention_mask"].sum())

            def on_train_batch_end(cb, trainer, module, outputs, batch, batch_idx):
                self._step(outputs)

        self.callback, self.warmup = Callback(), warmup

    def _reset(self) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self.steps, self.tokens, self.losses, self.start = 0, 0, [], None

    def _step(self, outputs) -> None:
        from harness import synchronize

        synchronize()
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))
        self.steps += 1
        if self.steps == self.warmup:
            self.start, self.tokens = time.perf_counter(), 0
        elif self.steps > self.warmup:
            self.tokens += self.tokens_now

    def figures(self) -> dict[str, float]:
        import torch

        timed = self.steps - self.warmup
        seconds = time.perf_counter() - self.start if self.start else float("nan")
        first, last = self.losses[:10], self.losses[-10:]
        return {"steps": self.steps, "tokens_per_s": round(self.tokens / seconds, 1) if timed > 0 else float("nan"),
                "s_per_step": round(seconds / timed, 3) if timed > 0 else float("nan"),
                "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else 0.0,
                "loss_first": round(sum(first) / len(first), 4), "loss_last": round(sum(last) / len(last), 4)}


def run_arm(arm: str, target: Path, assets: Path, args, extra: list[str]) -> None:
    """One arm in this process: its recipe on one device, the figures as a JSON line."""
    from draftsmith.train.cli import lightning_cli

    random_weights_on_load(args.device)
    minutes = int(args.minutes * 60)
    overrides = ["--config", str(ARMS[arm]), "--trainer.devices", "1", "--trainer.max_steps", str(args.steps),
                 "--trainer.max_epochs", "-1", "--trainer.max_time", f"00:00:{minutes // 60:02d}:{minutes % 60:02d}",
                 "--trainer.logger", "false", "--trainer.callbacks", "[]", "--trainer.enable_checkpointing", "false",
                 "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
                 "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(assets / "runs" / arm),
                 "--model.init_args.target", str(target), "--model.init_args.warmup_steps", str(args.warmup * 2),
                 "--data.init_args.data", str(assets / "chats.jsonl"), "--data.init_args.max_length", str(args.max_length)]
    if args.max_tokens:
        overrides += ["--data.init_args.max_tokens", str(args.max_tokens)]
    if args.device == "cpu":
        overrides += ["--trainer.accelerator", "cpu"]
    cli = lightning_cli(overrides + extra, run=False)
    meter = Throughput(args.warmup)
    cli.trainer.callbacks.append(meter.callback)
    start = time.perf_counter()
    cli.trainer.fit(cli.model, cli.datamodule)
    figures = {**meter.figures(), "strategy": type(cli.trainer.strategy).__name__,
               "wall_s": round(time.perf_counter() - start, 1)}
    print("ARM " + json.dumps({"arm": arm, **figures}), flush=True)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--prepare", type=Path, help="write the tokenizer and chats to this folder, then stop")
    ap.add_argument("--assets", type=Path, default=ROOT / ".gpu", help="the folder --prepare wrote")
    ap.add_argument("--chats", type=int, default=1000, help="conversations --prepare writes")
    ap.add_argument("--shape", default="llama-3.1-8b", help="the random target's shape (benchmarks/round_cost.py)")
    ap.add_argument("--layers", type=int, default=None, help="its decoder layers (default: the shape's)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {sorted(ARMS)}")
    ap.add_argument("--steps", type=int, default=300, help="training steps an arm runs at most")
    ap.add_argument("--minutes", type=float, default=2.5, help="an arm's training time at most")
    ap.add_argument("--warmup", type=int, default=10, help="steps before the timing starts")
    ap.add_argument("--max_tokens", type=int, default=None, help="padded tokens a batch (default: the recipe's)")
    ap.add_argument("--max_length", type=int, default=2048, help="tokens a chat")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--arm", help=argparse.SUPPRESS)  # the parent runs each arm as `--arm NAME --target DIR`
    ap.add_argument("--target", help=argparse.SUPPRESS)
    args, extra = ap.parse_known_args()
    extra = [a for a in extra if a != "--"]
    if args.prepare:
        return prepare(args.prepare, args.chats)
    if args.arm:
        return run_arm(args.arm, Path(args.target), args.assets, args, extra)

    target = random_target_dir(args.assets, args.shape, args.layers)
    results: dict[str, object] = {}
    if args.device == "cuda":
        import torch

        results["gpu"] = torch.cuda.get_device_name()
    for arm in args.arms.split(","):
        cmd = [sys.executable, __file__, "--arm", arm, "--target", str(target), *sys.argv[1:]]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.minutes * 60 + 240)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ARM ")]
        if proc.returncode or not lines:
            print(proc.stdout[-3000:], proc.stderr[-6000:], sep="\n", file=sys.stderr)
            results[f"{arm}_failed"] = proc.returncode
            continue
        figures = json.loads(lines[-1][4:])
        print(f"{arm}: {figures}", flush=True)
        results.update({f"{arm}_{k}": v for k, v in figures.items() if k != "arm"})
    print_result(results)


if __name__ == "__main__":
    main()
