"""Every export format: contract (names, shapes, config fields) and reloaded logits."""

import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith import DraftsmithError
from draftsmith.export import check_config, check_tensors, export, load_native
from draftsmith.models.target import load_target
from tests.conftest import run_cli
from tests.train.test_fit import recipe, tiny_features  # noqa: F401  (fixture)


def train(root, tmp_path, **model):
    result = run_cli("fit", "--config", str(recipe(root, tmp_path, **model)), "--trainer.max_steps", "2",
                     "--trainer.val_check_interval", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp_path / "run" / "ckpt" / "last.ckpt"


@pytest.fixture(scope="module")
def eagle3_ckpt(tiny_features, tmp_path_factory):
    return train(tiny_features, tmp_path_factory.mktemp("e3"), kind="eagle3", draft_vocab_size=40, aux_layer_ids=[0, 1, 2])


@pytest.fixture(scope="module")
def eagle_ckpt(tiny_features, tmp_path_factory):
    return train(tiny_features, tmp_path_factory.mktemp("e1"))


SIZES = dict(H=32, Ht=32, I=64, V=110, Vd=40, k=3, nh=4, nkv=2, hd=8)


def test_eagle_format_per_engine(eagle_ckpt, tmp_path):
    result = export(str(eagle_ckpt), "eagle", str(tmp_path / "e"))
    assert result["max_logit_error"] < 1e-4
    vllm = json.loads((tmp_path / "e" / "vllm" / "config.json").read_text())
    sglang = json.loads((tmp_path / "e" / "sglang" / "config.json").read_text())
    assert vllm["architectures"] == ["LlamaForCausalLM"] and sglang["architectures"] == ["LlamaForCausalLMEagle"]
    tensors = load_file(tmp_path / "e" / "vllm" / "model.safetensors")
    assert torch.count_nonzero(tensors["fc.bias"]) == 0 and "layers.0.input_layernorm.weight" not in tensors
    assert "norm.weight" not in tensors and "lm_head.weight" not in tensors
    ref = torch.load(tmp_path / "e" / "eagle-reference" / "pytorch_model.bin", weights_only=True)
    assert {"embed_tokens.weight", "fc.bias"} <= set(ref) and ref.keys() == tensors.keys()
    assert json.loads((tmp_path / "e" / "eagle-reference" / "config.json").read_text())["rope_scaling"] is None
    sizes = dict(SIZES, V=ref["embed_tokens.weight"].shape[0])
    check_tensors("eagle", tensors, sizes, "vllm")
    with pytest.raises(DraftsmithError, match="--format eagle3 is for EAGLE-3 drafters; this is an EAGLE-1/2/HASS drafter"):
        export(str(eagle_ckpt), "eagle3", str(tmp_path / "x"))


def test_eagle3_and_speculators_formats(eagle3_ckpt, tmp_path):
    export(str(eagle3_ckpt), "eagle3", str(tmp_path / "e3"))
    vllm = json.loads((tmp_path / "e3" / "vllm" / "config.json").read_text())
    sglang = json.loads((tmp_path / "e3" / "sglang" / "config.json").read_text())
    assert vllm["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [-1, 0, 1]  # SGLang adds 1
    assert vllm["draft_vocab_size"] == 40 and vllm["tie_word_embeddings"] is False
    assert vllm["norm_before_residual"] is False and "rope_theta" in vllm and "num_aux_hidden_states" not in vllm
    tensors = load_file(tmp_path / "e3" / "vllm" / "model.safetensors")
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].sum() == 40
    target_ids = torch.arange(40) + tensors["d2t"]
    assert torch.equal(torch.nonzero(tensors["t2d"]).flatten(), target_ids)
    export(str(eagle3_ckpt), "speculators", str(tmp_path / "spec"), speculative_tokens=4)
    spec = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert spec["architectures"] == ["Eagle3Speculator"] and spec["speculators_model_type"] == "eagle3"
    assert spec["speculators_config"]["proposal_methods"][0] == {"proposal_type": "greedy", "speculative_tokens": 4}
    assert spec["transformer_layer_config"]["num_hidden_layers"] == 1
    assert (tmp_path / "spec" / "model.safetensors").is_file()
    with pytest.raises(DraftsmithError, match="--format eagle is for .* this is an EAGLE-3 drafter: use --format eagle3"):
        export(str(eagle3_ckpt), "eagle", str(tmp_path / "x"))


def test_native_round_trip_and_wrong_target(eagle3_ckpt, tiny_features, tmp_path):
    result = run_cli("export", str(eagle3_ckpt), "--format", "native", "--out", str(tmp_path / "n"))
    assert result.returncode == 0 and "contract ok" in result.stdout, result.stderr[-2000:]
    config = json.loads((tmp_path / "n" / "config.json").read_text())
    assert config["kind"] == "eagle3" and config["aux_layer_ids"] == [0, 1, 2]
    assert config["layer_convention"] == "hf_output_hidden_states" and config["provenance"]["global_step"] == 2
    drafter = load_native(tmp_path / "n", load_target(str(tiny_features / "target")))
    assert drafter.vocab_size == 40
    from tests.conftest import save_tiny_target
    other = load_target(str(save_tiny_target(tmp_path / "other", seed=5)))
    with pytest.raises(DraftsmithError, match="trained for another target.*weights_fingerprint"):
        load_native(tmp_path / "n", other)


def test_contract_checks_catch_each_kind_of_break():
    good = {"fc.weight": torch.zeros(32, 64), "fc.bias": torch.zeros(32),
            "layers.0.self_attn.q_proj.weight": torch.zeros(32, 32), "layers.0.self_attn.k_proj.weight": torch.zeros(16, 32),
            "layers.0.self_attn.v_proj.weight": torch.zeros(16, 32), "layers.0.self_attn.o_proj.weight": torch.zeros(32, 32),
            "layers.0.mlp.gate_proj.weight": torch.zeros(64, 32), "layers.0.mlp.up_proj.weight": torch.zeros(64, 32),
            "layers.0.mlp.down_proj.weight": torch.zeros(32, 64), "layers.0.post_attention_layernorm.weight": torch.zeros(32)}
    check_tensors("eagle", good, SIZES, "x")
    for broken, message in [
        ({k: v for k, v in good.items() if k != "fc.bias"}, "missing fc.bias"),
        ({**good, "fc.weight": torch.zeros(32, 96)}, r"fc.weight: shape \(32, 96\), expected \(32, 64\)"),
        ({**good, "layers.0.input_layernorm.weight": torch.zeros(32)}, "unexpected tensor layers.0.input_layernorm"),
    ]:
        with pytest.raises(DraftsmithError, match=message):
            check_tensors("eagle", broken, SIZES, "x")
    with pytest.raises(DraftsmithError, match="missing eagle_config.eagle_aux_hidden_state_layer_ids"):
        check_config({"architectures": ["A"]}, {"architectures": ["A"], "eagle_config.eagle_aux_hidden_state_layer_ids": [1]}, "x")
    with pytest.raises(DraftsmithError, match="norm_before_residual = True, expected False"):
        check_config({"norm_before_residual": True}, {"norm_before_residual": False}, "x")


def test_standalone_distill_and_native_export(tiny_features, tmp_path):
    result = run_cli("fit", "--config", str(recipe(tiny_features, tmp_path)), "--trainer.max_steps", "2",
                     "--model", "draftsmith.train.distill.DistillModule", "--model.init_args.num_layers", "1",
                     "--model.init_args.lora_rank", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "standalone"
    export(str(tmp_path / "run" / "ckpt" / "last.ckpt"), "native", str(out))
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 1 and json.loads((out / "draftsmith.json").read_text())["kind"] == "standalone"
    # the training split's assistant-token counts travel with the export: the runtime's ranked head reads them
    from draftsmith.data.modules import FeatureDataModule
    from draftsmith.eval.evaluate import load_proposer
    from draftsmith.export import TOKEN_COUNTS

    dm = FeatureDataModule(str(tiny_features / "features"), max_tokens=300, val_fraction=0.2)
    dm.setup("fit")
    counts = load_file(str(out / TOKEN_COUNTS))["token_counts"]
    assert torch.equal(counts, dm.token_counts(model.config.vocab_size)) and counts.sum() > 0
    target = load_target(str(tiny_features / "target"), dtype="float32")
    proposer, what = load_proposer(str(out), target, head_vocab=12)
    assert len(proposer.head_ids) == 12 and "12-token head" in what
    top = set(torch.argsort(-counts.double(), stable=True)[:10].tolist())
    assert top <= set(proposer.head_ids.tolist()) and target.tokenizer.eos_token_id in proposer.head_ids.tolist()
    assert load_proposer(str(out), target, head_vocab=0)[0].head_ids is None
    with pytest.raises(DraftsmithError, match="exports as `native`"):
        export(str(tmp_path / "run" / "ckpt" / "last.ckpt"), "eagle", str(tmp_path / "x"))
