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


STOP_HEADS_FILE = "stop_heads.safetensors"  # the stop heads' weights, named `<kind>.<parameter>`
STOP_HEADS = "stop_heads"  # the native config's section: policy → head config, identities, tuned settings


def native_config_path(directory: str | Path) -> Path:
    """The file holding a native export's draftsmith config: draftsmith.json (standalone) or config.json."""
    directory = Path(directory)
    standalone = directory / STANDALONE_FILE
    if standalone.is_file():
        return standalone
    config = directory / "config.json"
    if config.is_file() and json.loads(config.read_text()).get("format") == NATIVE_FORMAT:
        return config
    raise DraftsmithError(f"{directory} is not a native drafter export (`draftsmith export CKPT --format native --out DIR`)")


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


def load_stop_head(directory: str | Path, kind: str, target: Any, proposer: Any) -> tuple[Any, dict[str, Any]]:
    """(head module, its config section) of a native export; refused when trained for another drafter or target."""
    from safetensors.torch import load_file

    from draftsmith.models.heads import build_head

    section = json.loads(native_config_path(directory).read_text()).get(STOP_HEADS, {}).get(kind)
    if section is None or "head" not in section:
        raise DraftsmithError(f"{directory} carries no {kind} stop head: train one (recipes/*/{kind}-*.yaml) and "
                              f"`draftsmith export HEAD_RUN --format native --out {directory}`")
    diffs = stop_head_mismatch(section, target, proposer)
    if diffs:
        raise DraftsmithError(f"the {kind} stop head in {directory} was trained for another drafter or target "
                              f"({'; '.join(diffs)}); label and train it again for this pair")
    head = build_head(kind, section["head"])
    tensors = load_file(str(Path(directory) / STOP_HEADS_FILE))
    head.load_state_dict({k[len(kind) + 1:]: v for k, v in tensors.items() if k.startswith(kind + ".")})
    return head.to(target.device).eval(), section


def tuned_key(greedy: bool, tree: bool) -> str:
    """Where `draftsmith tune` files its choice in a stop-head section's `tuned`: greedy, sampling,
    tree_greedy or tree_sampling."""
    return ("tree_" if tree else "") + ("greedy" if greedy else "sampling")


def tuned_settings(section: dict[str, Any], greedy: bool, tree: bool = False) -> tuple[float, int] | None:
    """(threshold, max_k) `draftsmith tune` wrote into a stop-head section for greedy decoding or sampling
    (the other kind's when only that was tuned), or None when it was never tuned. `tree`: the settings
    tuned for tree rounds (`tune --tree`), else the chains'."""
    tuned = section.get("tuned", {})
    keys = [tuned_key(g, t) for t in ((True, False) if tree else (False,)) for g in (greedy, not greedy)]
    chosen = next((tuned[k] for k in keys if k in tuned), None)
    return None if chosen is None else (chosen["threshold"], chosen["max_k"])


def update_stop_heads(directory: str | Path, kind: str, section: dict[str, Any],
                      tensors: dict[str, torch.Tensor] | None = None) -> None:
    """Write (or merge into) a native export's stop-head section for `kind`, and its weights when given."""
    from safetensors.torch import load_file, save_file

    from draftsmith.data.features import write_json_atomic

    directory = Path(directory)
    path = native_config_path(directory)
    config = json.loads(path.read_text())
    config.setdefault(STOP_HEADS, {})[kind] = section
    if tensors is not None:
        weights = directory / STOP_HEADS_FILE
        kept = {k: v for k, v in load_file(str(weights)).items() if not k.startswith(kind + ".")} if weights.exists() else {}
        tmp = weights.with_name(f".{weights.name}.tmp")
        save_file({**kept, **{f"{kind}.{k}": v.detach().float().contiguous() for k, v in tensors.items()}}, str(tmp))
        tmp.replace(weights)
    write_json_atomic(path, config)
