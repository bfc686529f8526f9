"""Native drafter exports → modules: what `eval` and the runtime load (`runtime/loading.py` makes proposers).

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
from draftsmith.files import save_tensors_atomic, write_json_atomic
from draftsmith.models.registry import drafter_kind

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
                              "a drafter reads its own target's features: train one for this target (a recipe "
                              "with this model.init_args.target)")
    return drafter_from_tensors(config["kind"], tensors, target, config.get("aux_layer_ids", []),
                                config.get("drafter_options", {}))


def drafter_from_tensors(kind: str, tensors: dict[str, torch.Tensor], target: Any, aux_layer_ids: list[int],
                         options: dict[str, bool] | None = None) -> Any:
    """Build a drafter of `kind` (with its `options`, EAGLE-3.1's) around `target` and load drafter-named
    tensors (native names)."""
    entry = drafter_kind(kind)
    embed, head = target.embed_tokens.weight.detach().float(), target.lm_head.weight.detach().float()
    draft_ids = torch.arange(len(tensors["d2t"])) + tensors["d2t"] if "d2t" in tensors else None
    drafter = entry.model_class.from_target(target.config, embed, head, None, draft_ids, len(aux_layer_ids),
                                            target.hidden_size, **(options or {}))
    missing, unexpected = drafter.load_state_dict(tensors, strict=False)
    if set(missing) - set(entry.frozen) or unexpected:
        raise DraftsmithError(f"drafter weights do not fit: missing {sorted(set(missing) - set(entry.frozen))}, "
                              f"unexpected {unexpected}")
    return drafter.eval()


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


def tuned_key(greedy: bool, tree: bool) -> str:
    """Where `draftsmith tune` files its choice in a stop-head section's `tuned`: greedy, sampling,
    tree_greedy or tree_sampling."""
    return ("tree_" if tree else "") + ("greedy" if greedy else "sampling")


def tuned_settings(section: dict[str, Any], greedy: bool, tree: bool = False,
                   profile: str | None = None) -> tuple[float, int] | None:
    """(threshold, k) `draftsmith tune` wrote into a stop-head section for greedy decoding or sampling
    (the other kind's when only that was tuned), or None when it was never tuned. `tree`: the settings
    tuned for tree rounds (`tune --tree`), else the chains'. `profile`: the settings chosen for that cost
    profile (`tune --cost_profile`, filed as `greedy@NAME`), None where it was never tuned for it."""
    return choice_settings(tuned_choice(section, greedy, tree, profile))


def choice_settings(chosen: dict[str, Any] | None) -> tuple[float, int] | None:
    """(threshold, k) of a choice `tuned_choice` found, or None."""
    # exports tuned before the draft length was called k everywhere name it max_k
    return None if chosen is None else (chosen["threshold"], chosen.get("k", chosen.get("max_k")))


def tuned_choice(section: dict[str, Any], greedy: bool, tree: bool = False,
                 profile: str | None = None) -> dict[str, Any] | None:
    """The whole choice `tuned_settings` reads its (threshold, k) from: with the grid, the profile and the
    prompts it was decoded on (`prompts.max_new_tokens`: the answer length it was chosen for)."""
    tuned = section.get("tuned", {})
    at = f"@{profile}" if profile else ""
    keys = [tuned_key(g, t) + at for t in ((True, False) if tree else (False,)) for g in (greedy, not greedy)]
    return next((tuned[k] for k in keys if k in tuned), None)


def update_stop_heads(directory: str | Path, kind: str, section: dict[str, Any],
                      tensors: dict[str, torch.Tensor] | None = None) -> None:
    """Write (or merge into) a native export's stop-head section for `kind`, and its weights when given."""
    from safetensors.torch import load_file

    directory = Path(directory)
    path = native_config_path(directory)
    config = json.loads(path.read_text())
    config.setdefault(STOP_HEADS, {})[kind] = section
    if tensors is not None:
        weights = directory / STOP_HEADS_FILE
        kept = {k: v for k, v in load_file(str(weights)).items() if not k.startswith(kind + ".")} if weights.exists() else {}
        save_tensors_atomic({**kept, **{f"{kind}.{k}": v.detach().float().contiguous() for k, v in tensors.items()}}, weights)
    write_json_atomic(path, config)
