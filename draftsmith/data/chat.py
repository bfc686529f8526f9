"""Chat template rendering and the assistant-only loss mask.

The mask comes from rendering prefixes with the tokenizer's own chat template: for the
i-th assistant message, render(messages[:i], add_generation_prompt=True) ends where the
reply starts and render(messages[:i+1]) ends where it stops (end-of-turn token included,
so the drafter learns to predict it). Character spans → tokens through the fast
tokenizer's offset mapping. No per-template regexes; templates without
`{% generation %}` markers work. A template whose prefix renders are not prefixes of the
full render (e.g. one that rewrites earlier turns) is reported, never guessed at.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from draftsmith import DraftsmithError
from draftsmith.data.conversations import Conversation
from draftsmith.models.tokenizer import template_names


@dataclass
class TokenizedChat:
    id: str
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the token belongs to an assistant reply


def render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_spans(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered chat and the [start, end) character span of every assistant reply."""
    text = render(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = render(tokenizer, messages[:i], add_generation_prompt=True)
        stop = render(tokenizer, messages[: i + 1])
        if not (stop.startswith(start) and text.startswith(stop)):
            raise TemplateNotPrefixStable()
        spans.append((len(start), len(stop)))
    return text, spans


class TemplateNotPrefixStable(Exception):
    pass


def tokenize_chat(tokenizer: Any, conv: Conversation, max_length: int) -> tuple[TokenizedChat | None, str | None, list[str]]:
    """Conversation → (chat, None, truncations) or (None, skip_reason, [])."""
    if not getattr(tokenizer, "is_fast", False):
        raise DraftsmithError(
            f"{type(tokenizer).__name__} is a slow tokenizer; the assistant mask needs character "
            "offsets: load the target's fast tokenizer (tokenizer.json)"
        )
    if getattr(tokenizer, "chat_template", None) is None:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise DraftsmithError(
            f"the tokenizer of {name} has no chat template (a base model?), so no chat can be rendered: give one "
            f"with --chat_template FILE.jinja or the name of a template draftsmith ships ({', '.join(template_names())}; "
            "in a recipe: model.init_args.chat_template), e.g. the template of its family's instruct model")
    try:
        text, spans = assistant_spans(tokenizer, conv.messages)
    except TemplateNotPrefixStable:
        return None, "template_not_prefix_stable", []
    except Exception:  # jinja raises for chats a template refuses (e.g. role order rules)
        return None, "template_error", []
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask, span = [], 0
    for start, end in offsets:
        while span < len(spans) and spans[span][1] <= start:
            span += 1
        inside = span < len(spans) and spans[span][0] <= start < spans[span][1]
        mask.append(1 if inside and end > start else 0)
    truncations = []
    if len(ids) > max_length:
        ids, mask = ids[:max_length], mask[:max_length]
        truncations.append("truncated_to_max_length")
    if not any(mask):
        return None, ("no_assistant_tokens_within_max_length" if truncations else "no_assistant_tokens"), []
    return TokenizedChat(conv.id, ids, mask), None, truncations


@dataclass
class MaskAudit:
    """Masked-token statistics over a dataset; `check()` fails loudly on a degenerate mask."""

    records: int = 0
    tokens: int = 0
    masked: int = 0
    all_zero: int = 0
    all_one: int = 0
    fractions: list[float] = field(default_factory=list)

    def add(self, chat: TokenizedChat | None) -> None:
        """Count a tokenized chat; None stands for one skipped because no token was an assistant's."""
        if chat is None:
            self.records += 1
            self.all_zero += 1
            self.fractions.append(0.0)
            return
        n, m = len(chat.loss_mask), sum(chat.loss_mask)
        self.records += 1
        self.tokens += n
        self.masked += m
        self.all_zero += m == 0
        self.all_one += m == n
        self.fractions.append(m / n if n else 0.0)

    def summary(self) -> dict[str, Any]:
        fr = sorted(self.fractions)
        pick = lambda q: round(fr[min(len(fr) - 1, int(q * len(fr)))], 4) if fr else 0.0  # noqa: E731
        return {
            "records": self.records,
            "tokens": self.tokens,
            "assistant_tokens": self.masked,
            "assistant_fraction": round(self.masked / self.tokens, 4) if self.tokens else 0.0,
            "mean_tokens_per_record": round(self.tokens / self.records, 1) if self.records else 0.0,
            "record_fraction_p10_p50_p90": [pick(0.1), pick(0.5), pick(0.9)],
            "records_all_zero_mask": self.all_zero,
            "records_all_one_mask": self.all_one,
        }

    def check(self, what: str) -> None:
        if self.records and self.all_zero == self.records:
            raise DraftsmithError(
                f"{what}: every record has an all-zero assistant mask ({self.records} records): the chat "
                "template does not render assistant replies where expected; check tokenizer.chat_template"
            )
        if self.records and self.all_one == self.records:
            raise DraftsmithError(
                f"{what}: every record has an all-one assistant mask ({self.records} records): prompts "
                "would be trained as replies; check the chat template and the data's roles"
            )


def tokenize_many(tokenizer: Any, convs: list[Conversation], max_length: int, skipped: Counter, truncated: Counter, audit: MaskAudit) -> list[TokenizedChat]:
    """Tokenize conversations, counting skips and truncations and feeding the mask audit."""
    chats = []
    for conv in convs:
        chat, reason, truncations = tokenize_chat(tokenizer, conv, max_length)
        if chat is None:
            skipped[reason] += 1
            if reason.startswith("no_assistant_tokens"):
                audit.add(None)
            continue
        truncated.update(truncations)
        audit.add(chat)
        chats.append(chat)
    return chats
