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
from tests.test_families import EAGLE3, FAMILIES, family_features, train_family_drafter  # noqa: E402


def package_drafter(directory: Path):
    """SpeculatorModel.from_pretrained as a user would call it, with eager attention (flex attention
    is the package's default and is meant for GPUs)."""
    from speculators import SpeculatorModel, SpeculatorModelConfig

    config = SpeculatorModelConfig.from_pretrained(directory)
    config.transformer_layer_config._attn_implementation = "eager"
    return SpeculatorModel.from_pretrained(directory, config=config).float().eval()


def test_the_speculators_package_drafts_what_the_trained_module_drafts(eagle3_ckpt, tmp_path):
    drafts_as_trained(eagle3_ckpt, tmp_path / "spec")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_familys_drafter_loads_in_the_speculators_package(family, tmp_path):
    """Drafters of every target family are Llama-layout layers of the target's sizes (head_dim apart from
    hidden/heads, the MoE target's dense width, no biases): the package builds each from the config alone."""
    family_features(family, tmp_path / "tiny")
    drafts_as_trained(train_family_drafter(tmp_path / "tiny", tmp_path / "fit", EAGLE3), tmp_path / "spec")


@pytest.mark.parametrize("options", [{"fc_norm": True, "norm_output": True}, {"norm_before_fc": True}])
def test_the_speculators_package_drafts_what_an_eagle31_drafter_drafts(tiny_features, tmp_path, options):
    """EAGLE-3.1's norms (per fused layer or on all of them; the output normed): the package reads the flags
    and tensors and drafts what the trained module drafts."""
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
