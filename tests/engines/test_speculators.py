"""The speculators export loaded by the `speculators` package's own code (`make test-engines`).

Runs where the package is installed (.venv-engines); elsewhere it is skipped. Against the export as it
was before issue 28 it fails twice over: the verifier was draftsmith's alias, which the package cannot
resolve, and without `embed_tokens.weight` the package's drafter ran on an all-zero embedding."""

from pathlib import Path

import pytest
import torch

speculators = pytest.importorskip("speculators")

from draftsmith.export import export  # noqa: E402
from draftsmith.export.checkpoint import load_checkpoint, module_from_checkpoint  # noqa: E402
from tests.test_families import ARMS, FAMILIES, arm_kind, engine_case, family_features, train_family_drafter  # noqa: E402


def package_drafter(directory: Path):
    """SpeculatorModel.from_pretrained as a user would call it, with eager attention (flex attention
    is the package's default and is meant for GPUs)."""
    from speculators import SpeculatorModel, SpeculatorModelConfig

    config = SpeculatorModelConfig.from_pretrained(directory)
    config.transformer_layer_config._attn_implementation = "eager"
    return SpeculatorModel.from_pretrained(directory, config=config).float().eval()


def test_the_speculators_package_drafts_what_the_trained_module_drafts(eagle3_ckpt, tmp_path):
    drafts_as_trained(eagle3_ckpt, tmp_path / "spec")


@pytest.mark.parametrize("family, arm", [engine_case(family, arm) for arm in ARMS if "speculators" in arm_kind(arm).formats
                                         for family in FAMILIES])
def test_every_familys_drafter_loads_in_the_speculators_package(family, arm, tmp_path, monkeypatch):
    """Drafters of every target family are Llama-layout (EAGLE-3, P-EAGLE) or Qwen3-layout (DFlash, DSpark)
    layers of the target's sizes (head_dim apart from hidden/heads, the MoE target's dense width, the
    target's rope, no biases): the package builds each from the config alone and drafts what it drafts."""
    family_features(family, tmp_path / "tiny")
    ckpt = train_family_drafter(tmp_path / "tiny", tmp_path / "fit", ARMS[arm])
    AS_TRAINED[arm_kind(arm).name](ckpt, tmp_path / "spec", monkeypatch)


@pytest.mark.parametrize("options", [{"fc_norm": True, "norm_output": True},
                                     {"norm_before_fc": True, "rope_theta": 1e6}])
def test_the_speculators_package_drafts_what_an_eagle31_drafter_drafts(tiny_features, tmp_path, options):
    """EAGLE-3.1's norms (per fused layer or on all of them; the output normed) and a drafter's own RoPE base:
    the package reads the flags, tensors and base and drafts what the trained module drafts."""
    from tests.conftest import train

    ckpt = train(tiny_features, tmp_path / "fit", kind="eagle3", draft_vocab_size=40, aux_layer_ids=[0, 1, 2], **options)
    drafts_as_trained(ckpt, tmp_path / "spec")


def drafts_as_trained(ckpt, out):
    """Export `ckpt` for the speculators package and check that one drafting step of the package's model
    gives the trained module's logits (1e-4) and draft tokens."""
    export(str(ckpt), "speculators", str(out))
    model = package_drafter(out)
    module = module_from_checkpoint(load_checkpoint(ckpt))
    reference = module.drafter.float().eval()
    assert torch.equal(model.embed_tokens.weight, reference.embed_tokens.weight.float())

    g = torch.Generator().manual_seed(0)
    t = 12
    ids = torch.randint(0, reference.embed_tokens.num_embeddings, (1, t), generator=g)
    feats = torch.randn(1, t, reference.fc.in_features, generator=g)
    positions = torch.arange(t)[None]
    causal = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        expected = reference.logits(reference(ids, reference.project(feats, feats), positions, causal))
        captured = []
        hook = model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out))
        drafted = model(hidden_states=feats, input_ids=ids, document_ids=torch.zeros(1, t, dtype=torch.long),
                        position_ids=positions, ttt_steps=1)
        hook.remove()
    logits = captured[0].float()
    assert logits.shape == expected.shape
    assert (logits - expected).abs().max() < 1e-4
    assert torch.equal(drafted[0], expected.argmax(-1))  # one drafting step: the same draft tokens


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_the_speculators_package_drafts_a_block_as_the_trained_module(kind, request, tmp_path, monkeypatch):
    """DFlash and DSpark: the package's own forward (its anchor-block attention mask, Qwen3 layers, rotary,
    and DSpark's Markov and confidence heads) at anchors we choose gives the trained module's logits."""
    block_drafts_as_trained(request.getfixturevalue(f"{kind}_ckpt"), tmp_path / "spec", monkeypatch)


def block_drafts_as_trained(ckpt, out, monkeypatch):
    export(str(ckpt), "speculators", str(out))
    model = package_drafter(out)
    expected, got = block_logits_both_ways(module_from_checkpoint(load_checkpoint(ckpt)).drafter.float().eval(), model,
                                           monkeypatch)
    assert got.shape == expected.shape
    assert (got - expected).abs().max() < 1e-4


def test_a_block_export_in_a_wrong_layout_drafts_otherwise(dspark_ckpt, tmp_path, monkeypatch):
    """The check above can fail: DSpark exported as DFlash's layout (its anchor slot drafting nothing) differs."""
    import json

    export(str(dspark_ckpt), "speculators", str(tmp_path / "spec"))
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    config["sample_from_anchor"] = False
    (tmp_path / "spec" / "config.json").write_text(json.dumps(config))
    model = package_drafter(tmp_path / "spec")
    drafter = module_from_checkpoint(load_checkpoint(dspark_ckpt)).drafter.float().eval()
    expected, got = block_logits_both_ways(drafter, model, monkeypatch)
    assert got.shape != expected.shape or (got - expected).abs().max() > 1e-3


