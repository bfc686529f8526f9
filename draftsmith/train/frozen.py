"""The frozen target inside a training module: loaded once, never optimized, never saved.

Both training modules (feature drafters, standalone distillation) hold parts of the target
(embedding, head) as frozen weights. Checkpoints leave them out (`strip`) and get them back from
the target on load (`restore`), after checking that the target is the one the checkpoint was
trained for (`check_identity`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from draftsmith import DraftsmithError


def load_frozen_target(hparams: Any) -> tuple[Any, dict[str, Any]]:
    """(target, identity as a dict) for a module's `target`, `target_dtype`, `chat_template` and `template_kwargs`
    settings."""
    from draftsmith.models.target import load_target

    target = load_target(hparams.target, dtype=hparams.get("target_dtype", "float32"),
                         chat_template=hparams.get("chat_template"), template_kwargs=hparams.get("template_kwargs"))
    return target, target.identity.as_dict()


def online_features(target: Any, batch: dict[str, Any], layer_ids: list[int] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The online target's features for a batch, computed where the batch is.

    The target lives outside the module tree (it is never optimized or saved), so Lightning never moves it:
    the first batch on an accelerator brings it there.
    """
    device = batch["input_ids"].device
    if target.device != device:
        target.model.to(device)
    return target.features(batch["input_ids"], batch["attention_mask"].long(), layer_ids)


def flattens_by_dtype(trainer: Any) -> bool:
    """Whether the trainer's strategy is FSDP, which flattens each unit's parameters into one tensor of one
    dtype: the frozen embedding and head a drafter takes from a bf16 target cannot share it with its float32
    trainable weights, so they are cast to float32 there."""
    from pytorch_lightning.strategies import FSDPStrategy

    return trainer is not None and isinstance(trainer.strategy, FSDPStrategy)


def check_identity(saved: dict[str, Any] | None, current: dict[str, Any]) -> None:
    """Refuse a checkpoint trained for another target (its name and adapter path may differ)."""
    if saved is None:
        return
    from draftsmith.models.target import identity_differences

    diffs = identity_differences(saved, current, "in the checkpoint", "now")
    if diffs:
        raise DraftsmithError(f"checkpoint was trained for another target ({'; '.join(diffs)}); "
                              "use the target it was trained for")


def strip(state: dict[str, torch.Tensor], frozen: Callable[[str], bool]) -> None:
    """Drop the frozen target parts from a checkpoint's state dict (in place)."""
    for key in [k for k in state if frozen(k)]:
        del state[key]


def restore(state: dict[str, torch.Tensor], module_state: dict[str, torch.Tensor], frozen: Callable[[str], bool]) -> None:
    """Put the module's frozen target parts back into a checkpoint's state dict (in place) before loading it."""
    for key, value in module_state.items():
        if key not in state and frozen(key):
            state[key] = value
