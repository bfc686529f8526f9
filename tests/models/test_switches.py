"""The attention switch runs a model's SDPA attention as our function for a call and leaves it as it was."""

from __future__ import annotations

import torch

from draftsmith.models.switches import AttentionSwitch
from tests.conftest import make_llama


def test_the_switched_function_runs_inside_and_the_model_is_restored_after():
    model = make_llama(50)
    model.config._attn_implementation = "sdpa"
    ids = torch.arange(1, 9)[None]
    with torch.no_grad():
        expected = model(ids).logits
    calls = []

    def counted(module, query, key, value, attention_mask, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        calls.append(query.shape)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    switch = AttentionSwitch("draftsmith_test_counted", counted, model)
    with torch.no_grad(), switch:
        assert model.config._attn_implementation == "draftsmith_test_counted"
        with switch:  # nested: the inner exit leaves it on
            pass
        assert model.config._attn_implementation == "draftsmith_test_counted"
        got = model(ids).logits
    assert len(calls) == model.config.num_hidden_layers  # every layer's attention went through it
    torch.testing.assert_close(got, expected)
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        model(ids)
    assert len(calls) == model.config.num_hidden_layers  # not after the exit


def test_a_switch_restores_what_the_config_named_and_is_off_when_disabled():
    model = make_llama(50)
    model.config._attn_implementation = "sdpa"
    outer = AttentionSwitch("draftsmith_test_outer", lambda *a, **k: None, model)
    with outer:
        inner = AttentionSwitch("draftsmith_test_inner", lambda *a, **k: None, model)
        assert inner.configs == []  # the config names another switch's attention: not ours to change
        again = AttentionSwitch("draftsmith_test_outer", lambda *a, **k: None, model)
        with again:  # a second switch of the same name, made while the first is on
            assert model.config._attn_implementation == "draftsmith_test_outer"
        assert model.config._attn_implementation == "draftsmith_test_outer"
    assert model.config._attn_implementation == "sdpa"
    off = AttentionSwitch("draftsmith_test_off", lambda *a, **k: None, model, enabled=False)
    with off:
        assert model.config._attn_implementation == "sdpa"
    model.config._attn_implementation = "eager"
    assert AttentionSwitch("draftsmith_test_eager", lambda *a, **k: None, model).configs == []
