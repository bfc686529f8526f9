"""Native exports → the runtime's proposers and stop heads: what `eval`, `tune` and `labels` decode with."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from draftsmith import DraftsmithError
from draftsmith.models.registry import STANDALONE, drafter_kind
from draftsmith.runtime.policies import PolicyKind
from draftsmith.models.loading import STANDALONE_FILE, STOP_HEADS, STOP_HEADS_FILE, TOKEN_COUNTS, load_native, native_config_path
from draftsmith.runtime.proposers import FeatureProposer, NoProposer
from draftsmith.runtime.standalone import ModelProposer


def load_proposer(drafter: str | None, target: Any, head_vocab: int = 0) -> tuple[Any, str]:
    """(proposer, description) for a native export directory, or plain decoding for None.

    head_vocab > 0: a standalone drafter exported with its training data's token counts drafts
    among its `head_vocab` most frequent tokens (its head runs over those rows only).
    """
    if drafter in (None, "none"):
        return NoProposer(target.vocab_size), "autoregressive"
    path = Path(drafter)
    if (path / STANDALONE_FILE).is_file():
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=target.dtype).to(target.device)
        head_ids = standalone_head_ids(path, target, head_vocab)
        what = f"standalone ({path.name}" + (f", {len(head_ids)}-token head)" if head_ids is not None else ")")
        return ModelProposer(model, target.vocab_size, head_ids), what
    if not path.is_dir():
        raise DraftsmithError(f"--drafter {path}: no such directory; give a native export "
                              "(`draftsmith export CKPT --format native --out DIR`)")
    if not (path / "config.json").is_file():
        raise DraftsmithError(f"{path}: not a drafter export; run `draftsmith export CKPT --format native --out DIR`")
    config = json.loads((path / "config.json").read_text())
    drafter_module = load_native(path, target).to(device=target.device, dtype=target.dtype)  # int buffers stay int
    kind = drafter_kind(config["kind"])
    block = f", block {drafter_module.block_size}" if kind.blocks else ""
    return feature_proposer(kind, drafter_module, target.vocab_size, config.get("aux_layer_ids", [])), \
        f"{kind.name} ({path.name}{block})"


def export_kind(drafter: str | None) -> str | None:
    """The drafter kind of an export directory (`models/registry.py`'s name; standalone for a draft LM), None
    for plain decoding."""
    if drafter in (None, "none"):
        return None
    path = Path(drafter)
    if (path / STANDALONE_FILE).is_file():
        return STANDALONE.name
    return json.loads((path / "config.json").read_text())["kind"]


def feature_proposer(kind: Any, drafter: Any, vocab_size: int, aux_layer_ids: list[int]) -> Any:
    """The proposer that decodes a feature drafter of `kind` (a registry entry): a block drafter's
    `BlockProposer`, else a `FeatureProposer`."""
    if kind.blocks:
        from draftsmith.runtime.block import BlockProposer

        return BlockProposer(drafter, vocab_size, aux_layer_ids)
    return FeatureProposer(drafter, vocab_size, aux_layer_ids)


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
                              f"{target.vocab_size}: this drafter was trained for another target; train one for this target")
    tok = target.tokenizer
    specials = [i for i in (tok.eos_token_id, tok.pad_token_id) if i is not None]
    return draft_vocab(counts, head_vocab, always=specials)


def drafter_identity(proposer: Any, head_vocab: int) -> dict[str, Any]:
    """What a stop head is tied to: the drafter's weights (a fingerprint), its module class and the
    vocabulary it drafts from (a standalone drafter's ranked head changes its distributions)."""
    from draftsmith.models.target import weights_fingerprint

    module = getattr(proposer, "drafter", None) or proposer.model
    return {"class": type(module).__name__, "weights_fingerprint": weights_fingerprint(module),
            "draftable": None if proposer.draftable is None else len(proposer.draftable),
            "head_vocab": head_vocab if getattr(proposer, "head_ids", None) is not None else 0}


def stop_head_mismatch(section: dict[str, Any], target: Any, proposer: Any) -> list[str]:
    """Why a stored stop head does not belong to this target and drafter (empty: it does)."""
    diffs = [f"target {d}" for d in target.identity.differences(section["target"])]
    mine = drafter_identity(proposer, section["drafter"]["head_vocab"])
    diffs += [f"drafter {k}: {section['drafter'].get(k)!r} there, {v!r} here" for k, v in mine.items()
              if section["drafter"].get(k) != v]
    return diffs


def load_stop_head(directory: str | Path, policy: PolicyKind, target: Any, proposer: Any) -> tuple[Any, dict[str, Any]]:
    """(head module or None, its section of the export) for a draft-length policy (a `PolicyKind`): the stop
    head it decodes with (refused when trained for another drafter or target), the drafter's own confidence
    head (checked present), or no head; the section holds what `draftsmith tune` filed for it."""
    from safetensors.torch import load_file

    kind = policy.name
    section = json.loads(native_config_path(directory).read_text()).get(STOP_HEADS, {}).get(kind)
    if policy.head is None:
        return None, section or {}
    if policy.head == "drafter":  # the drafter's own head: only its tuned settings are filed
        if getattr(getattr(proposer, "drafter", None), "confidence_head", None) is None:
            raise DraftsmithError(f"--policy {kind} reads a DSpark drafter's confidence head; {directory} has none "
                                  "(train kind dspark with confidence_head: true)")
        return None, section or {}
    if section is None or "head" not in section:
        raise DraftsmithError(f"{directory} carries no {kind} stop head: train one (recipes/*/{kind}-*.yaml) and "
                              f"`draftsmith export HEAD_RUN --format native --out {directory}`")
    diffs = stop_head_mismatch(section, target, proposer)
    if diffs:
        raise DraftsmithError(f"the {kind} stop head in {directory} was trained for another drafter or target "
                              f"({'; '.join(diffs)}); label and train it again for this pair")
    head = policy.head_kind.build(section["head"])
    tensors = load_file(str(Path(directory) / STOP_HEADS_FILE))
    head.load_state_dict({k[len(kind) + 1:]: v for k, v in tensors.items() if k.startswith(kind + ".")})
    return head.to(target.device).eval(), section
