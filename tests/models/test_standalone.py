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


def test_layer_types_follow_the_copied_layers_and_extend_for_a_deeper_shape():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)  # Qwen2 with a sliding window: layer 0 full attention, layer 1 sliding
    cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=50, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    target = Qwen2ForCausalLM(cfg).eval()
    types = target.config.layer_types
    assert len(set(types)) == 2
    assert build_standalone(target, layer_ids=[1, 0]).config.layer_types == [types[1], types[0]]
    deep = build_standalone(target, num_layers=3, shape={"hidden_size": 16, "intermediate_size": 32,
                                                        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8})
    assert deep.config.layer_types == [types[0], types[1], types[0]] and len(deep.model.layers) == 3
    assert deep(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 50)
