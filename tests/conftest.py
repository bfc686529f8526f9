"""Tiny models and tokenizers: every test runs on CPU in seconds, no download.

The tokenizer is character-level (printable ASCII, newline, and the specials each
template needs), so a tiny random Llama with vocab ~110 can be its target.
"""

from __future__ import annotations

import json
import os
import string
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The commands tests start in fresh interpreters too: two threads each beside the other worker's would put
# three or four busy threads on two cores, and an OpenMP thread that spins while it waits slows them all.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Tiny models gain nothing from a second intra-op thread, and `make test` runs one pytest worker per core
# (pytest-xdist): one thread each keeps the workers from contending for the cores.
torch.set_num_threads(1)

CHATML = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ '<|begin_of_text|>' }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
LLAMA2 = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ '<s>[INST] ' + m['content'] + ' [/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] + ' </s>' }}{% endif %}{% endfor %}"
)
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "llama2": LLAMA2}
SPECIALS = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>", "<s>", "</s>"]


def make_tokenizer(template: str = CHATML):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters join back without spaces
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = template
    return fast


def make_llama(vocab_size: int, seed: int = 0, hidden: int = 32, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab_size,
                      max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=2, eos_token_id=3,
                      pad_token_id=1)
    return LlamaForCausalLM(cfg).eval()


