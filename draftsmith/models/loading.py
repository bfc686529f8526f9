"""Native drafter exports → modules and runtime proposers: what `eval` and the runtime load.

A native export (`draftsmith export --format native`) is either a feature drafter directory
(config.json with `format: draftsmith-drafter/1`, model.safetensors holding the trained weights
but not the target's frozen embedding/head) or a standalone draft LM (an ordinary transformers
model directory plus draftsmith.json, and optionally the training data's token counts).

Nothing here imports training code: a served or evaluated drafter needs only the models.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from draftsmith import DraftsmithError

NATIVE_FORMAT = "draftsmith-drafter/1"
STANDALONE_FILE = "draftsmith.json"  # marks a standalone draft LM export
TOKEN_COUNTS = "token_counts.safetensors"  # a standalone export's assistant-token counts (V,) int64


def read_export(directory: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, model.safetensors tensors) of an export directory."""
    from safetensors.torch import load_file

    config = json.loads((directory / "config.json").read_text())
    return config, load_file(str(directory / "model.safetensors"))


def load_native(directory: str | Path, target: Any) -> Any:
    """A feature drafter from a native export, its frozen parts taken from `target` (a models.target.Target)."""
    directory = Path(directory)
    config, tensors = read_export(directory)
    if config.get("format") != NATIVE_FORMAT:
        raise DraftsmithError(f"{directory} is not a native draftsmith export (format {config.get('format')!r})")
    diffs = target.identity.differences(config["target"])
    if diffs:
        raise DraftsmithError(f"drafter in {directory} was trained for another target: {'; '.join(diffs)}; "
                              "re-export the drafter for this target")
    return drafter_from_tensors(config["kind"], tensors, target, config.get("aux_layer_ids", []))


def drafter_from_tensors(kind: str, tensors: dict[str, torch.Tensor], target: Any, aux_layer_ids: list[int]) -> Any:
    """Build a drafter around `target` and load drafter-named tensors (native names)."""
    embed, head = target.embed_tokens.weight.detach().float(), target.lm_head.weight.detach().float()
    if kind == "eagle":
        from draftsmith.models.eagle import EagleDrafter

        drafter = EagleDrafter(target.config, embed, head)
    else:
        from draftsmith.models.eagle3 import Eagle3Drafter

        d2t = tensors["d2t"]
        drafter = Eagle3Drafter(target.config, embed, head, None, torch.arange(len(d2t)) + d2t, len(aux_layer_ids),
                                target.hidden_size)
    missing, unexpected = drafter.load_state_dict(tensors, strict=False)
    frozen = {"embed_tokens.weight", "lm_head.weight"} if kind == "eagle" else {"embed_tokens.weight"}
    if set(missing) - frozen or unexpected:
        raise DraftsmithError(f"drafter weights do not fit: missing {sorted(set(missing) - frozen)}, unexpected {unexpected}")
    return drafter.eval()


def load_proposer(drafter: str | None, target: Any, head_vocab: int = 0) -> tuple[Any, str]:
    """(proposer, description) for a native export directory, or plain decoding for None.

    head_vocab > 0: a standalone drafter exported with its training data's token counts drafts
    among its `head_vocab` most frequent tokens (its head runs over those rows only).
    """
    from draftsmith.runtime.proposers import FeatureProposer, ModelProposer, NoProposer

    if drafter in (None, "none"):
        return NoProposer(target.vocab_size), "autoregressive"
    path = Path(drafter)
    if (path / STANDALONE_FILE).is_file():
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=target.dtype).to(target.device)
        head_ids = standalone_head_ids(path, target, head_vocab)
        what = f"standalone ({path.name}" + (f", {len(head_ids)}-token head)" if head_ids is not None else ")")
        return ModelProposer(model, target.vocab_size, head_ids), what
    if not (path / "config.json").is_file():
        raise DraftsmithError(f"{path}: not a drafter export; run `draftsmith export CKPT --format native --out DIR`")
    config = json.loads((path / "config.json").read_text())
    drafter_module = load_native(path, target).to(device=target.device, dtype=target.dtype)  # int buffers stay int
    return FeatureProposer(drafter_module, target.vocab_size, config.get("aux_layer_ids", [])), f"{config['kind']} ({path.name})"


def standalone_head_ids(path: Path, target: Any, head_vocab: int) -> torch.Tensor | None:
    """The `head_vocab` most frequent assistant tokens of a standalone export's training data (EOS
    and PAD always in), or None for the full head: head_vocab 0 or ≥ V, or an export without counts."""
    from draftsmith.models.eagle3 import draft_vocab

    if not head_vocab or head_vocab >= target.vocab_size or not (path / TOKEN_COUNTS).is_file():
        return None
    from safetensors.torch import load_file

    counts = load_file(str(path / TOKEN_COUNTS))["token_counts"]
    if len(counts) != target.vocab_size:
        raise DraftsmithError(f"{path / TOKEN_COUNTS}: {len(counts)} token counts for a target vocabulary of "
                              f"{target.vocab_size}; re-export the drafter trained for this target")
    tok = target.tokenizer
    specials = [i for i in (tok.eos_token_id, tok.pad_token_id) if i is not None]
    return draft_vocab(counts, head_vocab, always=specials)
