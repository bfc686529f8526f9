"""A tokenizer's chat template and identity: the template a target's chats are rendered with (its own,
or one given with `--chat_template`), and what every feature directory, checkpoint and export records
of the tokenizer it was made with, so that one made with another tokenizer is refused rather than
silently mixed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from draftsmith import DraftsmithError

TEMPLATES = Path(__file__).parent / "templates"  # the chat templates draftsmith ships, by name


def template_names() -> list[str]:
    return sorted(p.stem for p in TEMPLATES.glob("*.jinja"))


def chat_template_text(spec: str) -> str:
    """The Jinja text of a chat template given as a file or as the name of one draftsmith ships."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path.read_text()
    if (TEMPLATES / f"{spec}.jinja").is_file():
        return (TEMPLATES / f"{spec}.jinja").read_text()
    raise DraftsmithError(f"chat template {spec!r}: no such file, and not a template draftsmith ships "
                          f"({', '.join(template_names())})")


def jinja_literal(value: Any) -> str:
    """A JSON value written as a Jinja literal (true, none, lists and dicts of them)."""
    if value is None or isinstance(value, bool):
        return {None: "none", True: "true", False: "false"}[value]
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(jinja_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {jinja_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (int, float, str)):
        return json.dumps(value)
    raise DraftsmithError(f"--template_kwargs: {value!r} is not a JSON value")


def with_chat_template(tokenizer: Any, spec: str | None, template_kwargs: dict[str, Any] | None = None) -> Any:
    """`tokenizer` rendering chats with the template `spec` names (None: its own), with `template_kwargs` (e.g.
    {"enable_thinking": false}, or "tools": [schemas]) set at the template's top: every rendering sees them
    with no option at the call, and the tokenizer's identity holds them as part of its template."""
    if spec:
        tokenizer.chat_template = chat_template_text(spec)
    if template_kwargs:
        bad = [k for k in template_kwargs if not str(k).isidentifier()]
        if bad:
            raise DraftsmithError(f"--template_kwargs: {bad} are not names a chat template can read")
        if not isinstance(tokenizer.chat_template, str):
            raise DraftsmithError("--template_kwargs needs one chat template (this tokenizer has "
                                  f"{'none' if tokenizer.chat_template is None else 'several, by name'}): "
                                  "give --chat_template too")
        tokenizer.chat_template = "".join(f"{{%- set {k} = {jinja_literal(v)} -%}}\n"
                                          for k, v in sorted(template_kwargs.items())) + tokenizer.chat_template
    return tokenizer


def _tokenizer_fields(tokenizer: Any) -> dict[str, bytes]:
    """What a tokenizer's identity is made of, serialized: vocabulary, special tokens, chat template."""
    return {
        "vocabulary": json.dumps(sorted(tokenizer.get_vocab().items())).encode(),
        "special_tokens": json.dumps(sorted((str(k), str(v)) for k, v in tokenizer.special_tokens_map.items())).encode(),
        "chat_template": json.dumps(tokenizer.chat_template).encode(),  # a str, a dict of named templates, or None
    }


def tokenizer_identity(tokenizer: Any) -> tuple[str, dict[str, str]]:
    """`tokenizer_hash` and a hash of each of its parts (12 hex), from one serialization: the parts are
    recorded beside the hash so that a mismatch can say which part differs."""
    fields = _tokenizer_fields(tokenizer)
    h = hashlib.sha256()
    for part in fields.values():
        h.update(part)
    return h.hexdigest()[:16], {name: hashlib.sha256(part).hexdigest()[:12] for name, part in fields.items()}


def tokenizer_hash(tokenizer: Any) -> str:
    """Identity of a tokenizer: vocabulary, special tokens and chat template (sha256, 16 hex)."""
    return tokenizer_identity(tokenizer)[0]
