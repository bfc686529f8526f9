"""`draftsmith regenerate`: the target answers the chats' user turns itself (self-distillation data).

A drafter is judged on the target's own text, so it learns most from features of that text:
the target answers each conversation's user turns (the first only, or every turn after its
own earlier answers), and the chats are written to a .jsonl that `extract --data` reads.
Conversation ids are kept, so the train/validation split is the same as the source's.

Nothing is lost on a crash: records are appended a chunk at a time, and a rerun with the same
settings resumes after the conversations already written, and one with a larger --limit
appends the conversations the file lacks. A rerun with other settings (or another target)
into the same file is refused.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from draftsmith import DraftsmithError
from draftsmith.files import json_lines
from draftsmith.options import ChatOptions, SamplingOptions, TargetOptions


@dataclass(kw_only=True)
class RegenerateConfig(TargetOptions, ChatOptions, SamplingOptions):
    """Options of `draftsmith regenerate` (the target's, the chats', the sampling options' and these).

    Args:
        out: the .jsonl file to write (with OUT.meta.json: target and settings).
        turns: first (answer the first user turn only) or all (every user turn, after the target's own earlier answers).
        max_length: prompt + answer tokens; a turn without room for a full answer ends its conversation.
        batch_size: prompts generated together (grouped by length).
        chunk: conversations finished and appended to OUT together (the unit of resumption).
    """

    out: str
    turns: str = "first"
    max_length: int = 2048
    batch_size: int = 16
    chunk: int = 64

    def __post_init__(self) -> None:
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
        keep = ("data", "turns", "max_new_tokens", "max_length", "temperature", "top_k", "top_p", "seed")
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
        diffs = [f"{k}: {old.get(k)!r} in the file, {v!r} now" for k, v in meta.items() if old.get(k) != v]
        if diffs:
            raise DraftsmithError(f"{out} was written with other settings ({'; '.join(diffs)}); "
                                  "use another --out or delete it")
    elif out.exists() and out.stat().st_size:
        raise DraftsmithError(f"{out} exists but was not written by `draftsmith regenerate`; use another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(meta, indent=1))


class Answerer:
    """Batched generation with the target's chat template (left padding, one batch at a time)."""

    def __init__(self, target: Any, cfg: RegenerateConfig):
        self.model, self.tok, self.cfg = target.model, target.tokenizer, cfg
        self.prompt_ids = target.encode_chat
        self.eos = list(target.eos_token_ids)
        if not self.eos:
            raise DraftsmithError(f"target {cfg.target!r} has no EOS token: answers would never end")
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos[0]

    def answer(self, prompts: list[list[int]]) -> list[tuple[list[int], bool]]:
        """(answer tokens without the EOS, ended on EOS) per prompt: transformers' generate, left padding."""
        import torch

        width = max(len(p) for p in prompts)
        device = self.model.device
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        sampling = ({"do_sample": True, "temperature": self.cfg.temperature, "top_p": self.cfg.top_p or 1.0,
                     "top_k": self.cfg.top_k or 0}
                    if self.cfg.temperature > 0 else {"do_sample": False, "temperature": None, "top_p": None, "top_k": None})
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=self.cfg.max_new_tokens,
                                      eos_token_id=self.eos, pad_token_id=self.pad, **sampling)[:, width:].tolist()
        answers = []
        for row in out:
            cut = next((i for i, t in enumerate(row) if t in self.eos), None)
            answers.append((row if cut is None else row[:cut], cut is not None))
        return answers


def regenerate_chunk(answerer: Answerer, convs: list[Any], cfg: RegenerateConfig, counts: Counter,
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
            prompts.append(answerer.prompt_ids(s["messages"]))
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
        for b in range(0, len(ready), cfg.batch_size):
            batch = ready[b:b + cfg.batch_size]
            for (_, _, s), (tokens, ended) in zip(batch, answerer.answer([p for _, p, _ in batch])):
                text = answerer.tok.decode(tokens, skip_special_tokens=True).strip()
                counts["answer_tokens"] += len(tokens)
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
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from draftsmith.data.conversations import load_conversations
    from draftsmith.models.target import load_target

    console = console or Console(stderr=True)
    out = Path(cfg.out)
    convs, report = load_conversations(cfg.data, limit=cfg.limit)
    if not convs:
        raise DraftsmithError(f"{cfg.data}: no usable conversations ({report.as_dict()['skipped']})")
    target = load_target(cfg.target, dtype=cfg.dtype, device=cfg.device, trust_remote_code=cfg.trust_remote_code,
                         chat_template=cfg.chat_template)
    meta = {"format": "draftsmith-regenerated-chats", "target": target.identity.as_dict(), **cfg.settings()}
    _check_meta(out, meta)
    done = _done_ids(out)
    todo = [c for c in convs if c.id not in done]
    counts: Counter = Counter()
    start = time.perf_counter()
    answerer = Answerer(target, cfg)
    import torch

    torch.manual_seed(cfg.seed)  # generate samples from the global generator
    with Progress(TextColumn("[bold]regenerate"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=console) as progress:
        task = progress.add_task("regenerate", total=len(convs), completed=len(convs) - len(todo))
        for c in range(0, len(todo), cfg.chunk):
            records = regenerate_chunk(answerer, todo[c:c + cfg.chunk], cfg, counts,
                                       lambda n: progress.advance(task, n))
            with out.open("a", encoding="utf-8") as f:
                f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    seconds = time.perf_counter() - start
    return {"out": str(out), "source": report.as_dict(), "already_done": len(convs) - len(todo),
            "conversations": len(todo), "seconds": round(seconds, 1),
            "answer_tokens_per_second": round(counts["answer_tokens"] / seconds, 1) if seconds else None,
            **dict(counts)}
