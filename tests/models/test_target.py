import os
import shutil
import warnings

import pytest
import torch

from draftsmith import DraftsmithError
from draftsmith.models.common import quiet_peft
from draftsmith.models.tokenizer import tokenizer_hash
from draftsmith.models.sources import gguf_special_token_ids, resolve_embedded, resolve_source, set_special_tokens
from draftsmith.models.target import load_target, load_tokenizer
from tests.conftest import save_tiny_target


def test_hidden_state_parity_with_output_hidden_states(tiny_target_dir):
    target = load_target(str(tiny_target_dir))
    ids = torch.randint(0, target.vocab_size, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # right padding
    final, extra = target.features(ids, mask, layer_ids=[0, 1, 2])
    ref = target.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    for i in (0, 1, 2):
        torch.testing.assert_close(extra[i], ref.hidden_states[i], rtol=0, atol=0)
    # the final feature is the post-norm last hidden state, and the head applied to it gives the logits
    torch.testing.assert_close(final, ref.hidden_states[-1], rtol=0, atol=0)
    torch.testing.assert_close(target.lm_head(final), ref.logits)
    assert not torch.allclose(extra[2], extra[1])
    hooks = sum(len(m._forward_hooks) for m in target.model.modules())
    _, hooked = target.features(ids, mask, layer_ids=[1, 0])  # below N: captured by hooks, not output_hidden_states
    for i in (0, 1):
        torch.testing.assert_close(hooked[i], ref.hidden_states[i], rtol=0, atol=0)
    assert sum(len(m._forward_hooks) for m in target.model.modules()) == hooks  # ours are removed afterwards


def test_target_is_frozen_and_identified(tiny_target_dir):
    target = load_target(str(tiny_target_dir))
    assert not target.model.training
    assert all(not p.requires_grad for p in target.model.parameters())
    ident = target.identity
    assert (ident.architecture, ident.hidden_size, ident.num_layers, ident.vocab_size) == ("LlamaForCausalLM", 32, 2, len(target.tokenizer))
    assert ident == load_target(str(tiny_target_dir)).identity
    # bf16 loading keeps the identity (the fingerprint samples are rounded to bf16)
    assert load_target(str(tiny_target_dir), dtype="bfloat16").identity.weights_fingerprint == ident.weights_fingerprint
    with pytest.raises(DraftsmithError, match=r"^--layer_ids: layer ids \[3\] are out of range .* use 0..2"):
        target.check_layer_ids([1, 3], "--layer_ids")


def test_other_weights_change_the_fingerprint(tiny_target_dir, tmp_path):
    other = load_target(str(save_tiny_target(tmp_path / "other", seed=1)))
    assert other.identity.weights_fingerprint != load_target(str(tiny_target_dir)).identity.weights_fingerprint
    assert other.identity.tokenizer_hash == load_target(str(tiny_target_dir)).identity.tokenizer_hash


def test_lora_adapter_is_merged_on_load(tiny_target_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    with quiet_peft():
        peft_model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "adapter")
    ids = torch.randint(0, 50, (1, 7))
    with torch.no_grad():
        expected = peft_model(ids).logits
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # peft's use of a deprecated transformers name stays quiet
        merged = load_target(str(tiny_target_dir), adapter=str(tmp_path / "adapter"))
    plain = load_target(str(tiny_target_dir))
    final, _ = merged.features(ids)
    torch.testing.assert_close(merged.lm_head(final), expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(plain.lm_head(plain.features(ids)[0]), expected, atol=1e-3)
    assert merged.identity.weights_fingerprint != plain.identity.weights_fingerprint
    with pytest.raises(DraftsmithError, match="no adapter_config.json"):
        load_target(str(tiny_target_dir), adapter=str(tmp_path))


def test_bad_target_names_give_clear_errors(tmp_path):
    with pytest.raises(DraftsmithError, match="unknown embedded target"):
        load_target("embedded:nope")
    with pytest.raises(DraftsmithError, match="GGUF file .* not found"):
        load_target(str(tmp_path / "x.gguf"))
    with pytest.raises(DraftsmithError, match="unknown dtype"):
        load_target("whatever", dtype="float8")


def test_gguf_special_tokens_come_from_the_file():
    """transformers 5.0-5.17 loaded the embedded GGUF with <|im_start|> as its eos and no pad token (so the
    tokenizer hashed to f2ab641312d00e93); the loader sets them as the file names them."""
    ids = gguf_special_token_ids(resolve_embedded("embedded:smollm2-135m-instruct"))
    assert ids == {"bos_token": 1, "eos_token": 2, "unk_token": 0, "pad_token": 2}
    tok = load_tokenizer("embedded:smollm2-135m-instruct")
    assert set_special_tokens(tok, ids) == []
    right = tokenizer_hash(tok)
    tok.eos_token = "<|im_start|>"  # what the older GGUF loader made of it
    assert tokenizer_hash(tok) != right
    assert set_special_tokens(tok, ids) == ["eos_token '<|im_start|>' -> '<|im_end|>'"]
    assert tok.eos_token_id == 2 and tokenizer_hash(tok) == right == "75ff9918aba724a7"


def test_a_file_that_is_not_gguf_is_refused_by_the_special_token_reader(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"GGML" + bytes(40))
    with pytest.raises(DraftsmithError, match="not a little-endian GGUF v2/v3 file"):
        gguf_special_token_ids(tmp_path / "x.gguf")


@pytest.mark.slow
def test_embedded_gguf_target_loads_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    target = load_target("embedded:smollm2-135m-instruct")
    cached = [p for p in (tmp_path / "gguf").iterdir() if p.name != "by-path"]
    assert len(cached) == 1 and (cached[0] / "model.safetensors").is_file()
    # the same file at another path (another virtualenv's copy) reuses the cache: it is keyed by content
    gguf = resolve_embedded("embedded:smollm2-135m-instruct")
    elsewhere = tmp_path / "other-venv" / gguf.name
    elsewhere.parent.mkdir()
    try:
        os.link(gguf, elsewhere)
    except OSError:
        shutil.copyfile(gguf, elsewhere)
    assert resolve_source(str(elsewhere)) == str(cached[0])
    assert [p for p in (tmp_path / "gguf").iterdir() if p.name != "by-path"] == cached
    again = load_target("embedded:smollm2-135m-instruct", dtype="bfloat16")  # from the cache now
    assert again.identity == target.identity
    ident = target.identity
    assert (ident.num_layers, ident.hidden_size, ident.vocab_size) == (30, 576, 49152)
    assert target.default_aux_layer_ids() == [2, 15, 27]
    assert target.eos_token_ids == (2,)  # <|im_end|>, the chat template's turn end
    ids = target.encode_chat([{"role": "user", "content": "What is 2+2?"}])
    assert target.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    out = target.model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
    assert "4" in target.tokenizer.decode(out[0, len(ids):])
