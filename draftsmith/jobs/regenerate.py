"""`draftsmith regenerate`: the target answers the chats' user turns itself (self-distillation data).

A drafter is judged on the target's own text, so it learns most from features of that text:
the target answers each conversation's user turns (the first only, or every turn after its
own earlier answers), and the chats are written to a .jsonl that `extract --data` reads.
Conversation ids are kept, so the train/validation split is the same as the source's.

Nothing is lost on a crash: records are appended a chunk at a time, and a rerun with the same
settings resumes after the conversations already written, and one with a larger --limit
appends the conversations the file lacks. A rerun with other settings (or another target's
tokenizer) into the same file is refused; the engine may change between runs.

Engines (`--engine`, or `--endpoint URL`): transformers' batched generate on the loaded target (the
default), vLLM's offline engine in this process (`--engine vllm`), or any OpenAI-compatible
chat-completions server (`--endpoint`: `vllm serve`, SGLang, a hosted API) answered `--concurrency`
requests at a time; `answerers.py` holds the three.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

from draftsmith import DraftsmithError
from draftsmith.files import json_lines
from draftsmith.jobs.answerers import REASONING, EndpointAnswerer, GenerateAnswerer, VllmAnswerer
from draftsmith.options import ENGINES, ChatOptions, EngineOptions, SamplingOptions, TargetOptions


@dataclass(kw_only=True)
class RegenerateConfig(TargetOptions, ChatOptions, SamplingOptions, EngineOptions):
    """Options of `draftsmith regenerate` (the target's, the chats', the sampling options' and these).

    Args:
        out: the .jsonl file to write (with OUT.meta.json: target and settings).
        turns: first (answer the first user turn only) or all (every user turn, after the target's own earlier answers).
        max_length: prompt + answer tokens; a turn without room for a full answer ends its conversation.
        batch_size: prompts generated together (grouped by length; the transformers engine).
        chunk: conversations finished and appended to OUT together (the unit of resumption).
        endpoint: the base URL of an OpenAI-compatible chat-completions server (http://HOST:PORT or
            .../v1) to answer instead; it must serve --target (checked: it must render a probe chat to the
            same token ids). Its API key, if any, is read from $DRAFTSMITH_API_KEY or $OPENAI_API_KEY.
        served_model: the model name the endpoint serves --target under (default: its only one).
        concurrency: requests in flight at once (endpoint).
        retries: tries after the first for a request that failed with a 5xx, a timeout or a refused
            connection, waiting retry_wait, then twice that, ... seconds (endpoint); a 4xx is not retried.
        retry_wait: seconds before the first retry.
        request_timeout: seconds one request may take.
        reasoning: keep or drop a model's reasoning trace (<think>…</think>, or the server's separate
            reasoning field, put back in front of the answer) in the answers written.
    """

    out: str
    turns: str = "first"
    max_length: int = 2048
    batch_size: int = 16
    chunk: int = 64
    endpoint: str | None = None
    served_model: str | None = None
    concurrency: int = 8
    retries: int = 5
    retry_wait: float = 2.0
    request_timeout: float = 600.0
    reasoning: str = "keep"

    def __post_init__(self) -> None:
        self.check_engine()
        if self.endpoint is not None and self.engine != ENGINES[0]:
            raise DraftsmithError("--endpoint answers through a server: leave --engine out")
        if self.reasoning not in REASONING:
            raise DraftsmithError(f"--reasoning must be one of {', '.join(REASONING)}, got {self.reasoning!r}")
        if self.concurrency < 1 or self.retries < 0 or self.retry_wait < 0 or self.request_timeout <= 0:
            raise DraftsmithError("--concurrency must be >= 1, --retries and --retry_wait >= 0, --request_timeout > 0")
        if self.turns not in ("first", "all"):
            raise DraftsmithError(f"--turns must be first or all, got {self.turns!r}")
        if not self.out.endswith(".jsonl"):
            raise DraftsmithError(f"--out must name a .jsonl file (extract reads it as --data), got {self.out!r}")
        for name in ("max_new_tokens", "batch_size", "chunk"):
            if getattr(self, name) < 1:
                raise DraftsmithError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.max_length <= self.max_new_tokens:
            raise DraftsmithError(f"--max_length ({self.max_length}) must exceed --max_new_tokens ({self.max_new_tokens})")
        if self.temperature < 0:
            raise DraftsmithError(f"--temperature must be >= 0, got {self.temperature}")

    def settings(self) -> dict[str, Any]:
        """What decides the answers: a resumed file must have been written with the same. Not `limit`:
        the first N conversations of a source are a prefix of its first M > N, so a larger limit extends a file."""
        keep = ("data", "turns", "max_new_tokens", "max_length", "temperature", "top_k", "top_p", "seed", "reasoning")
        return {k: v for k, v in asdict(self).items() if k in keep}


def _meta_path(out: Path) -> Path:
    return out.with_name(out.name + ".meta.json")


def _done_ids(out: Path) -> set[str]:
    """Ids of the records already in OUT; a last line cut by a crash is dropped from the file."""
    if not out.exists():
        return set()
    lines = json_lines(out.read_text(encoding="utf-8"))
    done, good = set(), []
    for line in lines:
        try:
            done.add(json.loads(line)["id"])
            good.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            break  # only the last append can be partial
    if len(good) < len(lines):
        out.write_text("".join(good), encoding="utf-8")
    return done


def _check_meta(out: Path, meta: dict[str, Any]) -> None:
    path = _meta_path(out)
    if path.exists():
        old = json.loads(path.read_text())
        diffs = [f"{k}: {old.get(k)!r} in the file, {v!r} now" for k, v in meta.items() if k != "target" and old.get(k) != v]
        theirs, mine = old.get("target", {}).get("tokenizer_hash"), meta["target"]["tokenizer_hash"]
        if theirs != mine:
            diffs.append(f"the target's tokenizer: {theirs} in the file, {mine} now ({meta['target']['name']})")
        if diffs:
            raise DraftsmithError(f"{out} was written with other settings ({'; '.join(diffs)}); "
                                  "use another --out or delete it")
    elif out.exists() and out.stat().st_size:
        raise DraftsmithError(f"{out} exists but was not written by `draftsmith regenerate`; use another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(meta, indent=1))


def regenerate_chunk(answerer: Any, prompt_ids: Callable[[list[dict]], list[int]], convs: list[Any],
                     cfg: RegenerateConfig, counts: Counter,
                     advance: Callable[[int], None] = lambda n: None) -> list[dict[str, Any]]:
    """The chunk's conversations with their assistant turns replaced by the target's answers.

    Turn by turn across the chunk (turn t of every conversation that still has one, batched by
    prompt length); a conversation ends at an empty answer, a turn with no room left within
    max_length, or after its first turn with turns=first. Conversations without any answer are
    dropped (counted)."""
    states = []
    for conv in convs:
        system = conv.messages[:1] if conv.messages[0]["role"] == "system" else []
        users = [m["content"] for m in conv.messages[len(system):] if m["role"] == "user"]
        states.append({"conv": conv, "messages": list(system), "users": users[:1] if cfg.turns == "first" else users,
                       "open": True, "answers": 0})
    turn = 0
    while True:
        active = [s for s in states if s["open"] and turn < len(s["users"])]
        if not active:
            break
        prompts = []
        for s in active:
            s["messages"].append({"role": "user", "content": s["users"][turn]})
            prompts.append(prompt_ids(s["messages"]))
        room = [cfg.max_length - len(p) - cfg.max_new_tokens for p in prompts]
        ready = []
        for s, p, r in zip(active, prompts, room):
            if r < 0:
                s["messages"].pop()
                s["open"] = False
                counts["turns_without_room"] += 1
            else:
                ready.append((len(p), p, s))
        ready.sort(key=lambda x: x[0])
        size = answerer.batch_size or len(ready) or 1
        for b in range(0, len(ready), size):
            batch = ready[b:b + size]
            for (_, _, s), (text, tokens, ended) in zip(batch, answerer.answer([(s["messages"], p) for _, p, s in batch])):
                text = text.strip()
                counts["answer_tokens"] += tokens
                if not text:
                    s["messages"].pop()
                    s["open"] = False
                    counts["empty_answers"] += 1
                    continue
                s["messages"].append({"role": "assistant", "content": text})
                s["answers"] += 1
                counts["answers"] += 1
                counts["answers_cut_at_max_new_tokens"] += not ended
        turn += 1
    records = []
    for s in states:
        if s["answers"]:
            records.append({"id": s["conv"].id, "messages": s["messages"]})
        else:
            counts["conversations_without_answer"] += 1
        advance(1)
    return records


def regenerate(cfg: RegenerateConfig, console: Any = None) -> dict[str, Any]:
    """Answer the chats with the target and append them to cfg.out; returns the run's summary."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from draftsmith.data.conversations import load_conversations
    from draftsmith.models.target import encode_chat, load_tokenizer
    from draftsmith.models.tokenizer import tokenizer_hash
    from draftsmith.progress import Bars

    console = console or Console(stderr=True)
    out = Path(cfg.out)
    convs, report = load_conversations(cfg.data, limit=cfg.limit)
    if not convs:
        raise DraftsmithError(f"{cfg.data}: no usable conversations ({report.as_dict()['skipped']})")
    tokenizer = load_tokenizer(cfg.target, trust_remote_code=cfg.trust_remote_code,
                               chat_template=cfg.chat_template, template_kwargs=cfg.template_kwargs)
    meta = {"format": "draftsmith-regenerated-chats", "target": {"name": cfg.target, "tokenizer_hash": tokenizer_hash(tokenizer)},
            **cfg.settings()}
    _check_meta(out, meta)
    done = _done_ids(out)
    todo = [c for c in convs if c.id not in done]
    counts: Counter = Counter()
    answerer = _answerer(cfg, tokenizer, console) if todo else None
    prompt_ids = partial(encode_chat, tokenizer)
    start = time.perf_counter()
    with Bars(TextColumn("[bold]regenerate"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=console) as progress:
        task = progress.add_task("regenerate", total=len(convs), completed=len(convs) - len(todo))
        for c in range(0, len(todo), cfg.chunk):
            records = regenerate_chunk(answerer, prompt_ids, todo[c:c + cfg.chunk], cfg, counts,
                                       lambda n: progress.advance(task, n))
            with out.open("a", encoding="utf-8") as f:
                f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    seconds = time.perf_counter() - start
    return {"out": str(out), "engine": cfg.endpoint or cfg.engine, "source": report.as_dict(), "already_done": len(convs) - len(todo),
            "conversations": len(todo), "seconds": round(seconds, 1),
            "answer_tokens_per_second": round(counts["answer_tokens"] / seconds, 1) if seconds else None,
            **dict(counts)}


def _answerer(cfg: RegenerateConfig, tokenizer: Any, console: Any) -> Any:
    """The engine that answers: an endpoint, vLLM in this process, or transformers on the loaded target."""
    import os

    from draftsmith.models.precision import resolve_dtype
    from draftsmith.models.sources import resolve_source
    from draftsmith.models.target import load_target

    if cfg.endpoint is not None:
        key = os.environ.get("DRAFTSMITH_API_KEY") or os.environ.get("OPENAI_API_KEY")
        def log(line: str) -> None:
            console.print(line, markup=False, soft_wrap=True)

        return EndpointAnswerer(cfg.endpoint, tokenizer, cfg, api_key=key, log=log)
    if cfg.engine == "vllm":
        return VllmAnswerer(resolve_source(cfg.target), tokenizer, cfg, resolve_dtype(cfg.dtype, cfg.device, "bulk"))
    target = load_target(cfg.target, dtype=cfg.dtype, device=cfg.device, trust_remote_code=cfg.trust_remote_code,
                         chat_template=cfg.chat_template, template_kwargs=cfg.template_kwargs)
    import torch

    torch.manual_seed(cfg.seed)  # generate samples from the global generator
    return GenerateAnswerer(target, cfg)
