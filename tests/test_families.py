"""The family matrix: a tiny random target of each decoder-only family a user brings goes through
extract → fit → export → eval with every drafter kind, and decodes exactly the target's greedy text (fp32),
with chains and trees, on prompts longer than its sliding window where it has one.

Each target is built from transformers' own config class (no download), on the suite's character
tokenizer, so it can read the same chats and MT-bench prompts as the tiny Llama."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.models.registry import DRAFTER_KINDS
from tests.conftest import BLOCK, DSPARK, make_tokenizer, recipe, run_cli, sample_chats

WINDOW = 12  # the sliding window of the families that have one: every prompt here is longer


def family_config(family: str, vocab_size: int):
    """A two-to-four-layer random config of `family` with the special ids of the suite's tokenizer."""
    import transformers as tf

    common = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  bos_token_id=2, eos_token_id=3, pad_token_id=1)
    mixed = ["sliding_attention", "full_attention"] * 2
    return {
        "llama": lambda: tf.LlamaConfig(**common, tie_word_embeddings=True),
        "qwen3": lambda: tf.Qwen3Config(**common, head_dim=8, tie_word_embeddings=False),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(**common, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                               moe_intermediate_size=32, decoder_sparse_step=1),
        "gemma3_text": lambda: tf.Gemma3TextConfig(**common, head_dim=16, query_pre_attn_scalar=16,
                                                   sliding_window=WINDOW, layer_types=mixed,
                                                   final_logit_softcapping=30.0),
        "gemma2": lambda: tf.Gemma2Config(**common, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
                                          layer_types=mixed),  # attention and logits soft-capped: eager attention
        "mistral": lambda: tf.MistralConfig(**common, sliding_window=WINDOW),
        "phi3": lambda: tf.Phi3Config(**common),
        "gpt_oss": lambda: tf.GptOssConfig(**common, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                                           sliding_window=WINDOW, layer_types=mixed),  # yarn rope, as released
    }[family]()


FAMILIES = ["llama", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "mistral", "phi3", "gpt_oss"]


def engine_case(family: str, *values, ci: tuple[str, ...] = ("llama",)):
    """An engines-test case of `family`: every CI run checks each export format on the families in `ci`;
    the rest of the family matrix is marked `matrix` (`make test-engines-matrix`, run before a change to a
    format or a family's layout lands), which keeps CI inside its time."""
    return pytest.param(family, *values, marks=() if family in ci else pytest.mark.matrix)


def save_family_target(path, family: str, **config):
    """A random target of `family` (`config` overrides sizes) with the suite's tokenizer, saved to path."""
    from transformers import AutoModelForCausalLM

    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    cfg = family_config(family, len(tokenizer))
    for key, value in config.items():
        setattr(cfg, key, value)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def decodes_the_targets_text(target, drafter, out, *args) -> dict:
    result = run_cli("eval", "--target", str(target), "--drafter", str(drafter), "--limit", "2", "--repeats", "1",
                     "--max_new_tokens", "24", "--dtype", "float32", "--out", str(out), *args)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["identical_outputs"] is True  # greedy fp32: exactly the target's text
    assert results["acceptance"]["rounds"] > 0
    return results


def test_the_prompts_pass_the_sliding_window():
    from draftsmith.eval.prompts import load_prompts

    tokenizer = make_tokenizer()
    for prompt in load_prompts("mtbench", limit=2):
        messages = [{"role": "user", "content": prompt["turns"][0]}]
        assert len(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]) > 4 * WINDOW


SIZES = dict(aux_layer_ids=[1, 2, 3], draft_vocab_size=48)  # the fused layers and draft vocabulary of every family
EAGLE3 = dict(kind="eagle3", **SIZES)
ARMS = {  # every drafter kind as a recipe's model settings (eagle3 also with EAGLE-3.1's norms); None: a standalone LM
    "eagle3": EAGLE3,
    "eagle3.1": dict(EAGLE3, fc_norm=True, norm_output=True),
    "hass": dict(kind="eagle"),
    "peagle": dict(kind="peagle", alignment_steps=3, topk_weight=0.0, ce_weight=1.0, down_sample_ratio=0.7,
                   down_sample_ratio_min=0.2, **SIZES),
    "dflash": {**BLOCK, "kind": "dflash", **SIZES},
    "dspark": {**DSPARK, **SIZES},
    "standalone": None,
}


