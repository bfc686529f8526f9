from collections import Counter

import pytest

from draftsmith import DraftsmithError
from draftsmith.data.chat import MaskAudit, tokenize_chat, tokenize_many
from draftsmith.models.tokenizer import tokenizer_hash, tokenizer_identity
from draftsmith.data.conversations import Conversation
from tests.conftest import CHATML, LLAMA2, LLAMA3, make_tokenizer

CONV = Conversation("c", [
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "hi friend"},
    {"role": "user", "content": "how are you"},
    {"role": "assistant", "content": "fine thanks"},
])


def masked_text(tokenizer, chat):
    """The masked tokens, decoded, grouped in runs."""
    runs, current = [], []
    for tok, m in zip(chat.input_ids, chat.loss_mask):
        if m:
            current.append(tok)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


@pytest.mark.parametrize("template, expected", [
    (CHATML, ["hi friend<|im_end|>\n", "fine thanks<|im_end|>\n"]),
    (LLAMA3, ["hi friend<|eot_id|>", "fine thanks<|eot_id|>"]),
    (LLAMA2, [" hi friend </s>", " fine thanks </s>"]),
])
def test_assistant_mask_covers_exactly_the_replies(template, expected):
    tokenizer = make_tokenizer(template)
    chat, reason, truncations = tokenize_chat(tokenizer, CONV, max_length=1000)
    assert reason is None and truncations == []
    assert tokenizer.decode(chat.input_ids) == tokenizer.apply_chat_template(CONV.messages, tokenize=False)
    assert masked_text(tokenizer, chat) == expected
    # the prompt side carries no loss: the system and user text are all unmasked
    unmasked = tokenizer.decode([t for t, m in zip(chat.input_ids, chat.loss_mask) if not m])
    assert "hello there" in unmasked and "how are you" in unmasked and "friend" not in unmasked


def test_over_long_chat_truncated_or_skipped_with_reason():
    tokenizer = make_tokenizer(CHATML)
    full, _, _ = tokenize_chat(tokenizer, CONV, max_length=1000)
    first_reply = full.loss_mask.index(1)
    chat, reason, truncations = tokenize_chat(tokenizer, CONV, max_length=first_reply + 3)
    assert len(chat.input_ids) == first_reply + 3 and sum(chat.loss_mask) == 3
    assert truncations == ["truncated_to_max_length"]
    chat, reason, _ = tokenize_chat(tokenizer, CONV, max_length=first_reply)
    assert chat is None and reason == "no_assistant_tokens_within_max_length"


def test_mask_audit_fails_loudly_on_degenerate_masks():
    drops_replies = "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] + '\n' }}{% endif %}{% endfor %}"
    tokenizer = make_tokenizer(drops_replies)
    skipped, audit = Counter(), MaskAudit()
    chats = tokenize_many(tokenizer, [CONV, CONV], 1000, skipped, Counter(), audit)
    assert chats == [] and skipped == {"no_assistant_tokens": 2}
    with pytest.raises(DraftsmithError, match="all-zero assistant mask"):
        audit.check("toy")
    only_replies = "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}{% endif %}{% endfor %}"
    audit = MaskAudit()
    tokenize_many(make_tokenizer(only_replies), [CONV], 1000, Counter(), Counter(), audit)
    with pytest.raises(DraftsmithError, match="all-one assistant mask"):
        audit.check("toy")
    healthy = MaskAudit()
    tokenize_many(make_tokenizer(CHATML), [CONV], 1000, Counter(), Counter(), healthy)
    healthy.check("toy")
    assert 0 < healthy.summary()["assistant_fraction"] < 1


def test_template_rewriting_history_is_reported_not_guessed():
    # renders the last message differently from earlier ones: prefixes are not stable
    unstable = "{% for m in messages %}{{ ('LAST:' if loop.last else '') + m['content'] + '\n' }}{% endfor %}"
    chat, reason, _ = tokenize_chat(make_tokenizer(unstable), CONV, 1000)
    assert chat is None and reason == "template_not_prefix_stable"


def test_a_tokenizer_without_a_chat_template_is_a_clear_error_not_a_skip():
    """A base model's tokenizer (Gemma-3-270M's GGUF) has no template: every chat used to be skipped as a
    template error, and extraction 'succeeded' with 0 records."""
    tokenizer = make_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(DraftsmithError, match="has no chat template .* --chat_template FILE.jinja .*chatml, gemma, llama3"):
        tokenize_chat(tokenizer, CONV, 1000)


def test_tokenizer_hash_tracks_template_and_vocab():
    assert tokenizer_hash(make_tokenizer(CHATML)) == tokenizer_hash(make_tokenizer(CHATML))
    assert tokenizer_hash(make_tokenizer(CHATML)) != tokenizer_hash(make_tokenizer(LLAMA3))


def test_tokenizer_hash_is_the_one_exports_recorded():
    """The hash is still sha256 over vocabulary, special tokens and template in that order: exports and
    features made before its parts were recorded keep matching."""
    import hashlib
    import json

    tok = make_tokenizer(CHATML)
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tok.get_vocab().items())).encode())
    h.update(json.dumps(sorted((str(k), str(v)) for k, v in tok.special_tokens_map.items())).encode())
    h.update(json.dumps(tok.chat_template).encode())
    assert tokenizer_hash(tok) == h.hexdigest()[:16]


def test_a_tokenizer_mismatch_names_the_part_that_differs():
    """Where both identities recorded the parts, the tokenizer_hash line names the differing part; an
    identity recorded without them compares by the hash alone; the parts are never compared themselves."""
    from draftsmith.models.target import identity_differences

    def identity(template):
        digest, parts = tokenizer_identity(make_tokenizer(template))
        return {"name": "t", "hidden_size": 8, "tokenizer_hash": digest, "tokenizer_parts": parts}

    chatml, llama3 = identity(CHATML), identity(LLAMA3)
    assert chatml["tokenizer_parts"]["vocabulary"] == llama3["tokenizer_parts"]["vocabulary"]
    [line] = identity_differences(chatml, llama3, "in the export", "here")
    assert line.startswith(f"tokenizer_hash: {chatml['tokenizer_hash']!r} in the export, ")
    assert line.endswith("(differing: chat_template): every stage must render chats with the same template "
                         "(--chat_template, --template_kwargs)")
    before_parts = {k: v for k, v in chatml.items() if k != "tokenizer_parts"}
    [line] = identity_differences(before_parts, llama3)
    assert "differing" not in line
    assert identity_differences(before_parts, chatml) == [] and identity_differences(chatml, before_parts) == []
    assert identity_differences({**chatml, "name": "u"}, chatml) == []
    assert identity_differences({**chatml, "hidden_size": 16}, chatml) == ["hidden_size: 16 there, 8 here"]
