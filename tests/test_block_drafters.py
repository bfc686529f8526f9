"""DFlash and DSpark through the CLI: `fit` from the same feature shards as EAGLE-3, both export formats
(each reloaded and compared), `eval` with exactly the target's greedy text, DSpark's confidence policy
tuned by `tune` and read back by `eval`, and the refusals a user meets."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith import DraftsmithError
from tests.conftest import assert_same_step, run_cli, step_and_validate, tiny_drafter_inputs


def evaluate(features, drafter, out, *args):
    result = run_cli("eval", "--target", str(features / "target"), "--drafter", str(drafter), "--limit", "2",
                     "--repeats", "1", "--max_new_tokens", "16", "--dtype", "float32", "--out", str(out), *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_a_block_drafter_exports_and_decodes_the_targets_text(kind, request, tiny_features, tmp_path):
    ckpt = request.getfixturevalue(f"{kind}_ckpt")
    for fmt in ("native", "speculators"):  # each export is reloaded and its blocks compared with the module's
        done = run_cli("export", str(ckpt), "--format", fmt, "--out", str(tmp_path / fmt))
        assert done.returncode == 0, done.stderr[-3000:]
    native = json.loads((tmp_path / "native" / "config.json").read_text())
    assert native["kind"] == kind and native["drafter_options"]["block_size"] == 4
    spec = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert spec["speculators_model_type"] == kind and spec["block_size"] == 4
    assert spec["sample_from_anchor"] is (kind == "dspark")
    assert spec["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == (4 if kind == "dspark" else 3)
    tensors = load_file(str(tmp_path / "speculators" / "model.safetensors"))
    assert tensors["lm_head.weight"].shape == (40, 32) and tensors["layers.0.self_attn.q_norm.weight"].shape == (8,)
    assert ("markov_head.markov_w1.weight" in tensors) is (kind == "dspark")
    result = evaluate(tiny_features, tmp_path / "native", tmp_path / "eval", "--policy", "static", "--k", "8")
    assert result["identical_outputs"] is True


def test_dspark_confidence_policy_is_tuned_and_read_back(dspark_ckpt, tiny_features, tmp_path):
    assert run_cli("export", str(dspark_ckpt), "--format", "native", "--out", str(tmp_path / "d")).returncode == 0
    tuned = run_cli("tune", "--target", str(tiny_features / "target"), "--drafter", str(tmp_path / "d"),
                    "--policy", "dspark", "--data", str(tiny_features / "chats.json"), "--limit", "2", "--repeats", "1",
                    "--max_new_tokens", "12", "--thresholds", "[0.0,0.99]", "--dtype", "float32")
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    section = json.loads((tmp_path / "d" / "config.json").read_text())["stop_heads"]["dspark"]["tuned"]["greedy"]
    assert {(p["threshold"], p["k"]) for p in section["grid"]} == {(0.99, 8)} | {(0.0, k) for k in range(1, 9)}
    assert section["tokens_per_second"] == max(p["tokens_per_second"] for p in section["grid"])
    result = evaluate(tiny_features, tmp_path / "d", tmp_path / "eval", "--policy", "dspark")
    assert result["identical_outputs"] is True
    assert f"threshold {section['threshold']:g}" in result["config"]["drafter"]
    # under a profile where every row verified costs two more steps, the threshold that drafts less is chosen
    steep = tmp_path / "steep.json"
    steep.write_text(json.dumps({"machine": "by hand", "source": "a test", "verify": [[1, 1.0], [2, 3.0]],
                                 "draft": {"dspark": 0.0}}))
    tuned = run_cli("tune", "--target", str(tiny_features / "target"), "--drafter", str(tmp_path / "d"),
                    "--policy", "dspark", "--data", str(tiny_features / "chats.json"), "--limit", "2", "--repeats", "1",
                    "--max_new_tokens", "12", "--thresholds", "[0.0,0.99]", "--dtype", "float32", "--cost_profile", str(steep))
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    section = json.loads((tmp_path / "d" / "config.json").read_text())["stop_heads"]["dspark"]["tuned"]["greedy"]
    by_point = {(p["threshold"], p["k"]): p["modelled_speedup"] for p in section["grid"]}
    assert section["threshold"] == 0.99 and by_point[0.99, 8] > by_point[0.0, 8]
    assert section["cost_profile"]["source"] == "a test" and section["modelled_speedup"] == max(by_point.values())
    # where drafting and verifying are free, nothing beats drafting every round in full: among thresholds that stop
    # early, the never-stopping threshold at the best length (the static fallback tune adds) is what is filed, for
    # each profile named, the first one's also as the plain setting eval decodes with
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps({"machine": "by hand", "source": "flat", "verify": [[1, 1.0], [64, 1.0]],
                                "draft": {"dspark": 0.0}}))
    tuned = run_cli("tune", "--target", str(tiny_features / "target"), "--drafter", str(tmp_path / "d"),
                    "--policy", "dspark", "--data", str(tiny_features / "chats.json"), "--limit", "2", "--repeats", "1",
                    "--max_new_tokens", "12", "--thresholds", "[0.5,0.99]", "--dtype", "float32",
                    "--cost_profile", f"{flat},{steep}")
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    every = json.loads((tmp_path / "d" / "config.json").read_text())["stop_heads"]["dspark"]["tuned"]
    by_flat, by_steep = every[f"greedy@{flat}"], every[f"greedy@{steep}"]
    assert by_flat["static"] and by_flat["threshold"] == 0.0 and every["greedy"] == by_flat
    assert by_flat["modelled_speedup"] == max(p["modelled_speedup"] for p in by_flat["grid"])
    assert {(p["threshold"], p["k"]) for p in by_flat["grid"]} == {(0.5, 8), (0.99, 8)} | {(0.0, k) for k in range(1, 9)}
    assert by_steep["cost_profile"]["source"] == "a test" and not by_steep["static"]
    assert by_steep["modelled_speedup"] == max(p["modelled_speedup"] for p in by_steep["grid"])


def test_block_drafters_decode_trees_and_refuse_what_they_cannot_do(dflash_ckpt, tiny_features, tmp_path):
    from draftsmith.models.block import BlockDrafter
    from draftsmith.train.block import BlockDrafterModule

    refused = run_cli("export", str(dflash_ckpt), "--format", "eagle3", "--out", str(tmp_path / "x"))
    assert refused.returncode != 0 and "this is a DFlash block drafter: use --format speculators" in refused.stderr
    assert run_cli("export", str(dflash_ckpt), "--format", "native", "--out", str(tmp_path / "d")).returncode == 0
    tree = run_cli("eval", "--target", str(tiny_features / "target"), "--drafter", str(tmp_path / "d"), "--limit", "1",
                   "--max_new_tokens", "8", "--tree", "3,2,6", "--dtype", "float32", "--out", str(tmp_path / "tree"))
    assert tree.returncode == 0, tree.stderr[-3000:]
    assert json.loads((tmp_path / "tree" / "results.json").read_text())["identical_outputs"] is True
    no_head = run_cli("eval", "--target", str(tiny_features / "target"), "--drafter", str(tmp_path / "d"), "--limit", "1",
                      "--max_new_tokens", "8", "--policy", "dspark", "--out", str(tmp_path / "e"))
    assert no_head.returncode != 0 and "confidence head" in no_head.stderr
    for policy, refusal in (("dspark", "DSpark's confidence head sizes chains only; with --tree use --policy cost or "
                                       "static"), ("specdec", "draws every level of a tree from one forward")):
        refused = run_cli("eval", "--target", str(tiny_features / "target"), "--drafter", str(tmp_path / "d"),
                          "--limit", "1", "--tree", "3,2,6", "--policy", policy, "--out", str(tmp_path / "r"))
        assert refused.returncode == 2 and refusal in refused.stderr, refused.stderr[-2000:]
    with pytest.raises(DraftsmithError, match="trains block drafters"):
        BlockDrafterModule(target=str(tiny_features / "target"), kind="eagle3")
    with pytest.raises(TypeError, match="val_steps"):  # EAGLE's settings are not a block drafter's
        BlockDrafterModule(target=str(tiny_features / "target"), val_steps=3)
    # a checkpoint from when BlockDrafterModule extended DrafterModule holds them at their defaults: it still exports
    old = torch.load(dflash_ckpt, map_location="cpu", weights_only=False)
    old["hyper_parameters"].update(alignment_steps=1, val_steps=None, topk_weight=0.0, feature_weight=1.0)
    torch.save(old, tmp_path / "old.ckpt")
    assert run_cli("export", str(tmp_path / "old.ckpt"), "--format", "native", "--out", str(tmp_path / "o")).returncode == 0
    config, w = tiny_drafter_inputs()
    with pytest.raises(DraftsmithError, match="train kind dspark"):
        BlockDrafter.from_target(config, w, w, None, None, 3, 32, markov_rank=4)
    with pytest.raises(DraftsmithError, match="block_size must be >= 2"):
        BlockDrafter.from_target(config, w, w, None, None, 3, 32, block_size=1)


def test_the_registry_names_the_block_drafters_options():
    from draftsmith.models import block
    from draftsmith.models.registry import DFLASH, DSPARK

    assert DFLASH.options == DSPARK.options == block.OPTIONS
    assert DFLASH.model_class.sample_from_anchor is False and DSPARK.model_class.sample_from_anchor is True


@pytest.mark.parametrize("kind,first", [("dflash", 1), ("dspark", 0)])
def test_each_block_slot_learns_the_law_of_the_token_it_drafts(tiny_features, monkeypatch, kind, first):
    """Decoding drafts a block after the context of positions < a (the target has no state yet for the
    anchor x_a, the token it last chose) and reads slot i as x_{a+i} (DFlash, slots 1..B−1) or x_{a+i+1}
    (DSpark, slots 0..B−1). Training must distil each slot on that token's law: the target's head on its
    hidden state one position before it, not on the token's own (which is the law of the token after)."""
    from draftsmith.data.modules import FeatureDataModule
    from draftsmith.train import block

    dm = FeatureDataModule(str(tiny_features / "features"), layer_ids=[0, 1, 2], max_tokens=300, val_fraction=0.2)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    carries = (batch["loss_mask"].bool() & batch["attention_mask"].bool())[0]
    size = 4
    a = next(i for i in range(1, len(carries) - size) if carries[i:i + size + 1].all())  # a run of assistant tokens
    anchors = torch.zeros(len(batch["input_ids"]), 1, dtype=torch.long)
    anchors[0] = a
    real = torch.zeros_like(anchors, dtype=torch.bool)
    real[0] = True
    monkeypatch.setattr(block, "draw_anchors", lambda eligible, count, generator=None: (anchors, real))
    laws = []
    monkeypatch.setattr(block, "soft_cross_entropy_per_position", lambda logits, p: laws.append(p) or p.sum(-1))
    extra = {"markov_rank": 8} if kind == "dspark" else {}
    module = block.BlockDrafterModule(target=str(tiny_features / "target"), kind=kind, aux_layer_ids=[0, 1, 2],
                                      draft_vocab_size=40, block_size=size, anchors=1, count_tokens=dm.token_counts,
                                      **extra)
    module.configure_model()
    module.alignment_forward(batch, with_metrics=False)
    head = module.target_head.weight[module.drafter.draft_to_target]
    drafted = a + torch.arange(first, size) + 1 - first  # the position of each drafted token
    expected = torch.softmax(batch["final"][0, drafted - 1].float() @ head.float().T, -1)
    assert len(laws[0]) % 64 == 0  # the drafted rows, padded (`bucketed_rows`): the padding carries weight 0
    torch.testing.assert_close(laws[0][:len(expected)], expected)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_padding_the_drafted_rows_changes_neither_loss_nor_gradients_nor_metrics(tiny_features, monkeypatch, kind):
    """The block's drafted tokens are padded to a multiple of 64 rows (weight 0) so that the step's products
    take few shapes; the loss, each weight's gradient, the slot metrics and DSpark's confidence metrics are
    those of the unpadded rows."""
    from draftsmith.data.modules import FeatureDataModule
    from draftsmith.train import alignment, block

    dm = FeatureDataModule(str(tiny_features / "features"), layer_ids=[0, 1, 2], max_tokens=300, val_fraction=0.2)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    extra = {"markov_rank": 8, "confidence_head": True} if kind == "dspark" else {}
    got, rows_seen = {}, []
    spy = block.soft_cross_entropy_per_position
    monkeypatch.setattr(block, "soft_cross_entropy_per_position", lambda logits, p: rows_seen.append(len(p)) or spy(logits, p))
    for multiple in (1, 64):
        monkeypatch.setattr(alignment, "ROW_MULTIPLE", multiple)
        torch.manual_seed(0)
        module = block.BlockDrafterModule(target=str(tiny_features / "target"), kind=kind, aux_layer_ids=[0, 1, 2],
                                          draft_vocab_size=40, block_size=4, anchors=3, count_tokens=dm.token_counts,
                                          **extra)
        module.configure_model()
        out, grads = step_and_validate(module, batch)
        metrics = dict(module.val_metric.compute())
        if kind == "dspark":
            metrics.update(auroc=module.val_auroc.compute(), ece=module.val_ece.compute())
        got[multiple] = out, grads, metrics
    assert rows_seen[0] % 64 != 0 and rows_seen[2] % 64 == 0  # the unpadded arm, then the padded one
    assert_same_step(got[1], got[64])