def arm_kind(arm: str):
    model = ARMS[arm]
    return DRAFTER_KINDS["standalone" if model is None else model["kind"]]


def family_features(family: str, root, **config):
    """A tiny target of `family` under root/target and its features (layers 1-3) of 24 chats; the target's path."""
    from draftsmith.jobs.extract import ExtractConfig, extract

    target = save_family_target(root / "target", family, **config)
    (root / "chats.json").write_text(json.dumps(sample_chats(24)))
    extract(ExtractConfig(target=str(target), data=str(root / "chats.json"), out=str(root / "features"),
                          layer_ids=[1, 2, 3], max_length=256, batch_tokens=512, dtype="float32",
                          feature_dtype="float32", shard_size=16))
    return target


def train_family_drafter(root, here, model: dict | None, *args: str):
    """Two fit steps of a feature drafter (`model`: DrafterModule settings) or a standalone draft LM (None)
    on root's features; its last checkpoint."""
    if model is None:
        args = ("--model", "draftsmith.train.distill.DistillModule", "--model.init_args.num_layers", "2", *args)
    fit = run_cli("fit", "--config", str(recipe(root, here, **(model or {}))), "--trainer.max_steps", "2",
                  "--trainer.val_check_interval", "2", *args, here=True)
    assert fit.returncode == 0, fit.stderr[-3000:]
    return here / "run" / "ckpt" / "last.ckpt"


@pytest.fixture(scope="module")
def family_target(tmp_path_factory):
    """family → (root, target): the family's tiny target and its features under root, made once a module."""
    made = {}

    def get(family: str):
        if family not in made:
            root = tmp_path_factory.mktemp(family)
            made[family] = root, family_features(family, root)
        return made[family]
    return get


def test_the_matrix_trains_every_kind():
    assert {arm_kind(arm).name for arm in ARMS} == set(DRAFTER_KINDS)


def in_ci(family: str, arm: str) -> bool:
    """The cases every CI run trains: every kind on Llama, EAGLE-3 on every family, and each other kind on one
    other family in turn (so every family and every kind meets another); the rest of the matrix is marked
    `matrix` (`make test-matrix`, run before a change to a kind or a family's handling lands)."""
    arms, others = list(ARMS), FAMILIES[1:]
    return family == "llama" or arm == "eagle3" or others[(arms.index(arm) - 1) % len(others)] == family


@pytest.mark.parametrize("family, arm", [pytest.param(f, a, marks=() if in_ci(f, a) else pytest.mark.matrix)
                                         for f in FAMILIES for a in ARMS])
def test_every_family_extracts_trains_exports_and_decodes_its_targets_text(family, arm, family_target, tmp_path):
    root, target = family_target(family)
    kind = arm_kind(arm)
    ckpt = train_family_drafter(root, tmp_path, ARMS[arm])
    for fmt in kind.formats:
        done = run_cli("export", str(ckpt), "--format", fmt, "--out", str(tmp_path / fmt))
        assert done.returncode == 0, (fmt, done.stderr[-3000:])
    decodes_the_targets_text(target, tmp_path / "native", tmp_path / "chain", "--policy", "static", "--k", "3")
    if kind.reads_features:  # trees: the feature drafters (a block drafter's from its one forward)
        decodes_the_targets_text(target, tmp_path / "native", tmp_path / "tree", "--tree", "3,2,6", "--policy", "static")


