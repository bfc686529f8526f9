"""EAGLE-3.1: the eagle3 kind with norms against the drift of its features across drafting steps (a norm
per fused layer or one on all of them before fc; the output normed before it is fed back). It trains,
exports in the layouts vLLM and `speculators` read (flags and tensors; tests/engines loads them in the
engines' own code), and decodes exactly the target's text."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith import DraftsmithError
from tests.conftest import run_cli, tiny_drafter_inputs, train


@pytest.mark.parametrize("options", [{"fc_norm": True, "norm_output": True}, {"norm_before_fc": True}])
def test_eagle31_trains_exports_and_decodes_the_targets_text(tiny_features, tmp_path, options):
    ckpt = train(tiny_features, tmp_path, kind="eagle3", draft_vocab_size=40, aux_layer_ids=[0, 1, 2], **options)
    for fmt in ("native", "eagle3", "speculators"):  # each export is reloaded and compared with the module
        done = run_cli("export", str(ckpt), "--format", fmt, "--out", str(tmp_path / fmt))
        assert done.returncode == 0, done.stderr[-3000:]
    flags = {"fc_norm": False, "norm_before_fc": False, "norm_output": False, **options}
    for config in (tmp_path / "eagle3" / "vllm" / "config.json", tmp_path / "speculators" / "config.json"):
        written = json.loads(config.read_text())
        assert {k: written[k] for k in flags} == flags
    tensors = load_file(str(tmp_path / "eagle3" / "vllm" / "model.safetensors"))
    expected = {f"fc_norm.{i}.weight" for i in range(3)} if options.get("fc_norm") else {"input_norm.weight"}
    assert expected <= set(tensors) and all(tensors[name].shape == (32 * (3 if "input" in name else 1),)
                                            for name in expected)
    assert json.loads((tmp_path / "native" / "config.json").read_text())["drafter_options"] == flags
    result = run_cli("eval", "--target", str(tiny_features / "target"), "--drafter", str(tmp_path / "native"),
                     "--limit", "2", "--repeats", "1", "--max_new_tokens", "12", "--dtype", "float32",
                     "--policy", "static", "--k", "3", "--out", str(tmp_path / "eval"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "eval" / "results.json").read_text())["identical_outputs"] is True


def test_eagle31_options_are_checked():
    from draftsmith.models.eagle import EagleDrafter
    from draftsmith.models.eagle3 import Eagle3Drafter

    config, w = tiny_drafter_inputs()
    with pytest.raises(DraftsmithError, match="exclude each other"):
        Eagle3Drafter.from_target(config, w, w, None, None, 3, 32, fc_norm=True, norm_before_fc=True)
    with pytest.raises(DraftsmithError, match="unknown EAGLE-3 options"):
        Eagle3Drafter.from_target(config, w, w, None, None, 3, 32, fc_nrom=True)
    with pytest.raises(DraftsmithError, match="options of the eagle3 kind"):
        EagleDrafter.from_target(config, w, w, None, None, 0, 32, norm_output=True)
    drafter = Eagle3Drafter.from_target(config, w, w, None, None, 3, 32, norm_output=True)
    hidden = drafter(torch.tensor([[1, 2]]), torch.randn(1, 2, 32), torch.arange(2)[None], None)
    assert torch.allclose(hidden, drafter.norm(hidden), atol=1e-5)  # fed back normed: the head reads it as it is


@pytest.mark.parametrize("options", [{"norm_output": True}, {"fc_norm": True, "norm_output": True}])
def test_eagle31_trains_its_steps_under_bf16_autocast(options):
    """Under bf16-mixed training (what `--precision auto` picks on a bf16 CPU) the normed output fed back
    as the next step's feature keeps the step-0 feature's dtype: its keys join step 0's in one buffer."""
    from draftsmith.models.eagle3 import Eagle3Drafter
    from draftsmith.train.alignment import alignment_hiddens

    config, w = tiny_drafter_inputs()
    drafter = Eagle3Drafter.from_target(config, w, w, None, None, 3, 32, **options)
    ids, anchors = torch.randint(0, 50, (2, 9)), torch.ones(2, 8, dtype=torch.bool)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        feature = drafter.project(None, torch.randn(2, 8, 96))
        hiddens = alignment_hiddens(drafter, ids, feature, anchors, steps=3)
        loss = sum(drafter.logits(h).float().logsumexp(-1).mean() for h in hiddens)
    loss.backward()
    assert {h.dtype for h in hiddens} == {feature.dtype} and drafter.fc.weight.grad is not None


def test_a_drafters_own_rope_base_trains_exports_and_decodes(tiny_features, tmp_path):
    """`rope_theta` (the eagle3 family): the draft layer rotates by its own base, and every export's config
    carries it, so the runtime and the engines rotate as training did (tests/engines checks the package's
    logits with it)."""
    from draftsmith.models.eagle3 import Eagle3Drafter

    config, w = tiny_drafter_inputs()
    own = Eagle3Drafter.from_target(config, w, w, None, None, 3, 32, rope_theta=1e6)
    plain = Eagle3Drafter.from_target(config, w, w, None, None, 3, 32)
    positions, like = torch.arange(64)[None], torch.zeros(1, 64, 32)
    assert own.config.rope_parameters["rope_theta"] == 1e6 != plain.config.rope_parameters["rope_theta"]
    assert not torch.allclose(own.rotary(like, positions)[0], plain.rotary(like, positions)[0])
    assert own.options["rope_theta"] == 1e6 and "rope_theta" not in plain.options

    ckpt = train(tiny_features, tmp_path, kind="eagle3", draft_vocab_size=40, aux_layer_ids=[0, 1, 2], rope_theta=1e6)
    for fmt in ("native", "eagle3", "speculators"):  # each export is reloaded and compared with the module
        done = run_cli("export", str(ckpt), "--format", fmt, "--out", str(tmp_path / fmt))
        assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "eagle3" / "vllm" / "config.json").read_text())["rope_theta"] == 1e6
    assert json.loads((tmp_path / "speculators" / "config.json").read_text())[
        "transformer_layer_config"]["rope_theta"] == 1e6
    assert json.loads((tmp_path / "native" / "config.json").read_text())["drafter_options"]["rope_theta"] == 1e6
    result = run_cli("eval", "--target", str(tiny_features / "target"), "--drafter", str(tmp_path / "native"),
                     "--limit", "2", "--repeats", "1", "--max_new_tokens", "12", "--dtype", "float32",
                     "--policy", "static", "--k", "3", "--out", str(tmp_path / "eval"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "eval" / "results.json").read_text())["identical_outputs"] is True
