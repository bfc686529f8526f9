import json

import pytest
import torch

from draftsmith import DraftsmithError
from draftsmith.data.conversations import load_conversations, split_of
from draftsmith.jobs.regenerate import RegenerateConfig, regenerate
from draftsmith.models.target import load_target
from tests.conftest import make_llama, make_tokenizer, run_cli


@pytest.fixture(scope="module")
def lively_target(tmp_path_factory):
    """A tiny target whose greedy answers vary with the prompt (default-init ones answer only newlines)."""
    path = tmp_path_factory.mktemp("lively-target")
    tokenizer = make_tokenizer()
    model = make_llama(len(tokenizer))
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def cfg(target_dir, chats_file, out, **kw):
    base = dict(target=str(target_dir), data=str(chats_file), out=str(out), max_new_tokens=12, max_length=256,
                batch_size=4, chunk=8, dtype="float32")
    return RegenerateConfig(**{**base, **kw})


def greedy_answer(target, messages, max_new_tokens):
    """The target's greedy answer, one sequence, no padding, no cache: the reference."""
    tok = target.tokenizer
    ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    out = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            nxt = int(target.model(torch.tensor([ids + out])).logits[0, -1].argmax())
            if nxt == tok.eos_token_id:
                break
            out.append(nxt)
    return tok.decode(out, skip_special_tokens=True).strip()


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_answers_are_the_targets_greedy_answers_and_ids_keep_the_split(lively_target, chats_file, tmp_path):
    out = tmp_path / "self.jsonl"
    summary = regenerate(cfg(lively_target, chats_file, out, limit=12))
    records = read(out)
    source = {c.id: c for c in load_conversations(str(chats_file), limit=12)[0]}
    assert summary["conversations"] == 12 and len(records) + summary.get("conversations_without_answer", 0) == 12
    assert records, "the tiny target answered nothing"
    target = load_target(str(lively_target))
    for r in records:  # batched with left padding and a cache, yet equal to one-at-a-time greedy decoding
        user = source[r["id"]].messages[0]
        assert r["messages"][0] == user and len(r["messages"]) == 2
        assert r["messages"][1] == {"role": "assistant", "content": greedy_answer(target, [user], 12)}
        assert r["messages"][1]["content"] != source[r["id"]].messages[1]["content"]
    convs, report = load_conversations(str(out))  # extract reads it back whole; same ids, same split
    assert report.kept == len(records) and report.read == len(records)
    assert all(split_of(c.id, 0.2) == split_of(c.id, 0.2) for c in convs)
    assert [c.id for c in convs] == [r["id"] for r in records]