def test_a_soft_capped_target_is_decoded_with_its_own_logits(tmp_path):
    """Gemma's logits are c·tanh(z / c): the runtime's (and so every verification's) law is the model's own."""
    from draftsmith.runtime.runner import TargetRunner
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(save_family_target(tmp_path / "t", "gemma3_text")).eval()
    assert model.config.final_logit_softcapping == 30.0
    ids = torch.randint(4, 90, (1, 3 * WINDOW), generator=torch.Generator().manual_seed(0))
    runner = TargetRunner(model)
    runner.reset()
    logits, _, _ = runner.forward(ids[0].tolist())
    with torch.no_grad():
        expected = model(ids).logits[0]
    assert (logits - expected).abs().max() < 1e-4 and expected.abs().max() <= 30.0


def run_on_chats(root, tmp_path, prompts: str, **model) -> dict:
    """`draftsmith run` of a two-step EAGLE-3 recipe (`model`'s settings added) on root's target and chats.json;
    the eval's results."""
    import yaml

    path = recipe(root, tmp_path, kind="eagle3", aux_layer_ids=[0, 1, 2], draft_vocab_size=40, **model)
    cfg = yaml.safe_load(path.read_text())
    cfg["data"]["init_args"].update(data=str(root / "chats.json"), max_length=256)
    cfg["trainer"]["max_steps"] = 2
    path.write_text(yaml.safe_dump(cfg))
    done = run_cli("run", str(path), "--prompts", prompts, "--limit", "2", "--max_new_tokens", "8", "--repeats", "1",
                   "--dtype", "float32", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((tmp_path / "run" / "eval" / "results.json").read_text())


def table_text(results: dict) -> str:
    from rich.console import Console

    from draftsmith.eval.report import table

    console = Console(record=True, width=400)
    console.print(table(results))
    return " ".join(console.export_text().split())


@pytest.mark.matrix
def test_a_qwen3_style_target_trains_and_decodes_in_either_mode(tmp_path):
    """A drafter trained in each mode of a Qwen3-style template decodes its target's own text in that mode,
    and its eval names the mode its τ belongs to."""
    from tests.conftest import save_tiny_target

    for name, options in (("thinking", {"enable_thinking": True}), ("quiet", {"enable_thinking": False})):
        root = tmp_path / name / "tiny"
        save_tiny_target(root / "target", template=QWEN3_STYLE)
        (root / "chats.json").write_text(json.dumps(sample_chats(24)))
        results = run_on_chats(root, tmp_path / name, "mtbench", template_kwargs=options)
        assert results["identical_outputs"] is True and results["config"]["template_kwargs"] == options
        assert f"(enable_thinking={json.dumps(options['enable_thinking'])})" in table_text(results)


def test_a_base_model_without_a_chat_template_runs_with_one_given(tmp_path):
    """A base model (Gemma-3-270M's GGUF) has no template: `data stats` says which option gives one, and a
    recipe naming one goes through extract, fit and eval with it (it is part of the target's identity, so
    every stage must render chats alike)."""
    from tests.conftest import save_tiny_target

    root = tmp_path / "tiny"
    target = save_tiny_target(root / "target")
    (target / "chat_template.jinja").unlink()
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    (root / "chats.json").write_text(json.dumps(sample_chats(24)))
    refused = run_cli("data", "stats", "--data", str(root / "chats.json"), "--target", str(target))
    assert refused.returncode != 0 and "--chat_template FILE.jinja" in refused.stderr
    stats = run_cli("data", "stats", "--data", str(root / "chats.json"), "--target", str(target),
                    "--chat_template", "chatml", "--json")
    assert stats.returncode == 0 and json.loads(stats.stdout)["tokenized"]["kept"] == 24

    results = run_on_chats(root, tmp_path, "heldout", chat_template="chatml")
    assert results["identical_outputs"] is True and results["acceptance"]["rounds"] > 0
    # without the template the target is another one: the export is refused, naming the part that differs
    other = run_cli("eval", "--target", str(target), "--drafter", str(tmp_path / "run" / "export-native"),
                    "--limit", "1", "--max_new_tokens", "4", "--out", str(tmp_path / "other"))
    assert other.returncode != 0 and "differing: chat_template" in other.stderr


def test_a_standalone_draft_lm_with_a_huge_vocabulary_is_warned_about(monkeypatch):
    """Gemma's 262k vocabulary made a full standalone fit take 70-90 s a step and 9.5 GB, without a word."""
    from transformers import AutoModelForCausalLM

    from draftsmith.train import distill

    model = AutoModelForCausalLM.from_config(family_config("gemma3_text", 107))
    distill.warn_large_vocabulary(model, None)  # 107 tokens: nothing to say
    monkeypatch.setattr(distill, "LARGE_VOCABULARY_WEIGHTS", 107 * 32)
    with pytest.warns(UserWarning, match="107-token embedding and head in full .*lora_rank 16"):
        distill.warn_large_vocabulary(model, None)
    distill.warn_large_vocabulary(model, 16)  # adapters: the embedding stays frozen


# a Qwen3-style thinking switch: with enable_thinking false every answer (and the generation prompt) opens with
# an empty thought, as Qwen3's own template renders it
QWEN3_STYLE = (
    "{% set quiet = enable_thinking is defined and enable_thinking is false %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['role'] == 'assistant' and quiet %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{{ m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% if quiet %}{{ '<think>\n\n</think>\n\n' }}"
    "{% endif %}{% endif %}"
)


def test_template_options_change_the_tokens_and_every_stage_must_agree(tmp_path):
    """`--template_kwargs` (here a Qwen3-style template's thinking switch) changes what is rendered, passes through
    extract, fit and eval as part of the target's identity, and a stage given other options is refused."""
    from draftsmith.models.target import encode_chat, load_tokenizer
    from draftsmith.models.tokenizer import tokenizer_hash
    from tests.conftest import save_tiny_target

    root = tmp_path / "tiny"
    target = save_tiny_target(root / "target", template=QWEN3_STYLE)
    (root / "chats.json").write_text(json.dumps(sample_chats(24)))
    messages = [{"role": "user", "content": "hi"}]
    thinking, quiet = load_tokenizer(str(target)), load_tokenizer(str(target), template_kwargs={"enable_thinking": False})
    assert thinking.decode(encode_chat(thinking, messages)).endswith("assistant\n")
    assert quiet.decode(encode_chat(quiet, messages)).endswith("assistant\n<think>\n\n</think>\n\n")
    assert tokenizer_hash(thinking) != tokenizer_hash(quiet)
    stats = [json.loads(run_cli("data", "stats", "--data", str(root / "chats.json"), "--target", str(target), "--json",
                                *extra).stdout)["tokenized"] for extra in ((), ("--template_kwargs", '{"enable_thinking": false}'))]
    assert stats[0]["kept"] == stats[1]["kept"] == 24 and stats[0] != stats[1]  # the think blocks are tokens

    results = run_on_chats(root, tmp_path, "mtbench", template_kwargs={"enable_thinking": False})
    assert results["identical_outputs"] is True and results["config"]["template_kwargs"] == {"enable_thinking": False}
    assert "(enable_thinking=false)" in table_text(results)  # the mode its τ was measured in
    manifest = json.loads((root / "features" / "manifest.json").read_text())
    assert manifest["target"]["tokenizer_hash"] == tokenizer_hash(quiet)
    # the thinking mode is another target: its eval is refused, naming the options
    other = run_cli("eval", "--target", str(target), "--drafter", str(tmp_path / "run" / "export-native"),
                    "--limit", "1", "--max_new_tokens", "4", "--out", str(tmp_path / "other"))
    assert other.returncode != 0 and "--template_kwargs" in other.stderr
    bad = run_cli("eval", "--target", str(target), "--template_kwargs", '{"not a name": 1}', "--out", str(tmp_path / "x"))
    assert bad.returncode == 2 and "are not names a chat template can read" in bad.stderr
