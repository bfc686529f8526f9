"""Extraction, training and eval at long contexts on this machine: the peak resident memory and time of each.

Each stage runs in its own process (its peak resident memory is the kernel's rusage of that process):
- extract: `draftsmith extract --max_length LENGTH --pack LENGTH` of the first --chats embedded chats, joined
  exchange after exchange into conversations of up to LENGTH tokens in the target's chat template (a longer
  chat stays alone, cut at LENGTH);
- fit: the eagle3-cpu recipe on those features for --steps steps, one LENGTH-token sequence a step;
- eval: `draftsmith eval --prompts long` of that drafter (4 prompts at 2k, 4k and the window each, --limit
  of them) against the target alone, with the τ of each context-position bucket.

    python benchmarks/long_context.py --length 8192 --chats 64 --steps 10

Ends with `RESULT records=... tokens=... peak_gib_extract=... s_extract=... peak_gib_fit=... s_per_step=... peak_gib_eval=... s_eval=...
tau_<bucket>=... alpha1_<bucket>=...` (buckets as eval names them: lt512, 2k_4k, ...).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import clock_seconds, newest_train_log, parser, print_result

ROOT = Path(__file__).resolve().parent.parent
TARGET = "embedded:smollm2-135m-instruct"


def stage(args: list[str]) -> tuple[float, float]:
    """(peak GiB, seconds) of one draftsmith command in its own process."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "draftsmith"), *args], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=log)
        _, status, usage = os.wait4(proc.pid, 0)
        if os.waitstatus_to_exitcode(status):
            log.seek(0)
            raise SystemExit(f"draftsmith {' '.join(args)} failed:\n{log.read()[-3000:]}")
    return usage.ru_maxrss / 2**20, time.perf_counter() - start


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--length", type=int, default=8192, help="tokens a training conversation holds")
    p.add_argument("--chats", type=int, default=64, help="embedded chats read, packed into conversations of --length")
    p.add_argument("--steps", type=int, default=10, help="training steps")
    p.add_argument("--limit", type=int, default=6, help="long prompts evaluated (spread over 2k, 4k, the window)")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--dtype", default="auto")
    args = p.parse_args()
    out: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        peak, seconds = stage(["extract", "--target", TARGET, "--data", "sharegpt", "--limit", str(args.chats),
                               "--pack", str(args.length), "--out", str(tmp / "features"), "--max_length",
                               str(args.length), "--dtype", args.dtype, "--layer_ids", "[2,15,27]"])
        manifest = json.loads((tmp / "features" / "manifest.json").read_text())
        out.update(records=str(manifest["num_records"]), tokens=str(manifest["num_tokens"] // manifest["num_records"]))
        out.update(peak_gib_extract=f"{peak:.2f}", s_extract=f"{seconds:.0f}")
        peak, _ = stage(["fit", "--config", "recipes/smollm2-135m/eagle3-cpu.yaml", "--data.init_args.features_dir",
                         str(tmp / "features"), "--data.init_args.max_length", str(args.length),
                         "--data.init_args.max_tokens", str(args.length), "--data.init_args.val_fraction", "0.2",
                         "--trainer.max_steps", str(args.steps), "--trainer.max_time", "null",
                         "--trainer.val_check_interval", str(args.steps), "--trainer.limit_val_batches", "2",
                         "--trainer.default_root_dir", str(tmp / "run"), "--trainer.enable_progress_bar", "false"])
        done = newest_train_log(tmp / "run").read_text()
        steps, clock = re.search(r"done: (\d+) steps in ([0-9:]+)", done).groups()
        out.update(peak_gib_fit=f"{peak:.2f}", s_per_step=f"{clock_seconds(clock) / int(steps):.2f}")
        ckpt = max((tmp / "run").rglob("*.ckpt"), key=lambda c: c.stat().st_mtime)
        stage(["export", str(ckpt), "--format", "native", "--out", str(tmp / "export")])
        peak, seconds = stage(["eval", "--target", TARGET, "--drafter", str(tmp / "export"), "--prompts", "long",
                               "--limit", str(args.limit), "--max_new_tokens", str(args.max_new_tokens), "--repeats", "1",
                               "--policy", "static", "--k", "3", "--dtype", args.dtype, "--out", str(tmp / "eval")])
        out.update(peak_gib_eval=f"{peak:.2f}", s_eval=f"{seconds:.0f}")
        results = json.loads((tmp / "eval" / "results.json").read_text())
        for bucket, g in results["per_position"].items():
            name = bucket.replace("<", "lt").replace("≥", "ge").replace("–", "_")
            out[f"tau_{name}"], out[f"alpha1_{name}"] = f"{g['tau']:.2f}", f"{g['alpha'][0] or 0:.2f}"
    print_result(out)


if __name__ == "__main__":
    main()
