import json

import pytest

from draftsmith import DraftsmithError
from draftsmith.data.conversations import load_conversations, split_of
from tests.conftest import run_cli, sample_chats


def _balanced(report):
    return report.read == report.kept + sum(report.skipped.values())


def test_sharegpt_json_roles_normalized(tmp_path):
    recs = [{"id": "a", "conversations": [{"from": "system", "value": "be nice"}, {"from": "human", "value": "hi"},
                                           {"from": "chatgpt", "value": "hello"}, {"from": "user", "value": "more"},
                                           {"from": "bard", "value": "sure"}]},
            {"id": "b", "conversations": [{"from": "human", "value": "x"}, {"from": "bing", "value": "y"}]}]
    path = tmp_path / "c.json"
    path.write_text(json.dumps(recs))
    convs, report = load_conversations(str(path))
    assert [m["role"] for m in convs[0].messages] == ["system", "user", "assistant", "user", "assistant"]
    assert convs[1].messages == [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    assert (report.read, report.kept) == (2, 2) and _balanced(report)


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_utf8_byte_order_mark_is_read(tmp_path, suffix):
    """Windows tools save UTF-8 with a byte-order mark; the file reads as without one."""
    recs = sample_chats(3)
    text = json.dumps(recs) if suffix == ".json" else "\n".join(json.dumps(r) for r in recs)
    path = tmp_path / f"bom{suffix}"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    convs, report = load_conversations(str(path))
    assert [c.id for c in convs] == ["chat-0", "chat-1", "chat-2"] and report.skipped == {}


def test_messages_jsonl_and_generated_ids(tmp_path):
    lines = [json.dumps({"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]})
             for i in range(3)]
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(lines) + "\n{not json\n")
    convs, report = load_conversations(str(path))
    assert [c.id for c in convs] == ["c.jsonl:0", "c.jsonl:1", "c.jsonl:2"]
    assert report.skipped == {"invalid_json_line": 1} and report.read == 4 and _balanced(report)


def test_a_json_line_ends_at_a_newline_only(tmp_path):
    """U+2028, U+0085 and a form feed are valid inside a JSON string (written raw with ensure_ascii=False);
    str.splitlines would cut such a record in two and lose it."""
    text = "line\u2028separator, next\u0085line, form\x0cfeed"
    lines = [json.dumps({"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]},
                        ensure_ascii=False), json.dumps({"messages": [{"role": "user", "content": "b"},
                                                                       {"role": "assistant", "content": "c"}]})]
    path = tmp_path / "c.jsonl"
    path.write_text("\r\n".join(lines) + "\n", encoding="utf-8")  # Windows line ends too
    convs, report = load_conversations(str(path))
    assert [c.messages[0]["content"] for c in convs] == [text, "b"] and report.skipped == {}


def test_hf_dataset_directory_and_parquet(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list(sample_chats(5))
    ds.save_to_disk(str(tmp_path / "ds"))
    ds.to_parquet(str(tmp_path / "c.parquet"))
    for source in (str(tmp_path / "ds"), str(tmp_path / "c.parquet")):
        convs, report = load_conversations(source)
        assert len(convs) == 5 and convs[0].id == "chat-0" and convs[0].messages[0]["role"] == "user"


def test_bad_records_are_counted_not_fatal(tmp_path):
    good = {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}
    recs = [
        {"id": "empty", "conversations": []},
        {"id": "role", "conversations": [{"from": "alien", "value": "q"}, good[1]]},
        {"id": "nonstr", "conversations": [good[0], {"from": "gpt", "value": ["a", "b"]}]},
        {"id": "lead", "conversations": [good[1], *good]},  # starts with the assistant: leading turn dropped
        {"id": "onlygpt", "conversations": [good[1]]},
        {"id": "alt", "conversations": [good[0], good[0], good[1]]},
        {"id": "blank", "conversations": [good[0], {"from": "gpt", "value": "  "}]},
        {"id": "trail", "conversations": [*good, good[0]]},
        "not a dict",
        {"id": "nofield", "text": "hello"},
        {"id": "ok", "conversations": list(good)},
    ]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(recs))
    convs, report = load_conversations(str(path))
    assert [c.id for c in convs] == ["lead", "trail", "ok"]
    assert convs[0].messages[0]["role"] == "user" and convs[1].messages[-1]["role"] == "assistant"
    assert report.skipped == {"empty": 1, "unknown_role": 1, "non_string_content": 1, "no_assistant_turn": 1,
                              "non_alternating_roles": 1, "empty_message": 1, "not_a_record": 1,
                              "no_messages_field": 1}
    assert report.truncated == {"leading_assistant_turns_dropped": 1, "trailing_user_turn_dropped": 1}
    assert report.read == len(recs) and _balanced(report)


def test_file_cut_mid_record_recovers_every_whole_record(tmp_path):
    text = json.dumps(sample_chats(10), indent=2)
    cut = text.index('"chat-7"') + 40  # inside record 7
    path = tmp_path / "cut.json"
    path.write_text(text[:cut])
    convs, report = load_conversations(str(path))
    assert [c.id for c in convs] == [f"chat-{i}" for i in range(7)]
    assert report.skipped == {"file_cut_mid_record": 1} and report.read == 8 and _balanced(report)
    path.write_text(text[: text.index('"chat-7"') - 10] )  # cut between records
    convs, report = load_conversations(str(path))
    assert len(convs) == 7


def test_unreadable_file_names_file_and_byte_offset(tmp_path):
    text = json.dumps(sample_chats(4))
    bad = text.replace('"chat-2"', '"chat-2" oops', 1)
    path = tmp_path / "broken.json"
    path.write_text(bad)
    with pytest.raises(DraftsmithError, match=rf"broken.json: .*byte {bad.index('oops')}\b"):
        load_conversations(str(path))
    (tmp_path / "bin.json").write_bytes(b'[{"id": "\xff\xfe"}]')
    with pytest.raises(DraftsmithError, match=r"bin.json: not UTF-8 text \(byte offset 9\)"):
        load_conversations(str(tmp_path / "bin.json"))
    with pytest.raises(DraftsmithError, match="not found"):
        load_conversations(str(tmp_path / "missing.json"))


def test_cli_error_has_no_traceback(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("[{]")
    result = run_cli("data", "stats", "--data", str(path), "--json")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "broken.json: invalid JSON at byte 2" in result.stderr


def test_split_is_deterministic_and_near_fraction():
    ids = [f"conv-{i}" for i in range(4000)]
    first = [split_of(i, 0.1) for i in ids]
    assert first == [split_of(i, 0.1) for i in ids]
    assert 0.08 < first.count("val") / len(ids) < 0.12
    assert all(split_of(i, 0.0) == "train" for i in ids[:50])


@pytest.mark.slow
def test_embedded_sharegpt_stats_json():
    result = run_cli("data", "stats", "--data", "sharegpt", "--json")
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)  # exactly one JSON object
    assert stats["kept"] > 17000
    assert stats["kept"] + sum(stats["skipped"].values()) == stats["read"]
    assert stats["skipped"]["file_cut_mid_record"] == 1


def test_packing_joins_chats_of_one_split_within_the_length():
    """`extract --pack`: consecutive chats joined while the joined one fits; each joins only its own split and
    keeps its first member's id, so the packed chat falls in that split."""
    from draftsmith.data.conversations import Conversation, pack, split_of

    def chat(i: int, turns: int = 1) -> Conversation:
        return Conversation(f"c{i}", [m for t in range(turns) for m in ({"role": "user", "content": f"q{i}.{t}"},
                                                                           {"role": "assistant", "content": "a"})])

    chats = [chat(i, turns=3 if i == 5 else 1) for i in range(40)]
    count = lambda messages: 10 * len(messages)  # noqa: E731
    packed = pack(chats, 40, count, val_fraction=0.3)
    assert sum(len(c.messages) for c in packed) == sum(len(c.messages) for c in chats)  # nothing lost
    assert all(count(c.messages) <= 40 or len(c.messages) == 6 for c in packed) and len(packed) < len(chats)
    by_id = {c.id: c for c in chats}
    for c in packed:
        members = [m["content"].split(".")[0][1:] for m in c.messages if m["role"] == "user"]
        assert len({split_of(f"c{i}", 0.3) for i in members}) == 1 and c.id == f"c{members[0]}"
        assert c.messages[: len(by_id[c.id].messages)] == by_id[c.id].messages
    assert pack(chats, 0, count) == chats  # nothing fits two chats: each alone
