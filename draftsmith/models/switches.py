"""Contexts that change how a model computes for the duration of a call and leave it as it was.

`Switch` is the nesting rule: the outermost entry switches on, its exit switches off. `AttentionSwitch`
runs a model's transformers SDPA attention as a function of draftsmith's own: training-time test's merged
attention (`train.attention`) and decoding's folded grouped-query attention (`runtime.kernels`). Both take
the same arguments as transformers' SDPA attention and give its result, so the model is never changed.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn


class Switch:
    """A nestable context that switches something on at the outermost entry and off at its exit."""

    depth = 0

    def on(self) -> None: ...

    def off(self) -> None: ...

    def __enter__(self):
        if self.depth == 0:
            self.on()
        self.depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.off()


class AttentionSwitch(Switch):
    """`with AttentionSwitch(name, function, *modules):` every config of the modules that names transformers'
    SDPA attention (or `name` already) names `name` instead, registered as `function`, and names what it
    named before at the exit. Off when `enabled` is False or no config of the modules qualifies.

    Only each config's own implementation is switched (its setter would recurse into sub-configs); `name`
    also gets transformers' SDPA mask builder, for models that build their masks from the name."""

    def __init__(self, name: str, function: Callable[..., Any], *modules: nn.Module, enabled: bool = True):
        configs = {id(c): c for module in modules for m in module.modules()
                   if getattr(c := getattr(m, "config", None), "_attn_implementation", None) in ("sdpa", name)}
        self.name = name
        self.configs = list(configs.values()) if enabled else []
        self.before: list[str] = []
        if self.configs:
            from transformers import AttentionInterface
            from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

            AttentionInterface.register(name, function)
            AttentionMaskInterface.register(name, sdpa_mask)

    def on(self) -> None:
        self.before = [c._attn_implementation for c in self.configs]
        for config in self.configs:
            config._attn_implementation_internal = self.name

    def off(self) -> None:
        for config, name in zip(self.configs, self.before):
            config._attn_implementation_internal = name
