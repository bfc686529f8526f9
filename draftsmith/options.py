"""Option groups shared by commands: each command's config dataclass inherits the groups it takes,
so an option is declared and documented once (`--help` reads these docstrings too).

Imports nothing of draftsmith's but its error: every layer may compose these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from draftsmith import DraftsmithError

ENGINES = ("transformers", "vllm")  # the engines that run the target in this process (`--engine`)


@dataclass(kw_only=True)
class DeviceOptions:
    """Where the models run, and in which type.

    Args:
        dtype: compute dtype: bfloat16, float32, or auto (the faster of the two on this device for this
            command's kind of work, measured and printed; a resumed run keeps the type it started with; eval
            runs both arms in it and records which ran).
        device: cpu, cuda, cuda:1, ...
    """

    dtype: str = "auto"
    device: str = "cpu"


@dataclass(kw_only=True)
class TargetOptions(DeviceOptions):
    """The target model (and, the device options, where it runs).

    Args:
        target: embedded:smollm2-135m-instruct, a .gguf file, a model directory, or a hub id.
        trust_remote_code: allow a hub model's own code to run.
        chat_template: the chat template to render chats with, in place of the tokenizer's own (a base
            model has none): a .jinja file, or a template draftsmith ships: chatml, gemma, llama3. Every
            stage of one drafter must use the same (it is part of the target's identity).
        template_kwargs: variables the chat template reads, as JSON: {"enable_thinking": false} for a
            Qwen3-style thinking switch, {"tools": [...]} for tool schemas a template renders. Part of the
            target's identity like the template: every stage of one drafter must give the same.
    """

    target: str
    trust_remote_code: bool = False
    chat_template: str | None = None
    template_kwargs: dict[str, Any] | None = None


@dataclass(kw_only=True)
class DraftOptions:
    """How a drafter drafts, wherever it decodes (eval, tune, labels: they must agree).

    Args:
        head_vocab: a standalone drafter drafts among its training data's most frequent tokens, its head
            computed over those rows only (exports carry the counts); 0 = the full head.
    """

    head_vocab: int = 8192


@dataclass(kw_only=True)
class ChatOptions:
    """A chat source and how much of it to use.

    Args:
        data: chats: `sharegpt` (embedded), a .json/.jsonl file, a `datasets` directory, .parquet/.csv, or
            hf:NAME[:SPLIT].
        limit: use only the first LIMIT kept conversations.
        max_length: tokens per chat; longer chats are truncated (and counted).
    """

    data: str
    limit: int | None = None
    max_length: int = 2048


@dataclass(kw_only=True)
class SamplingOptions:
    """How the target's tokens are drawn, and how many.

    Args:
        max_new_tokens: tokens generated per prompt (an answer longer than this is cut).
        temperature: 0 for greedy decoding; > 0 samples, with top_k / top_p.
        top_k: top-k filtering when sampling (the target and a drafter alike).
        top_p: nucleus filtering when sampling (the target and a drafter alike).
        seed: sampling seed.
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0


@dataclass(kw_only=True)
class EngineOptions:
    """Which engine runs the target in this process.

    Args:
        engine: transformers (the target loaded here) or vllm (vLLM's offline engine, fed the token ids
            draftsmith renders; `make engines` installs its CPU build).
        engine_args: vLLM engine arguments added to draftsmith's, as JSON (--engine vllm): placement and speed,
            e.g. {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.8} or {"enforce_eager": true}.
    """

    engine: str = "transformers"
    engine_args: dict[str, Any] | None = None

    def check_engine(self) -> None:
        if self.engine not in ENGINES:
            raise DraftsmithError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.engine_args and self.engine != "vllm":
            raise DraftsmithError("--engine_args are vLLM's engine arguments: give them with --engine vllm")