def tiny_drafter_inputs(vocab_size: int = 50, hidden: int = 32):
    """(config, weight): a two-layer Llama config and a (vocab, hidden) table, what a drafter's `from_target`
    reads for its embedding and head, with no target model built."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=vocab_size, num_hidden_layers=2)
    return config, torch.randn(vocab_size, hidden)


def save_tiny_target(path: Path, template: str = CHATML, seed: int = 0, hidden: int = 32) -> Path:
    tokenizer = make_tokenizer(template)
    model = make_llama(len(tokenizer), seed=seed, hidden=hidden)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    return save_tiny_target(tmp_path_factory.mktemp("tiny-target"))


def sample_chats(n: int, seed: int = 0) -> list[dict]:
    """ShareGPT-style records of varied length (some multi-turn)."""
    import random

    rng = random.Random(seed)
    words = "the cat sat on a mat while dogs ran far away quickly and quietly".split()
    records = []
    for i in range(n):
        turns = []
        for t in range(rng.randint(1, 3)):
            turns.append({"from": "human", "value": " ".join(rng.choices(words, k=rng.randint(2, 12)))})
            turns.append({"from": "gpt", "value": " ".join(rng.choices(words, k=rng.randint(3, 20)))})
        records.append({"id": f"chat-{i}", "conversations": turns})
    return records


@pytest.fixture
def chats_file(tmp_path) -> Path:
    path = tmp_path / "chats.json"
    path.write_text(json.dumps(sample_chats(40)))
    return path


# Commands a test may run inside its own process: they start no processes of their own and leave no
# global state behind (`fit`, `run` and `extract` train or spawn ranks, and run in a fresh interpreter).
IN_PROCESS = ("eval", "tune", "export", "labels", "data", "regenerate")


def run_cli(*args: str, env: dict | None = None, timeout: int = 300, cwd: str | None = None,
            here: bool = False) -> subprocess.CompletedProcess:
    """Run `draftsmith ARGS` as a user would: `draftsmith.cli.main` with its output and exit status captured,
    in this process for the commands that allow it (and for `here`: a fit that stops before training or
    trains a step or two), else in a fresh interpreter (in `cwd`, default this one's)."""
    if here or (args and args[0] in IN_PROCESS and env is None and cwd is None):
        import contextlib

        with contextlib.chdir(cwd or "."):
            return _run_here(list(args))
    return subprocess.run([sys.executable, "-m", "draftsmith.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, cwd=cwd)


def _run_here(args: list[str]) -> subprocess.CompletedProcess:
    import contextlib
    import io

    from draftsmith.cli import main

    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(args)
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    return subprocess.CompletedProcess(["draftsmith", *args], code, out.getvalue(), err.getvalue())


def killed_after_writes(n: int) -> str:
    """A script running `draftsmith ARGS` that SIGKILLs itself once its n-th safetensors file is on disk
    under its temporary name, not yet renamed: a crash at the worst moment of a resumable writer."""
    import textwrap

    return textwrap.dedent(f"""
        import os, signal, sys
        import safetensors.torch as st
        real, calls = st.save_file, []
        def save_then_die(tensors, path, metadata=None):
            real(tensors, path, metadata=metadata)
            calls.append(path)
            if len(calls) == {n}:
                os.kill(os.getpid(), signal.SIGKILL)
        st.save_file = save_then_die
        from draftsmith.cli import main
        main(sys.argv[1:])
    """)


@pytest.fixture(scope="session")
def tiny_features(tmp_path_factory):
    """A tiny target, 48 chats and their features (layers 0-2): built once for the whole suite."""
    from draftsmith.jobs.extract import ExtractConfig, extract

    root = tmp_path_factory.mktemp("fit")
    target = save_tiny_target(root / "target")
    (root / "chats.json").write_text(json.dumps(sample_chats(48)))
    extract(ExtractConfig(target=str(target), data=str(root / "chats.json"), out=str(root / "features"),
                          layer_ids=[0, 1, 2], max_length=256, batch_tokens=512, dtype="float32",
                          feature_dtype="float32", shard_size=16))
    return root


def recipe(root, tmp_path, callbacks=None, module="draftsmith.train.drafter.DrafterModule", **model):
    """A fit recipe on root's features: a HASS drafter (two alignment steps, the Top-K loss), or `model`'s settings
    for `module`, a few steps at a high learning rate."""
    eagle = {"kind": "eagle", "alignment_steps": 2, "topk_weight": 1.0} if module.endswith(".DrafterModule") else {}
    cfg = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 6, "val_check_interval": 3,
                    "check_val_every_n_epoch": None, "enable_progress_bar": False, "log_every_n_steps": 1,
                    "default_root_dir": str(tmp_path / "run"),
                    "logger": {"class_path": "pytorch_lightning.loggers.CSVLogger",
                               "init_args": {"save_dir": str(tmp_path / "run"), "name": "logs", "version": 0}},
                    "callbacks": callbacks or [{"class_path": "pytorch_lightning.callbacks.ModelCheckpoint",
                                                "init_args": {"dirpath": str(tmp_path / "run" / "ckpt"),
                                                              "save_last": True, "every_n_train_steps": 1,
                                                              "save_top_k": -1}}]},
        "model": {"class_path": module,
                  "init_args": {"target": str(root / "target"), **eagle, "lr": 0.003, "warmup_steps": 2, **model}},
        "data": {"class_path": "draftsmith.data.modules.FeatureDataModule",
                 "init_args": {"features_dir": str(root / "features"), "max_tokens": 300, "val_fraction": 0.2}},
    }
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def train(root, tmp_path, steps: int = 2, **model):
    result = run_cli("fit", "--config", str(recipe(root, tmp_path, **model)), "--trainer.max_steps", str(steps),
                     "--trainer.val_check_interval", str(steps))
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp_path / "run" / "ckpt" / "last.ckpt"


@pytest.fixture(scope="session")
def eagle3_ckpt(tiny_features, tmp_path_factory):
    return train(tiny_features, tmp_path_factory.mktemp("e3"), kind="eagle3", draft_vocab_size=40, aux_layer_ids=[0, 1, 2])


BLOCK = {"module": "draftsmith.train.block.BlockDrafterModule", "draft_vocab_size": 40, "aux_layer_ids": [0, 1, 2],
         "ce_weight": 1.0, "block_size": 4, "anchors": 16}
DSPARK = {**BLOCK, "kind": "dspark", "markov_rank": 8, "confidence_head": True}


def train_block(root, tmp_path, kind: str = "dflash", steps: int = 2, **model):
    """A DFlash (or DSpark, with its Markov bias and confidence head) drafter of the tiny target."""
    return train(root, tmp_path, steps, **{**(DSPARK if kind == "dspark" else {**BLOCK, "kind": kind}), **model})


@pytest.fixture(scope="session")
def peagle_ckpt(tiny_features, tmp_path_factory):
    """A P-EAGLE drafter of the tiny target: 3 alignment steps, the last two on its parallel mask inputs,
    trained at a COD sample of the anchors (as the recipes train)."""
    return train(tiny_features, tmp_path_factory.mktemp("peagle"), kind="peagle", draft_vocab_size=40,
                 aux_layer_ids=[0, 1, 2], alignment_steps=3, topk_weight=0.0, ce_weight=1.0,
                 down_sample_ratio=0.7, down_sample_ratio_min=0.2)


@pytest.fixture(scope="session")
def dflash_ckpt(tiny_features, tmp_path_factory):
    return train_block(tiny_features, tmp_path_factory.mktemp("dflash"))


@pytest.fixture(scope="session")
def dspark_ckpt(tiny_features, tmp_path_factory):
    return train_block(tiny_features, tmp_path_factory.mktemp("dspark"), "dspark")


@pytest.fixture(scope="session")
def eagle_ckpt(tiny_features, tmp_path_factory):
    return train(tiny_features, tmp_path_factory.mktemp("e1"))


def forget_choices(monkeypatch):
    """As in a fresh process started without an inherited choice: nothing measured, nothing in the environment."""
    from draftsmith.models import precision
    from draftsmith.models.precision import env_name

    precision._choose.cache_clear()
    for device in ("cpu", "cuda"):
        for work in ("bulk", "decode"):
            monkeypatch.delenv(env_name(device, work), raising=False)


@pytest.fixture
def fresh(monkeypatch):
    """No earlier choice in this process or its environment; `set_speed(x)` fakes bf16's measured speed."""
    from draftsmith.models import precision

    forget_choices(monkeypatch)
    calls = []

    def set_speed(speed):
        """bf16's speed for every kind of work, or a dict by kind."""
        def fake(work):
            calls.append(work)
            return speed[work] if isinstance(speed, dict) else speed
        monkeypatch.setattr(precision, "bf16_speed", fake)

    yield set_speed, calls
    forget_choices(monkeypatch)


def assert_same_step(a: tuple, b: tuple) -> None:
    """Two runs of a step, each (losses, gradients, metrics) as dicts of tensors, agree key by key."""
    import torch

    for x, y, tol in zip(a, b, ((1e-5, 1e-6), (1e-4, 1e-6), (1.3e-6, 1e-5))):
        assert x.keys() == y.keys() and x
        for key in x:
            torch.testing.assert_close(y[key], x[key], rtol=tol[0], atol=tol[1])


def step_and_validate(module, batch) -> tuple[dict, dict]:
    """One training forward and backward of a drafter module on `batch`, then a validation forward (its
    metrics left in the module): the training outputs and the drafter's gradients."""
    import torch

    module.train()
    out = module.alignment_forward(batch, with_metrics=False)
    out["loss"].backward()
    grads = {k: p.grad.clone() for k, p in module.drafter.named_parameters() if p.grad is not None}
    module.eval()
    with torch.no_grad():
        module.alignment_forward(batch, with_metrics=True)
    return out, grads
