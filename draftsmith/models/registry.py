"""The kinds draftsmith trains: one entry per drafter kind and per stop-head kind.

An entry is everything the rest of draftsmith needs to know about a kind — which model class
drafts, which LightningModule trains it, which of its tensors are the target's own (left out of
checkpoints and exports, restored from the target), the export formats it writes, the target
features it reads — so that training, export, loading and evaluation ask the entry rather than
test the kind's name. A new kind is a new model file and one entry here.

Classes are named by their import path and imported when first asked for: this module sits at
the bottom of the import layers (models) and names classes of the layers above it (train) without
importing them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from importlib import import_module
from typing import Any, Mapping

from draftsmith import DraftsmithError


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(import_module(module), name)


@dataclass(frozen=True)
class DrafterKind:
    """One kind of drafter.

    Attributes:
        name: the kind's name in recipes (`model.init_args.kind`), checkpoints and exports.
        title: what a message calls one drafter of the kind ("an EAGLE-3 drafter").
        model: the drafting nn.Module (`module:Class`); a feature drafter's class builds itself from a
            target with `from_target`. None for a standalone draft LM (a transformers model).
        trainer: the LightningModule that trains it.
        formats: the export formats it is written in, draftsmith's own (native) first.
        frozen: the drafter's tensors that are the target's (its embedding, and its head where it shares
            the target's), left out of exports and restored from the target.
        reads_features: it drafts from the target's hidden states (else it is a standalone LM).
        fused_layers: it reads fused intermediate target layers (`aux_layer_ids`), not only the final feature.
        regresses_features: it is trained to predict the next feature too (smooth-L1), with feature noise.
        pruned_vocab: its head drafts over a draft vocabulary (`d2t`) rather than the target's.
        speculators_algorithm: the `speculators` package's name for the kind (its model type and
            algorithm), where that package defines one.
        speculators_architecture: the architecture a speculators config names for it.
        options: the training hyper-parameters the model is built with (`from_target`'s keyword options),
            stored with its exports as `drafter_options`.
        blocks: it drafts a whole block in one forward (DFlash, DSpark), decoded by `runtime/block.py`'s
            proposer, rather than a token per forward.
    """

    name: str
    title: str
    model: str | None
    trainer: str
    formats: tuple[str, ...]
    frozen: tuple[str, ...] = ()
    reads_features: bool = True
    fused_layers: bool = False
    regresses_features: bool = False
    pruned_vocab: bool = False
    speculators_algorithm: str | None = None
    speculators_architecture: str | None = None
    options: tuple[str, ...] = ()
    blocks: bool = False

    @property
    def parallel(self) -> bool:
        """Its drafter's steps after the first read mask inputs and run in one forward (P-EAGLE): what the
        model class declares (`parallel`)."""
        return bool(getattr(self.model_class, "parallel", False))

    @property
    def model_class(self) -> Any:
        return _load(self.model) if self.model else None

    @property
    def trainer_class(self) -> Any:
        return _load(self.trainer)

    def engine_formats(self) -> tuple[str, ...]:
        return tuple(f for f in self.formats if f != "native")


@dataclass(frozen=True)
class HeadKind:
    """One kind of stop head: a classifier that decides, token by token, whether to go on drafting.

    Attributes:
        name: the kind's name, which is also the `--policy` that decodes with it.
        title: what a message calls it.
        model: the head's nn.Module (`module:Class`), built from its config dataclass `config`.
        config: the head's config dataclass (`module:Class`), as checkpoints and exports store it.
        trainer: the LightningModule that trains it.
        grid: the thresholds `draftsmith tune` tries.
        ks: the maximum draft lengths `draftsmith tune` tries with them.
        probabilities_option: the training option that sets how many of the drafter's largest
            probabilities the head reads.
    """

    name: str
    title: str
    model: str
    config: str
    trainer: str
    grid: tuple[float, ...]
    ks: tuple[int, ...]
    probabilities_option: str

    @property
    def trainer_class(self) -> Any:
        return _load(self.trainer)

    def config_from(self, options: Mapping[str, Any], hidden_size: int) -> Any:
        """The head's config from training options named as its fields; `hidden_size` is the drafter's."""
        config = _load(self.config)
        return config(**{f.name: hidden_size if f.name == "hidden_size" else options[f.name]
                         for f in dataclasses.fields(config)})

    def build(self, config: dict[str, Any]) -> Any:
        """The head from its stored config."""
        return _load(self.model)(_load(self.config)(**config))


EAGLE = DrafterKind(
    name="eagle", title="an EAGLE-1/2/HASS drafter", model="draftsmith.models.eagle:EagleDrafter",
    trainer="draftsmith.train.drafter:DrafterModule", formats=("native", "eagle"),
    frozen=("embed_tokens.weight", "lm_head.weight"), regresses_features=True)
EAGLE3 = DrafterKind(
    name="eagle3", title="an EAGLE-3 drafter", model="draftsmith.models.eagle3:Eagle3Drafter",
    trainer="draftsmith.train.drafter:DrafterModule", formats=("native", "eagle3", "speculators"),
    frozen=("embed_tokens.weight",), fused_layers=True, pruned_vocab=True,
    speculators_algorithm="eagle3", speculators_architecture="Eagle3Speculator",
    options=("fc_norm", "norm_before_fc", "norm_output", "rope_theta"))
PEAGLE = DrafterKind(
    name="peagle", title="a P-EAGLE drafter", model="draftsmith.models.eagle3:PEagleDrafter",
    trainer="draftsmith.train.drafter:DrafterModule", formats=("native", "speculators"),
    frozen=("embed_tokens.weight",), fused_layers=True, pruned_vocab=True, speculators_algorithm="peagle",
    speculators_architecture="PEagleSpeculator", options=("fc_norm", "norm_before_fc", "norm_output", "rope_theta", "mask_token_id"))
_BLOCK_OPTIONS = ("block_size", "draft_layers", "mask_token_id", "markov_rank", "confidence_head")
DFLASH = DrafterKind(
    name="dflash", title="a DFlash block drafter", model="draftsmith.models.block:BlockDrafter",
    trainer="draftsmith.train.block:BlockDrafterModule", formats=("native", "speculators"),
    frozen=("embed_tokens.weight",), fused_layers=True, pruned_vocab=True, speculators_algorithm="dflash",
    speculators_architecture="DFlashSpeculator", options=_BLOCK_OPTIONS, blocks=True)
DSPARK = DrafterKind(
    name="dspark", title="a DSpark block drafter", model="draftsmith.models.block:DSparkDrafter",
    trainer="draftsmith.train.block:BlockDrafterModule", formats=("native", "speculators"),
    frozen=("embed_tokens.weight",), fused_layers=True, pruned_vocab=True, speculators_algorithm="dspark",
    speculators_architecture="DSparkSpeculator", options=_BLOCK_OPTIONS, blocks=True)
STANDALONE = DrafterKind(
    name="standalone", title="a standalone draft LM", model=None, trainer="draftsmith.train.distill:DistillModule",
    formats=("native",), reads_features=False)

DRAFTER_KINDS: dict[str, DrafterKind] = {k.name: k for k in (EAGLE, EAGLE3, PEAGLE, DFLASH, DSPARK, STANDALONE)}

# specdec's grid reaches 0.99: with acceptance around 0.3 a token, 1 − Π a_i passes 0.9 by the second drafted
# token, so only h near 1 lets such a drafter's drafts grow (docs/benchmarks.md, dynamic_length.py)
SPECDEC = HeadKind(
    name="specdec", title="SpecDec++ acceptance head", model="draftsmith.models.heads:AcceptanceHead",
    config="draftsmith.models.heads:AcceptanceHeadConfig", trainer="draftsmith.train.heads:StopHeadModule",
    grid=(0.2, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99), ks=(8,), probabilities_option="draft_features")
DISCO = HeadKind(
    name="disco", title="DISCO stop classifier", model="draftsmith.models.heads:StopClassifier",
    config="draftsmith.models.heads:StopClassifierConfig", trainer="draftsmith.train.heads:StopHeadModule",
    grid=(0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9), ks=(4, 6, 8), probabilities_option="top_k")

HEAD_KINDS: dict[str, HeadKind] = {k.name: k for k in (SPECDEC, DISCO)}

# every export format, in the order `--help` lists them; each kind names the ones it writes
FORMATS: tuple[str, ...] = tuple(dict.fromkeys(f for k in DRAFTER_KINDS.values() for f in k.formats))


def drafter_kind(name: str) -> DrafterKind:
    if name not in DRAFTER_KINDS:
        raise DraftsmithError(f"unknown drafter kind {name!r}; choose one of {sorted(DRAFTER_KINDS)}")
    return DRAFTER_KINDS[name]


def head_kind(name: str) -> HeadKind:
    if name not in HEAD_KINDS:
        raise DraftsmithError(f"unknown stop head {name!r}; choose one of {tuple(HEAD_KINDS)}")
    return HEAD_KINDS[name]


def trained_kind(name: str) -> DrafterKind | HeadKind:
    """The drafter or stop-head kind a training checkpoint records."""
    if name in HEAD_KINDS:
        return HEAD_KINDS[name]
    return drafter_kind(name)


def check_format(kind: DrafterKind, fmt: str) -> None:
    """Refuse an export format the kind is not written in, naming the ones it is."""
    if fmt in kind.formats:
        return
    owners = [k.title for k in DRAFTER_KINDS.values() if fmt in k.formats]
    engines = kind.engine_formats()
    fix = f"use --format {' or '.join(engines)}" if engines else \
        "it exports as `native` (an ordinary transformers model directory)"
    raise DraftsmithError(f"--format {fmt} is for {' or '.join(owners) or 'no drafter'}; this is {kind.title}: {fix}")
