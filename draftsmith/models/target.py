"""The frozen target model: loading it from anywhere and reading its hidden states.

Layer-id convention (docs/formats.md): id i is `output_hidden_states[i]` of the HF model, the
residual stream after i decoder layers; 0 is the embeddings. HF returns the post-norm
state at id N (= num_layers), which is also `final`, the EAGLE-1/2/HASS feature.

Notation: B batch, T sequence, H hidden, V vocab.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from draftsmith import DraftsmithError
from draftsmith.models.sources import EMBEDDED_TARGETS, default_chat_template, resolve_source
from draftsmith.models.tokenizer import tokenizer_identity, with_chat_template
from draftsmith.models.common import quiet_peft

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


class capture_hidden_states:
    """Record `output_hidden_states[i]` for the asked ids with forward hooks, without making the
    model return all N+1 hidden states (that costs ~16% of a small target's forward on a CPU).

    id 0 is the embedding output, id i in 1..N-1 the output of decoder layer i-1. Id N (whose
    normalization differs between families) falls back to `output_hidden_states=True`.
    """

    def __init__(self, decoder: torch.nn.Module, layer_ids: list[int] | tuple[int, ...]):
        self.decoder, self.layer_ids = decoder, list(layer_ids)
        layers = getattr(decoder, "layers", None)
        self.fallback = bool(self.layer_ids) and (layers is None or any(i >= len(layers) for i in self.layer_ids))
        self.values: dict[int, torch.Tensor] = {}
        self.handles: list[Any] = []

    def __enter__(self) -> "capture_hidden_states":
        if self.fallback:
            return self
        for i in self.layer_ids:
            module = self.decoder.embed_tokens if i == 0 else self.decoder.layers[i - 1]

            def hook(_module, _args, output, i=i):
                self.values[i] = output[0] if isinstance(output, tuple) else output

            self.handles.append(module.register_forward_hook(hook))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()

    def collect(self, out: Any) -> dict[int, torch.Tensor]:
        if self.fallback:
            return {i: out.hidden_states[i] for i in self.layer_ids}
        return {i: self.values[i] for i in self.layer_ids}


@dataclass(frozen=True)
class TargetIdentity:
    """What shards and checkpoints record; two targets match when all but `name` (and `adapter`, the path
    an adapter was loaded from) match. `tokenizer_parts` is not compared: it says which part of the
    tokenizer a differing `tokenizer_hash` comes from."""

    name: str
    architecture: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    tokenizer_hash: str
    weights_fingerprint: str
    adapter: str | None = None
    tokenizer_parts: dict[str, str] | None = field(default=None, hash=False)  # explains a tokenizer_hash mismatch

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def differences(self, other: dict[str, Any]) -> list[str]:
        """Human-readable differences from another identity dict (`name` is informational)."""
        return identity_differences(other, self.as_dict())


def identity_differences(theirs: dict[str, Any], mine: dict[str, Any], there: str = "there", here: str = "here",
                         ignore: tuple[str, ...] = ("name", "adapter")) -> list[str]:
    """Human-readable differences between two identity dicts, `mine` the target in hand. A tokenizer
    mismatch names the parts that differ where both sides recorded them (identities written before
    `tokenizer_parts` existed have none)."""
    diffs = []
    a, b = theirs.get("tokenizer_parts"), mine.get("tokenizer_parts")
    for key, value in mine.items():
        if key in ignore or key == "tokenizer_parts" or theirs.get(key) == value:
            continue
        line = f"{key}: {theirs.get(key)!r} {there}, {value!r} {here}"
        if key == "tokenizer_hash" and a and b:
            parts = [part for part in b if a.get(part) != b[part]]
            line += f" (differing: {', '.join(parts)})" if parts else " (its recorded parts are equal)"
            if "chat_template" in parts:
                line += ": every stage must render chats with the same template (--chat_template, --template_kwargs)"
        diffs.append(line)
    return diffs


class Target:
    """A frozen causal LM with its tokenizer: eval mode, no grad, never in an optimizer."""

    def __init__(self, model: Any, tokenizer: Any, name: str, adapter: str | None = None):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.config = model.config
        self.decoder = model.get_decoder()  # the base model (LlamaModel, Qwen2Model, ...)
        self.num_layers = int(self.config.num_hidden_layers)
        self.hidden_size = int(self.config.hidden_size)
        self.vocab_size = int(self.config.vocab_size)
        tokenizer_hash, tokenizer_parts = tokenizer_identity(tokenizer)
        self.identity = TargetIdentity(
            name=name,
            architecture=(self.config.architectures or [type(model).__name__])[0],
            hidden_size=self.hidden_size,
            vocab_size=self.vocab_size,
            num_layers=self.num_layers,
            tokenizer_hash=tokenizer_hash,
            weights_fingerprint=weights_fingerprint(model),
            adapter=adapter,
            tokenizer_parts=tokenizer_parts,
        )

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    @property
    def dtype_name(self) -> str:
        """The compute type as `--dtype` names it ("bfloat16", "float32", ...): what a run records."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def embed_tokens(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()

    def final_norm_scale(self) -> torch.Tensor | None:
        """The per-channel scale of the target's final norm as an RMSNorm multiplies it (H,) (`norm_scale`);
        None when the decoder has no final `norm`."""
        norm = getattr(self.decoder, "norm", None)
        return None if norm is None else self.norm_scale(norm)

    def norm_scale(self, norm: torch.nn.Module) -> torch.Tensor:
        """The per-channel scale one of the target's RMSNorms multiplies by (H,): its weight for Llama-like
        norms, 1 + weight for Gemma's; read by running the norm on a constant vector (whose RMS
        normalization is exactly 1), so any family's convention comes out right."""
        with torch.no_grad():
            return norm(torch.full((1, self.hidden_size), 1e3, dtype=self.dtype, device=self.device))[0].detach()

    def decoder_layer(self, index: int, where: str) -> torch.nn.Module:
        """Decoder layer `index` (0-based; negative counts from the last), or a clear error naming `where`."""
        layers = getattr(self.decoder, "layers", None)
        if layers is None or not -len(layers) <= index < len(layers):
            raise DraftsmithError(f"{where}: {self.identity.name} has no decoder layer {index} "
                                  f"(it has {self.num_layers}: use 0..{self.num_layers - 1}, or -1 for the last)")
        return layers[index]

    def decoder_layers(self, last: int, count: int, where: str) -> list[torch.nn.Module]:
        """The `count` consecutive decoder layers that end at layer `last` (as `decoder_layer` reads it)."""
        self.decoder_layer(last, where)
        end = last % self.num_layers + 1
        if end < count:
            raise DraftsmithError(f"{where}: {count} draft layers start from the {count} target layers that end at "
                                  f"layer {last}, and {self.identity.name} has only {end} up to it: pick a later layer")
        return list(self.decoder.layers[end - count:end])

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends an answer: the tokenizer's EOS and the model config's (one id or a list)."""
        return eos_ids(self.tokenizer, self.config)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation in the chat template, ready for the assistant's next answer."""
        return encode_chat(self.tokenizer, messages)

    def default_aux_layer_ids(self) -> list[int]:
        """EAGLE-3's default fused layers: [2, N//2, N-3] (SmolLM2-135M: [2, 15, 27])."""
        n = self.num_layers
        return [2, n // 2, n - 3]

    def check_layer_ids(self, layer_ids: list[int], where: str) -> list[int]:
        """`layer_ids` as ints, refused (naming `where`, the option that holds them) when out of range."""
        bad = [i for i in layer_ids if not 0 <= int(i) <= self.num_layers]
        if bad:
            raise DraftsmithError(
                f"{where}: layer ids {bad} are out of range for {self.identity.name} ({self.num_layers} layers): "
                f"use 0..{self.num_layers} (id i = output_hidden_states[i], 0 = embeddings; EAGLE-3's default "
                f"is {self.default_aux_layer_ids()})"
            )
        return [int(i) for i in layer_ids]

    @torch.no_grad()
    def features(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, layer_ids: list[int] = ()
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Post-norm last hidden state (B, T, H) and the requested `output_hidden_states[i]`."""
        with capture_hidden_states(self.decoder, layer_ids) as captured:
            out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                               output_hidden_states=captured.fallback)
        return out.last_hidden_state, captured.collect(out)


def encode_chat(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a conversation in the tokenizer's chat template, ready for the assistant's next answer (or
    as it stands, without `add_generation_prompt`)."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                              return_dict=True)["input_ids"])


def eos_ids(tokenizer: Any, config: Any) -> tuple[int, ...]:
    """Every id that ends an answer: the tokenizer's EOS and the model config's (one id or a list)."""
    config_eos = getattr(config, "eos_token_id", None)
    ids = {tokenizer.eos_token_id, *(config_eos if isinstance(config_eos, list) else [config_eos])}
    return tuple(sorted(i for i in ids if i is not None))


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A cheap, dtype-independent hash of a strided sample of every parameter."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        flat = p.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 64)][:64].to("cpu", torch.bfloat16).float()
        h.update(name.encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


def load_tokenizer(name: str, trust_remote_code: bool = False, chat_template: str | None = None,
                   template_kwargs: dict[str, Any] | None = None) -> Any:
    """Only the target's tokenizer (chat template included: `chat_template` replaces its own, `template_kwargs`
    set in it), without its weights where possible."""
    from transformers import AutoTokenizer

    source = resolve_source(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise DraftsmithError(f"could not load the tokenizer of target {name!r}: {e}") from None
    return with_chat_template(tokenizer, default_chat_template(name, chat_template), template_kwargs)


def load_target(
    name: str,
    dtype: str = "float32",
    device: str = "cpu",
    device_map: str | dict | None = None,
    adapter: str | None = None,
    trust_remote_code: bool = False,
    chat_template: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> Target:
    """Load a target from an embedded alias, a .gguf file, a local HF directory or a hub id.

    `adapter` is a peft LoRA directory merged into the weights on load. `device_map`
    ("auto", "balanced", or a dict) places a large target across devices with accelerate,
    in which case `device` is ignored. `chat_template` (a .jinja file or the name of a template
    draftsmith ships) replaces the tokenizer's own; `template_kwargs` are set in it (`with_chat_template`).
    `dtype` "auto" is the type that decodes fastest on `device`
    (`draftsmith.models.precision`; batched work resolves its own first); `Target.dtype` says which.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith.models.precision import resolve_dtype

    dtype = resolve_dtype(dtype, device, "decode")
    if dtype not in DTYPES:
        raise DraftsmithError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)} or auto")
    torch_dtype = DTYPES[dtype]
    source = resolve_source(name)
    kwargs = dict(dtype=torch_dtype, trust_remote_code=trust_remote_code)
    if device_map is not None:
        kwargs["device_map"] = device_map
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as e:
        raise DraftsmithError(
            f"could not load target {name!r}: {e}\n(expected an embedded alias such as "
            f"{next(iter(EMBEDDED_TARGETS))}, a .gguf file, a local model directory, or a hub id "
            "that is cached or reachable)"
        ) from None
    if adapter is not None:
        model = _merge_adapter(model, adapter)
    if device_map is None:
        model = model.to(device)
    return Target(model, with_chat_template(tokenizer, default_chat_template(name, chat_template), template_kwargs), name=name,
                  adapter=adapter)


def _merge_adapter(model: Any, adapter: str) -> Any:
    from peft import PeftModel

    if not (Path(adapter) / "adapter_config.json").is_file():
        raise DraftsmithError(f"LoRA adapter {adapter!r}: no adapter_config.json there")
    with quiet_peft():
        return PeftModel.from_pretrained(model, adapter).merge_and_unload()