def test_all_turns_answer_after_the_targets_own_earlier_answers(lively_target, chats_file, tmp_path):
    out = tmp_path / "all.jsonl"
    regenerate(cfg(lively_target, chats_file, out, limit=10, turns="all", max_new_tokens=6))
    source = {c.id: c for c in load_conversations(str(chats_file), limit=10)[0]}
    target = load_target(str(lively_target))
    multi = [r for r in read(out) if len(r["messages"]) > 2]
    assert multi, "no multi-turn chat was regenerated"
    for r in multi:
        users = [m for m in source[r["id"]].messages if m["role"] == "user"]
        got = r["messages"]
        assert [m["role"] for m in got] == ["user", "assistant"] * (len(got) // 2)
        assert [m for m in got if m["role"] == "user"] == users[:len(got) // 2]
        assert got[3]["content"] == greedy_answer(target, got[:3], 6)  # turn 2 follows the target's turn-1 answer


def test_rerun_resumes_after_a_crash_and_equals_one_run(lively_target, chats_file, tmp_path):
    whole, cut = tmp_path / "whole.jsonl", tmp_path / "cut.jsonl"
    regenerate(cfg(lively_target, chats_file, whole, limit=20))
    regenerate(cfg(lively_target, chats_file, cut, limit=20))
    lines = cut.read_text().splitlines(keepends=True)
    cut.write_text("".join(lines[:5]) + lines[5][:17])  # killed mid-write of the sixth record
    summary = regenerate(cfg(lively_target, chats_file, cut, limit=20))
    assert summary["already_done"] == 5 and summary["conversations"] == 15
    assert cut.read_text() == whole.read_text()
    again = regenerate(cfg(lively_target, chats_file, cut, limit=20))
    assert again["conversations"] == 0 and cut.read_text() == whole.read_text()


def test_a_resumed_file_keeps_records_holding_a_unicode_line_separator(tmp_path):
    """The answers are written raw (ensure_ascii=False): a U+2028 inside one must not read as a cut line,
    or resuming would drop that record and every one after it."""
    from draftsmith.jobs.regenerate import _done_ids

    out = tmp_path / "r.jsonl"
    records = [{"id": "a", "messages": [{"role": "assistant", "content": "x\u2028y"}]}, {"id": "b", "messages": []}]
    whole = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    out.write_text(whole + '{"id": "c", "mess', encoding="utf-8")  # the last append cut by a crash
    assert _done_ids(out) == {"a", "b"} and out.read_text(encoding="utf-8") == whole


def test_a_larger_limit_extends_the_file(lively_target, chats_file, tmp_path):
    whole, grown = tmp_path / "whole.jsonl", tmp_path / "grown.jsonl"
    regenerate(cfg(lively_target, chats_file, whole, limit=20))
    regenerate(cfg(lively_target, chats_file, grown, limit=7))
    assert len(grown.read_text().splitlines()) == 7
    summary = regenerate(cfg(lively_target, chats_file, grown, limit=20))
    assert summary["already_done"] == 7 and summary["conversations"] == 13
    assert grown.read_text() == whole.read_text()


def test_other_settings_or_foreign_files_are_refused(lively_target, chats_file, tmp_path):
    out = tmp_path / "self.jsonl"
    regenerate(cfg(lively_target, chats_file, out, limit=4))
    with pytest.raises(DraftsmithError, match="max_new_tokens: 12 in the file, 20 now"):
        regenerate(cfg(lively_target, chats_file, out, limit=4, max_new_tokens=20))
    foreign = tmp_path / "mine.jsonl"
    foreign.write_text('{"id": "x"}\n')
    with pytest.raises(DraftsmithError, match="not written by `draftsmith regenerate`"):
        regenerate(cfg(lively_target, chats_file, foreign, limit=4))
    with pytest.raises(DraftsmithError, match=r"\.jsonl"):
        cfg(lively_target, chats_file, tmp_path / "x.json")
    with pytest.raises(DraftsmithError, match="must exceed"):
        cfg(lively_target, chats_file, out, max_length=12)


def test_cli_regenerates_and_extract_reads_the_result(lively_target, chats_file, tmp_path):
    out = tmp_path / "self.jsonl"
    r = run_cli("regenerate", "--target", str(lively_target), "--data", str(chats_file), "--out", str(out),
                "--limit", "6", "--max-new-tokens", "8", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    assert "regenerated 6 conversations" in r.stdout and "draftsmith extract" in r.stdout
    r = run_cli("extract", "--target", str(lively_target), "--data", str(out), "--out", str(tmp_path / "f"),
                "--max-length", "256", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "f" / "manifest.json").read_text())["num_records"] == len(read(out))


def test_the_vllm_engine_without_vllm_says_where_to_get_it(lively_target, chats_file, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(DraftsmithError, match=r"needs vLLM in this environment: `make engines`"):
        regenerate(cfg(lively_target, chats_file, tmp_path / "v.jsonl", limit=2, engine="vllm"))
    with pytest.raises(DraftsmithError, match="--endpoint answers through a server: leave --engine out"):
        cfg(lively_target, chats_file, tmp_path / "v.jsonl", engine="vllm", endpoint="http://127.0.0.1:1")
    with pytest.raises(DraftsmithError, match="--reasoning must be one of keep, drop"):
        cfg(lively_target, chats_file, tmp_path / "v.jsonl", reasoning="hide")


def test_vllm_engine_args_reach_the_engine_and_may_not_replace_draftsmiths_own(lively_target, chats_file, tmp_path):
    """`--engine_args` add vLLM's placement and speed arguments (the engines tests pass enforce_eager through
    them); the target, dtype, seed and lengths stay draftsmith's, and the arguments need --engine vllm."""
    from draftsmith.jobs.answerers import vllm_engine_args
    from draftsmith.jobs.extract import ExtractConfig

    own = {"model": "m", "dtype": "float32", "seed": 0, "max_model_len": 512}
    assert vllm_engine_args(own, {"tensor_parallel_size": 2}) == {**own, "tensor_parallel_size": 2}
    assert vllm_engine_args(own, None) == own
    with pytest.raises(DraftsmithError, match=r"--engine_args \['max_model_len'\]: draftsmith sets it itself"):
        vllm_engine_args(own, {"max_model_len": 64, "enforce_eager": True})
    with pytest.raises(DraftsmithError, match="give them with --engine vllm"):
        cfg(lively_target, chats_file, tmp_path / "v.jsonl", engine_args={"enforce_eager": True})
    with pytest.raises(DraftsmithError, match="give them with --engine vllm"):
        ExtractConfig(target="t", data="d", out="o", engine_args={"enforce_eager": True})


def test_vllm_on_a_cpu_gets_a_bounded_kv_cache_unless_one_was_set(monkeypatch):
    import os

    from draftsmith.jobs.answerers import bound_cpu_kv_cache

    sysconf = {"SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(os, "sysconf", sysconf.__getitem__)
    for gib, space in ((24, "4"), (8, "2"), (2, "1")):  # a quarter of the memory, 1 to 4 GiB
        monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
        sysconf["SC_PHYS_PAGES"] = gib * 2**30 // 4096
        bound_cpu_kv_cache()
        assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == space
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "7")  # the user's own
    bound_cpu_kv_cache()
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "7"