def block_logits_both_ways(drafter, model, monkeypatch):
    """Blocks at anchors 3 and 7 of 12 random positions, drafted by the trained module (`models/block.py`)
    and by the package's model: each slot's logits (Markov-biased, with the confidence logit, for DSpark)."""
    import speculators.models.dflash.core as core

    from draftsmith.train.block import block_layout

    g = torch.Generator().manual_seed(0)
    t, anchors = 12, torch.tensor([3, 7])
    ids = torch.randint(0, drafter.embed_tokens.num_embeddings, (1, t), generator=g)
    feats = torch.randn(1, t, drafter.fc.in_features, generator=g)
    b = drafter.block_size
    monkeypatch.setattr(core, "select_anchors", lambda *_a, **_k: (anchors, torch.ones(2, dtype=torch.bool)))
    with torch.no_grad():
        positions, visible = block_layout(anchors[None], b, t)
        context = drafter.context(drafter.project(None, feats), torch.arange(t)[None])
        blocks = drafter.block_tokens(ids[0, anchors])  # (A, B)
        hidden = drafter(blocks.flatten()[None], positions, context, visible)[0].view(2, b, -1)
        mine = [drafter.logits(hidden)]
        hidden_pkg, logits, *_ = model._backbone_forward(feats, ids, torch.ones(1, t), torch.randn(1, t, feats.shape[-1] // 3),
                                                         torch.zeros(1, t, dtype=torch.long), max_anchors=2)
        theirs = [logits.view(2, b, -1)]
        if drafter.markov_head is not None:  # DSpark: slot k's previous token is block token k
            bias, emb = drafter.markov(blocks)
            mine = [mine[0] + bias]
            prev = model.markov_head.prev_embeddings(blocks)
            theirs = [theirs[0] + model.markov_head.block_bias(prev_token_ids=blocks, hidden_states=hidden_pkg.view(2, b, -1),
                                                               prev_emb=prev)]
            if drafter.confidence_head is not None:
                mine.append(drafter.confidence(hidden, emb)[..., None])
                theirs.append(model.confidence_head(torch.cat([hidden_pkg.view(2, b, -1), prev], -1))[..., None])
        first = drafter.first_slot if model.config.sample_from_anchor == drafter.sample_from_anchor else 1 - drafter.first_slot
        return torch.cat(mine, -1)[:, drafter.first_slot:], torch.cat(theirs, -1)[:, first:]


def test_the_speculators_package_drafts_in_parallel_as_a_trained_peagle_drafter(peagle_ckpt, tmp_path, monkeypatch):
    """P-EAGLE: the package's own parallel forward (its COD layout fixed to anchors we choose: every position
    at depth 0, anchors 3 and 7 at depth 1, anchor 3 at depth 2; its mask token and mask_hidden; its
    attention mask) gives the logits the trained module's alignment steps give the same positions."""
    peagle_drafts_as_trained(peagle_ckpt, tmp_path / "spec", monkeypatch)


def peagle_drafts_as_trained(ckpt, out, monkeypatch):
    import speculators.models.peagle.core as core

    from draftsmith.train.alignment import alignment_hiddens

    export(str(ckpt), "speculators", str(out))
    model = package_drafter(out)
    drafter = module_from_checkpoint(load_checkpoint(ckpt)).drafter.float().eval()
    g = torch.Generator().manual_seed(0)
    t = 12
    ids = torch.randint(0, drafter.embed_tokens.num_embeddings, (1, t + 3), generator=g)
    feats = torch.randn(1, t, drafter.fc.in_features, generator=g)
    anchor_pos = torch.cat([torch.arange(t), torch.tensor([3, 7, 3])])
    depth = torch.cat([torch.zeros(t, dtype=torch.long), torch.tensor([1, 1, 2])])
    monkeypatch.setattr(core, "generate_cod_sample_indices", lambda **_k: (anchor_pos, depth))
    monkeypatch.setattr(core, "compute_metrics", lambda **_k: (None, {}))  # its loss kernels want a GPU
    captured = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out))
    with torch.no_grad():
        # the package reads token x_{t+1} with feature f_t at position t, the layout our anchors have
        model(hidden_states=feats, input_ids=ids[:, 1:t + 1], document_ids=torch.zeros(1, t, dtype=torch.long),
              loss_mask=torch.ones(1, t), verifier_last_hidden_states=torch.randn(1, t, feats.shape[-1] // 3))
        hook.remove()
        hiddens = alignment_hiddens(drafter, ids[:, : t + 1], drafter.project(None, feats), torch.ones(1, t, dtype=torch.bool), 3)
        mine = torch.stack([drafter.logits(hiddens[j][0, p]) for p, j in [(3, 1), (7, 1), (3, 2)]])
        first = drafter.logits(hiddens[0][0])
    theirs = captured[0][0].float()
    assert (theirs[:t] - first).abs().max() < 1e-4
    assert (theirs[t:] - mine).abs().max() < 1e-4


AS_TRAINED = {  # kind → the check that the package's own forward of its export gives the trained module's logits
    "eagle3": lambda ckpt, out, monkeypatch: drafts_as_trained(ckpt, out),
    "peagle": peagle_drafts_as_trained,
    "dflash": block_drafts_as_trained,
    "dspark": block_drafts_as_trained,
}
