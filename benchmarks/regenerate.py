"""Regeneration speed: transformers' batched generate, vLLM's offline engine and a local `vllm serve`.

The same first user turns of `--prompts` ShareGPT conversations (default 200), `--max_new_tokens` each
(default 256), answered by the target (the embedded default) through `draftsmith regenerate`'s three
answerers in one process and through the command's own loop (`regenerate_chunk`: prompts grouped by
length, a prompt without room for a full answer within `--max_length` skipped, as `regenerate` does):
transformers' generate in batches of `--batch_size` (regenerate's default 16), vLLM's `LLM` fed every
prompt of a pass at once, and an OpenAI-compatible `vllm serve` on a free 127.0.0.1 port with
`--concurrency` requests in flight. The prompts are split into `--passes` passes and the arms alternate
within each pass (their order rotated), so a busy neighbour weighs on all alike. One dtype for all
(`--dtype auto`: measured on this machine for batched work). Tokens/s counts the answer tokens each arm
generated over its seconds; greedy (T = 0), so the arms' answers are also compared.

Runs in .venv-engines (vLLM's CPU build beside draftsmith, `make engines`):

    .venv-engines/bin/python benchmarks/regenerate.py [--prompts 200] [--max_new_tokens 256]

Ends with `RESULT tps_transformers=... tps_vllm=... tps_endpoint=... ratio_vllm=... ratio_endpoint=...
identical_vllm=... identical_endpoint=...` (ratios over transformers; identical_*: the share of answers
equal to transformers').
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
import urllib.request
from pathlib import Path
from types import SimpleNamespace

from harness import machine, parser, print_result

ROOT = Path(__file__).resolve().parents[1]
TARGET = "embedded:smollm2-135m-instruct"


def start_server(source: str, dtype: str, max_len: int, log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", source,
                                 "--served-model-name", "target", "--host", "127.0.0.1", "--port", str(port),
                                 "--dtype", dtype, "--max-model-len", str(max_len), "--seed", "0"],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while True:
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=5).read()
            return proc, url
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"vllm serve did not start; its log: {log}")
            time.sleep(1)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--max_new_tokens", type=int, default=256)
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--max_length", type=int, default=2048, help="prompt + answer tokens (regenerate's default)")
    ap.add_argument("--batch_size", type=int, default=16, help="transformers' batch")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight at the endpoint")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-regenerate")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    from draftsmith.data.conversations import load_conversations
    from draftsmith.jobs.answerers import EndpointAnswerer, GenerateAnswerer, VllmAnswerer
    from draftsmith.jobs.regenerate import regenerate_chunk
    from draftsmith.models.precision import resolve_dtype
    from draftsmith.models.sources import resolve_source
    from draftsmith.models.target import load_target

    args.out.mkdir(parents=True, exist_ok=True)
    dtype = resolve_dtype(args.dtype, "cpu", "bulk")
    convs, _ = load_conversations("sharegpt", limit=args.prompts)
    target = load_target(TARGET, dtype=dtype)
    cfg = SimpleNamespace(target=TARGET, max_new_tokens=args.max_new_tokens, temperature=0.0, top_p=None, top_k=None,
                          seed=0, reasoning="keep", batch_size=args.batch_size, trust_remote_code=False,
                          max_length=args.max_length, turns="first", served_model=None, concurrency=args.concurrency,
                          retries=3, retry_wait=2.0, request_timeout=1800.0)
    print(f"{len(convs)} prompts × {args.max_new_tokens} tokens, {dtype}; {machine()}", flush=True)
    server, url = start_server(resolve_source(TARGET), dtype, args.max_length, args.out / "server.log")
    try:
        answerers = {"transformers": GenerateAnswerer(target, cfg),
                     "vllm": VllmAnswerer(resolve_source(TARGET), target.tokenizer, cfg, dtype),
                     "endpoint": EndpointAnswerer(url, target.tokenizer, cfg)}
        size = -(-len(convs) // args.passes)
        answers: dict[str, dict] = {name: {} for name in answerers}
        counts: dict[str, Counter] = {name: Counter() for name in answerers}
        seconds: dict[str, float] = {name: 0.0 for name in answerers}
        for i, begin in enumerate(range(0, len(convs), size)):
            names = list(answerers)
            for name in names[i % len(names):] + names[:i % len(names)]:  # the order rotated from pass to pass
                start = time.perf_counter()
                records = regenerate_chunk(answerers[name], target.encode_chat, convs[begin:begin + size], cfg,
                                           counts[name])
                seconds[name] += time.perf_counter() - start
                answers[name].update((r["id"], r["messages"][-1]["content"]) for r in records)
            print({name: f"{len(answers[name])} answers, {counts[name]['answer_tokens'] / seconds[name]:.1f} tok/s"
                   for name in answerers}, flush=True)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
    tps = {name: counts[name]["answer_tokens"] / seconds[name] for name in answerers}
    base = answers["transformers"]
    same = {name: sum(answers[name].get(k) == text for k, text in base.items()) / len(base) for name in ("vllm", "endpoint")}
    print_result({**{f"tps_{k}": f"{v:.1f}" for k, v in tps.items()},
                  "ratio_vllm": f"{tps['vllm'] / tps['transformers']:.2f}",
                  "ratio_endpoint": f"{tps['endpoint'] / tps['transformers']:.2f}",
                  **{f"identical_{k}": f"{v:.2f}" for k, v in same.items()}, "prompts": len(convs),
                  "answered": len(base), "answer_tokens": counts["transformers"]["answer_tokens"],
                  "max_new_tokens": args.max_new_tokens, "dtype": dtype})


if __name__ == "__main__":
    main()
