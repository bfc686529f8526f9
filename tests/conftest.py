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

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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


def run_cli(*args: str, env: dict | None = None, timeout: int = 300, cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run `draftsmith ARGS` as a user would, in a fresh interpreter (in `cwd`, default this one's)."""
    return subprocess.run([sys.executable, "-m", "draftsmith.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, cwd=cwd)


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
