import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from draftsmith import DraftsmithError
from draftsmith.data.features import FeatureReader, read_manifest
from draftsmith.jobs.extract import ExtractConfig, extract
from draftsmith.models.target import load_target
from tests.conftest import killed_after_writes, run_cli, save_tiny_target


def cfg(target_dir, chats_file, out, **kw):
    base = dict(target=str(target_dir), data=str(chats_file), out=str(out), max_length=256, shard_size=8,
                batch_tokens=512, dtype="float32", feature_dtype="float32", layer_ids=[1])
    return ExtractConfig(**{**base, **kw})


def shard_tensors(directory):
    return {p.name: load_file(p) for p in sorted(directory.glob("shard-*.safetensors"))}


def assert_same_shards(a, b):
    ta, tb = shard_tensors(a), shard_tensors(b)
    assert ta.keys() == tb.keys() and ta
    for name in ta:
        assert ta[name].keys() == tb[name].keys()
        for key in ta[name]:
            torch.testing.assert_close(ta[name][key], tb[name][key], rtol=0, atol=0, msg=f"{name}:{key}")


def test_extract_writes_features_equal_to_the_target(tiny_target_dir, chats_file, tmp_path):
    manifest = extract(cfg(tiny_target_dir, chats_file, tmp_path / "f"))
    assert manifest["num_records"] == 40 and len(manifest["shards"]) == 5
    assert manifest["num_tokens"] == sum(s["num_tokens"] for s in manifest["shards"])
    assert manifest["layer_ids"] == [1] and manifest["target"]["hidden_size"] == 32
    assert set(manifest) >= {"target", "tokenizer_hash", "layer_ids", "dtype", "num_records", "num_tokens", "skipped"}
    assert not list((tmp_path / "f").glob(".*tmp*"))
    target = load_target(str(tiny_target_dir))
    reader = FeatureReader(tmp_path / "f", layer_ids=[1])
    assert len(reader) == 40 and reader.lengths.sum() == manifest["num_tokens"]
    for index in (0, 17, 39):  # records were batched with right padding; compare to one-record forwards
        item = reader[index]
        final, extra = target.features(item["input_ids"][None], layer_ids=[1])
        torch.testing.assert_close(item["final"], final[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(item["aux"], extra[1][0], atol=1e-5, rtol=1e-5)
        assert item["loss_mask"].any() and not item["loss_mask"].all()


def test_rerun_resumes_and_mixing_is_refused(tiny_target_dir, chats_file, tmp_path):
    out = tmp_path / "f"
    extract(cfg(tiny_target_dir, chats_file, out))
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*")}
    again = extract(cfg(tiny_target_dir, chats_file, out))
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*")} == before
    assert again["this_run"]["shards_written"] == 0
    other = save_tiny_target(tmp_path / "other", seed=1)
    with pytest.raises(DraftsmithError, match="weights_fingerprint.*refusing to mix"):
        extract(cfg(other, chats_file, out))
    with pytest.raises(DraftsmithError, match="layer_ids: \\[1\\] there, \\[0, 1\\] here"):
        extract(cfg(tiny_target_dir, chats_file, out, layer_ids=[0, 1]))
    with pytest.raises(DraftsmithError, match="has no hidden states for layer ids \\[2\\]"):
        FeatureReader(out, layer_ids=[2])


def test_a_larger_limit_extends_the_directory_and_a_smaller_one_cuts_it(tiny_target_dir, chats_file, tmp_path):
    out = tmp_path / "f"
    extract(cfg(tiny_target_dir, chats_file, out, limit=20))  # parts of 8, 8 and 4 conversations
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*")}
    grown = extract(cfg(tiny_target_dir, chats_file, out, limit=40))
    assert grown["this_run"]["shards_written"] == 3 and grown["num_records"] == 40 and grown["data"]["limit"] == 40
    now = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*")}
    assert [n for n in kept if now[n] == kept[n]] == ["shard-000000.safetensors", "shard-000001.safetensors"]
    extract(cfg(tiny_target_dir, chats_file, tmp_path / "whole", limit=40))
    assert_same_shards(out, tmp_path / "whole")  # the last part of 4 was written again with its 8
    cut = extract(cfg(tiny_target_dir, chats_file, out, limit=20))
    assert cut["num_records"] == 20 and len(cut["shards"]) == 3 and len(FeatureReader(out)) == 20


KILL_AFTER_TEMP_WRITE = killed_after_writes(3)  # the 3rd shard is written, not yet renamed


def test_sigkill_mid_extraction_then_rerun_matches_uninterrupted(tiny_target_dir, chats_file, tmp_path):
    """The type is pinned: under `auto` the killed process and this one each time bf16 against float32, and on a
    loaded CPU the two timings can choose differently (the comparison is of resumption, not of the choice)."""
    args = ["extract", "--target", str(tiny_target_dir), "--data", str(chats_file), "--max-length", "256",
            "--shard-size", "8", "--batch-tokens", "512", "--layer_ids", "[1]", "--dtype", "float32"]
    killed = subprocess.run([sys.executable, "-c", KILL_AFTER_TEMP_WRITE, *args, "--out", str(tmp_path / "a")],
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr
    assert sorted(p.name for p in (tmp_path / "a").glob("shard-*")) == ["shard-000000.safetensors", "shard-000001.safetensors"]
    assert list((tmp_path / "a").glob(".shard-000002.safetensors.tmp.*")) and not (tmp_path / "a" / "manifest.json").exists()
    with pytest.raises(DraftsmithError, match="extraction has not finished: rerun"):
        read_manifest(tmp_path / "a")

    resumed = run_cli(*args, "--out", str(tmp_path / "a"), here=True)
    assert resumed.returncode == 0, resumed.stderr
    whole = run_cli(*args, "--out", str(tmp_path / "b"), here=True)
    assert whole.returncode == 0, whole.stderr
    a, b = read_manifest(tmp_path / "a"), read_manifest(tmp_path / "b")
    assert (a["num_records"], a["num_tokens"]) == (b["num_records"], b["num_tokens"]) == (40, b["num_tokens"])
    assert not list((tmp_path / "a").glob(".*tmp*"))
    assert_same_shards(tmp_path / "a", tmp_path / "b")
    assert "features in" in whole.stdout and "records" in whole.stdout


def test_two_processes_extract_disjoint_parts_of_the_same_output(tiny_target_dir, chats_file, tmp_path):
    args = ["extract", "--target", str(tiny_target_dir), "--data", str(chats_file), "--max_length", "256",
            "--shard_size", "8", "--batch_tokens", "512", "--dtype", "float32"]
    two = run_cli(*args, "--out", str(tmp_path / "two"), "--devices", "2")
    assert two.returncode == 0, two.stderr
    one = run_cli(*args, "--out", str(tmp_path / "one"), here=True)
    assert one.returncode == 0, one.stderr
    m2, m1 = read_manifest(tmp_path / "two"), read_manifest(tmp_path / "one")
    assert (m2["num_records"], m2["num_tokens"]) == (m1["num_records"], m1["num_tokens"])
    assert_same_shards(tmp_path / "two", tmp_path / "one")
    assert "2 process(es)" in two.stdout


def test_two_processes_take_one_auto_type(tiny_target_dir, chats_file, tmp_path):
    """`--dtype auto` is measured once, before the second worker starts (it inherits the choice)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRAFTSMITH_DTYPE_")}
    two = subprocess.run([sys.executable, "-m", "draftsmith.cli", "extract", "--target", str(tiny_target_dir), "--data",
                          str(chats_file), "--max_length", "256", "--shard_size", "8", "--batch_tokens", "512",
                          "--limit", "16", "--dtype", "auto", "--out", str(tmp_path / "two"), "--devices", "2"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert two.returncode == 0, two.stderr
    assert two.stderr.count("dtype auto:") == 1, two.stderr
    assert read_manifest(tmp_path / "two")["target_dtype"] in ("bfloat16", "float32")


def test_bad_options_are_refused(tiny_target_dir, chats_file, tmp_path):
    with pytest.raises(DraftsmithError, match="--batch_tokens 100 is smaller than --max_length 256"):
        cfg(tiny_target_dir, chats_file, tmp_path, batch_tokens=100)
    with pytest.raises(DraftsmithError, match="in a recipe: data.init_args.layer_ids.*out of range"):
        extract(cfg(tiny_target_dir, chats_file, tmp_path / "f", layer_ids=[7]))
    with pytest.raises(DraftsmithError, match="--engine must be one of transformers, vllm, got 'sglang'"):
        cfg(tiny_target_dir, chats_file, tmp_path, engine="sglang")
    with pytest.raises(DraftsmithError, match="--engine vllm places the target itself"):
        cfg(tiny_target_dir, chats_file, tmp_path, engine="vllm", devices=2)


def test_a_file_without_a_usable_chat_is_refused_with_what_it_holds(tiny_target_dir, chats_file, tmp_path):
    """Not "records 0 of 0" and exit 0, to be found out at `fit`: the reasons `data stats` gives, and exit 2."""
    empty = tmp_path / "no-messages.jsonl"
    empty.write_text(json.dumps({"id": "a", "text": "no messages here"}) + "\n")
    result = run_cli("extract", "--target", str(tiny_target_dir), "--data", str(empty), "--out", str(tmp_path / "f"))
    assert result.returncode == 2 and "holds no chat to extract: 1 read, skipped: no messages field 1" in result.stderr
    assert "draftsmith data stats --data" in result.stderr


def test_the_vllm_engine_without_vllm_says_where_to_get_it(tiny_target_dir, chats_file, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(DraftsmithError, match=r"needs vLLM in this environment: `make engines`"):
        extract(cfg(tiny_target_dir, chats_file, tmp_path / "v", engine="vllm"))


@pytest.mark.slow
def test_embedded_default_extraction(tmp_path):
    out = tmp_path / "f"
    result = run_cli("extract", "--target", "embedded:smollm2-135m-instruct", "--data", "sharegpt",
                     "--limit", "6", "--max-length", "96", "--layer_ids", "[2,15,27]", "--out", str(out))
    assert result.returncode == 0, result.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["num_records"] >= 1 and manifest["layer_ids"] == [2, 15, 27]
    assert manifest["target"]["name"] == "embedded:smollm2-135m-instruct" and manifest["dtype"] == "bfloat16"
    item = FeatureReader(out, layer_ids=[2, 15, 27])[0]
    assert item["final"].shape[-1] == 576 and item["aux"].shape[-1] == 3 * 576
