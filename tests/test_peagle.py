"""P-EAGLE through the CLI: `fit` (the alignment steps on its parallel mask inputs), both export formats
(reloaded and compared, `mask_hidden` and the mask token included), `eval` with the target's greedy text,
and trees refused (its later tokens come from mask positions, not from its own outputs)."""

from __future__ import annotations

import json

from safetensors.torch import load_file

from tests.conftest import run_cli


def test_a_peagle_drafter_exports_and_decodes_the_targets_text(peagle_ckpt, tiny_features, tmp_path):
    for fmt in ("native", "speculators"):
        done = run_cli("export", str(peagle_ckpt), "--format", fmt, "--out", str(tmp_path / fmt))
        assert done.returncode == 0, done.stderr[-3000:]
    spec = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert spec["speculators_model_type"] == "peagle" and spec["architectures"] == ["PEagleSpeculator"]
    native = json.loads((tmp_path / "native" / "config.json").read_text())
    assert spec["mask_token_id"] == native["drafter_options"]["mask_token_id"] == 0  # the tiny tokenizer's unk
    assert load_file(str(tmp_path / "speculators" / "model.safetensors"))["mask_hidden"].shape == (1, 1, 96)
    common = ["--target", str(tiny_features / "target"), "--drafter", str(tmp_path / "native"), "--limit", "2",
              "--repeats", "1", "--max_new_tokens", "16", "--dtype", "float32"]
    result = run_cli("eval", *common, "--policy", "static", "--k", "4", "--out", str(tmp_path / "eval"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "eval" / "results.json").read_text())["identical_outputs"] is True
    tree = run_cli("eval", *common, "--tree", "3,2,6", "--out", str(tmp_path / "tree"))  # trees sized by cost
    assert tree.returncode == 0, tree.stderr[-3000:]
    assert json.loads((tmp_path / "tree" / "results.json").read_text())["identical_outputs"] is True
