"""Every export format: contract (names, shapes, config fields) and reloaded logits."""

import csv
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith import DraftsmithError
from draftsmith.export import export
from draftsmith.export.common import check_config
from draftsmith.export.eagle import check_eagle
from draftsmith.models.loading import TOKEN_COUNTS, load_native
from draftsmith.runtime.loading import load_proposer
from draftsmith.models.target import load_target
from tests.conftest import recipe, run_cli


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
    check_eagle(tensors, sizes, "vllm")
    with pytest.raises(DraftsmithError, match="--format eagle3 is for an EAGLE-3 drafter; this is an EAGLE-1/2/HASS drafter"):
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
    assert vllm["draftsmith"]["provenance"]["global_step"] == 2 and vllm["draftsmith"]["kind"] == "eagle3"
    export(str(eagle3_ckpt), "speculators", str(tmp_path / "spec"), speculative_tokens=4)
    spec = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert spec["architectures"] == ["Eagle3Speculator"] and spec["speculators_model_type"] == "eagle3"
    assert spec["speculators_config"]["proposal_methods"][0] == {"proposal_type": "greedy", "speculative_tokens": 4}
    assert spec["transformer_layer_config"]["num_hidden_layers"] == 1
    # the verifier resolves outside draftsmith (a model directory with its tokenizer), and the
    # embedding is written: the speculators package would leave a missing one at zero
    verifier = Path(spec["speculators_config"]["verifier"]["name_or_path"])
    assert verifier.is_absolute() and (verifier / "config.json").is_file() and (verifier / "tokenizer.json").is_file()
    assert spec["draftsmith"]["provenance"]["checkpoint"] == str(Path(eagle3_ckpt).resolve())
    spec_tensors = load_file(tmp_path / "spec" / "model.safetensors")
    target = load_target(str(verifier))
    assert torch.equal(spec_tensors["embed_tokens.weight"], target.embed_tokens.weight.float())
    with pytest.raises(DraftsmithError, match="--verifier .* is not the drafter's target"):
        from tests.conftest import save_tiny_target
        export(str(eagle3_ckpt), "speculators", str(tmp_path / "x"), verifier=str(save_tiny_target(tmp_path / "o", hidden=48)))
    export(str(eagle3_ckpt), "speculators", str(tmp_path / "hub"), verifier="org/served-target")
    hub = json.loads((tmp_path / "hub" / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"]
    assert hub == "org/served-target"
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
    check_eagle(good, SIZES, "x")
    for broken, message in [
        ({k: v for k, v in good.items() if k != "fc.bias"}, "missing fc.bias"),
        ({**good, "fc.weight": torch.zeros(32, 96)}, r"fc.weight: shape \(32, 96\), expected \(32, 64\)"),
        ({**good, "layers.0.input_layernorm.weight": torch.zeros(32)}, "unexpected tensor layers.0.input_layernorm"),
    ]:
        with pytest.raises(DraftsmithError, match=message):
            check_eagle(broken, SIZES, "x")
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


def test_a_run_directory_exports_the_checkpoint_lightning_recorded_as_best(tiny_features, tmp_path):
    """save_top_k 2: file names (best-step=9 sorts after best-step=12) and times (the newest) both
    point elsewhere; the best score, as ModelCheckpoint recorded it, decides."""
    import yaml

    from draftsmith.train.checkpoints import best_checkpoint

    path = recipe(tiny_features, tmp_path)
    cfg = yaml.safe_load(path.read_text())
    cfg["trainer"].update(max_steps=12, val_check_interval=3)
    cfg["trainer"]["callbacks"] = [{"class_path": "pytorch_lightning.callbacks.ModelCheckpoint", "init_args": {
        "dirpath": str(tmp_path / "run" / "ckpt"), "monitor": "val/loss", "mode": "max", "save_top_k": 2,
        "save_last": True, "filename": "best-{step}"}}]
    path.write_text(yaml.safe_dump(cfg))
    result = run_cli("fit", "--config", str(path))
    assert result.returncode == 0, result.stderr[-3000:]
    last = torch.load(tmp_path / "run" / "ckpt" / "last.ckpt", map_location="cpu", weights_only=True)
    record = next(v for k, v in last["callbacks"].items() if k.startswith("ModelCheckpoint"))
    kept = sorted((tmp_path / "run" / "ckpt").glob("best-*.ckpt"))
    assert len(kept) == 2
    by_name, by_time = kept[-1], max(kept, key=lambda p: p.stat().st_mtime)
    best = best_checkpoint(tmp_path / "run")
    assert best == Path(record["best_model_path"]) and best not in (by_name, by_time)
    # and the score it holds is the highest val/loss of the run's validations
    rows = [r for r in csv.DictReader(open(tmp_path / "run" / "logs" / "version_0" / "metrics.csv")) if r.get("val/loss")]
    assert float(record["best_model_score"]) == pytest.approx(max(float(r["val/loss"]) for r in rows))
    exported = export(str(tmp_path / "run"), "native", str(tmp_path / "n"))
    assert exported["checkpoint"] == str(best)
    # every format says where it came from: two exports of one run's checkpoints are told apart
    export(str(tmp_path / "run" / "ckpt" / "last.ckpt"), "eagle", str(tmp_path / "e"))
    best_prov = json.loads((tmp_path / "n" / "config.json").read_text())["provenance"]
    last_prov = json.loads((tmp_path / "e" / "vllm" / "config.json").read_text())["draftsmith"]["provenance"]
    best_row = next(r for r in rows if float(r["val/loss"]) == pytest.approx(best_prov["score"]))
    assert best_prov["checkpoint"] == str(best.resolve()) and best_prov["monitor"] == "val/loss"
    assert best_prov["global_step"] == int(best_row["step"]) + 1 
    # last.ckpt holds the run's last step (fit writes it where training ends), and its score is that step's
    # own validation, not the score ModelCheckpoint last recorded for a top-k file
    assert last_prov["checkpoint"].endswith("last.ckpt") and last_prov["global_step"] == 12
    assert last_prov["global_step"] != best_prov["global_step"]
    last_row = next(r for r in rows if int(r["step"]) + 1 == last_prov["global_step"])
    assert last_prov["score"] == pytest.approx(float(last_row["val/loss"]))


DEEPSPEED_ZERO = """
import os, sys, torch
os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3], RANK="0", WORLD_SIZE="1",
                  LOCAL_RANK="0")
import deepspeed
from draftsmith.export.checkpoint import module_from_checkpoint
ckpt = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
ckpt["path"] = sys.argv[1]
module = module_from_checkpoint(ckpt).train()
deepspeed.init_distributed(dist_backend="gloo")
engine, *_ = deepspeed.initialize(model=module, model_parameters=[p for p in module.parameters() if p.requires_grad],
    config={"train_batch_size": 1, "zero_optimization": {"stage": 2},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}})
# what Lightning's DeepSpeedStrategy.save_checkpoint writes: the checkpoint dict, less weights and optimizer
client = {k: v for k, v in ckpt.items() if k not in ("state_dict", "optimizer_states", "path")}
engine.save_checkpoint(sys.argv[2], client_state=client, tag="checkpoint")
"""


def test_a_deepspeed_zero_directory_is_converted_and_exported(eagle_ckpt, tmp_path):
    """ZeRO writes a directory of shards; export consolidates it with DeepSpeed's own converter."""
    import socket
    import subprocess
    import sys

    pytest.importorskip("deepspeed")
    with socket.socket() as free:  # a port nothing listens on: gloo's store must not meet another test's
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    zero = tmp_path / "run" / "best-step=2.ckpt"
    script = tmp_path / "zero.py"
    script.write_text(DEEPSPEED_ZERO)
    made = subprocess.run([sys.executable, str(script), str(eagle_ckpt), str(zero), str(port)],
                          capture_output=True, text=True, timeout=600)
    assert made.returncode == 0 and (zero / "latest").is_file(), made.stderr[-3000:]
    result = export(str(zero), "eagle", str(tmp_path / "e"))
    assert result["max_logit_error"] < 1e-4 and result["checkpoint"] == str(zero)
    assert (tmp_path / "run" / "best-step=2.ckpt.fp32.ckpt").is_file()  # consolidated once, beside it
    export(str(eagle_ckpt), "eagle", str(tmp_path / "e0"))
    a, b = (load_file(p / "vllm" / "model.safetensors") for p in (tmp_path / "e", tmp_path / "e0"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


BOUNDARY = """
import sys
from draftsmith.eval.evaluate import EvalConfig, evaluate
results = evaluate(EvalConfig(target=sys.argv[1], drafter=sys.argv[2], prompts="mtbench", limit=1, max_new_tokens=4,
                              repeats=1, dtype="float32", out=sys.argv[3]))
assert results["acceptance"]["rounds"] > 0
print("loaded:", sorted(m for m in sys.modules if m.startswith(("draftsmith.train", "draftsmith.export"))))
"""


def test_eval_loads_nothing_from_training_or_export_writers(eagle3_ckpt, tiny_features, tmp_path):
    """The runtime and eval stand on the models alone: a served drafter needs no training code."""
    import subprocess
    import sys

    export(str(eagle3_ckpt), "native", str(tmp_path / "n"))
    out = subprocess.run([sys.executable, "-c", BOUNDARY, str(tiny_features / "target"), str(tmp_path / "n"),
                          str(tmp_path / "eval")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "loaded: []" in out.stdout, out.stdout


@pytest.mark.slow
def test_an_embedded_targets_verifier_is_its_dequantized_directory():
    """The speculators config must name a target vLLM and the speculators package can load: for the
    embedded GGUF target, the dequantized copy, a model directory with config, weights and tokenizer."""
    from transformers import AutoConfig, AutoTokenizer

    from draftsmith.export.speculators import verifier_path

    identity = load_target("embedded:smollm2-135m-instruct").identity.as_dict()
    path = Path(verifier_path(identity, None))
    assert path.is_absolute() and (path / "model.safetensors").is_file()
    assert AutoConfig.from_pretrained(path).hidden_size == identity["hidden_size"]
    assert AutoTokenizer.from_pretrained(path).chat_template
    with pytest.raises(DraftsmithError, match="LoRA adapter"):
        verifier_path({**identity, "adapter": "some/lora"}, None)
    with pytest.raises(DraftsmithError, match="an embedded alias means nothing to vLLM"):
        verifier_path(identity, "embedded:smollm2-135m-instruct")

