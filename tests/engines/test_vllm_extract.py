"""`draftsmith extract --engine vllm` (`make test-engines`): the embedded target's hidden states from vLLM's
own forward (its `extract_hidden_states` method, written by draftsmith's CPU connector) make the same
feature directory as transformers' forward: the same run.json, token ids, masks and offsets, and features
equal to float32 rounding."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from tests.conftest import run_cli, sample_chats  # noqa: E402

ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}


def test_vllm_extracts_the_features_transformers_does(tmp_path):
    from safetensors.torch import load_file

    chats = tmp_path / "chats.json"
    chats.write_text(json.dumps(sample_chats(12, seed=5)))
    common = ["--target", "embedded:smollm2-135m-instruct", "--data", str(chats), "--max-length", "256",
              "--layer_ids", "[0,2,15,27]", "--dtype", "float32", "--feature_dtype", "float32", "--shard_size", "8"]
    eager = ["--engine_args", '{"enforce_eager": true}']  # no graph compile: seconds, not a minute
    for engine, extra in (("vllm", eager), ("transformers", [])):
        done = run_cli("extract", *common, "--engine", engine, *extra, "--out", str(tmp_path / engine), env=ENV,
                       timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
    theirs, ours = tmp_path / "vllm", tmp_path / "transformers"
    assert json.loads((theirs / "run.json").read_text()) == json.loads((ours / "run.json").read_text())
    shards = sorted(p.name for p in ours.glob("shard-*.safetensors"))
    assert shards == sorted(p.name for p in theirs.glob("shard-*.safetensors")) and len(shards) == 2
    for name in shards:
        a, b = load_file(theirs / name), load_file(ours / name)
        assert a.keys() == b.keys() and {"final", "layer.0", "layer.27"} <= a.keys()
        for key in a:
            if a[key].is_floating_point():  # relative to the tensor's largest value (massive activations)
                assert float((a[key] - b[key]).abs().max() / b[key].abs().max()) < 1e-4, key
            else:
                assert (a[key] == b[key]).all(), key
