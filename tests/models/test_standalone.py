import pytest
import torch

from draftsmith import DraftsmithError
from draftsmith.models.standalone import build_standalone
from tests.conftest import make_llama


def test_copies_the_chosen_target_layers_in_order():
    target = make_llama(50, seed=3, hidden=16, layers=4)
    draft = build_standalone(target, layer_ids=[0, 3])
    assert draft.config.num_hidden_layers == 2 and target.config.num_hidden_layers == 4
    src, own = target.state_dict(), draft.state_dict()
    for new, old in ((0, 0), (1, 3)):
        for name in ("self_attn.q_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"):
            torch.testing.assert_close(own[f"model.layers.{new}.{name}"], src[f"model.layers.{old}.{name}"], rtol=0, atol=0)
    torch.testing.assert_close(own["lm_head.weight"], src["lm_head.weight"], rtol=0, atol=0)
    # with every layer copied in order, the draft is the target
    ids = torch.randint(0, 50, (1, 7))
    whole = build_standalone(target, layer_ids=[0, 1, 2, 3])
    torch.testing.assert_close(whole(ids).logits, target(ids).logits)
    # the default copies the first layers
    first = build_standalone(target, num_layers=2).state_dict()
    torch.testing.assert_close(first["model.layers.1.mlp.up_proj.weight"], src["model.layers.1.mlp.up_proj.weight"], rtol=0, atol=0)


def test_rejects_bad_layer_ids():
    target = make_llama(50, hidden=16, layers=4)
    with pytest.raises(DraftsmithError, match=r"layer_ids must be target decoder layers in 0..3, got \[0, 4\]"):
        build_standalone(target, layer_ids=[0, 4])
    with pytest.raises(DraftsmithError, match="cannot be combined"):
        build_standalone(target, layer_ids=[0], shape={"hidden_size": 8})
