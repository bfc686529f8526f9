"""Every recipe parses and instantiates (model, data, trainer, strategy) without training."""

import importlib
from pathlib import Path

import pytest
import yaml

RECIPES = sorted(Path(__file__).parents[1].glob("recipes/*/*.yaml"))


def recipe_kind(raw: dict) -> str:
    """The drafter or stop-head kind a recipe trains (a standalone LM's recipe names its module only)."""
    from draftsmith.models.registry import DRAFTER_KINDS

    by_module = {k.trainer.replace(":", "."): k.name for k in DRAFTER_KINDS.values() if not k.reads_features}
    return raw["model"]["init_args"].get("kind") or by_module[raw["model"]["class_path"]]


def test_every_kind_and_strategy_has_a_recipe():
    """A kind added to the registry gets a CPU recipe for the embedded default; the strategies a user
    scales to (DDP, FSDP, DeepSpeed ZeRO-2 and -3) each have a GPU recipe."""
    from draftsmith.models.registry import DRAFTER_KINDS, HEAD_KINDS

    raws = {p: yaml.safe_load(p.read_text()) for p in RECIPES}
    cpu = {recipe_kind(raw) for raw in raws.values() if raw["trainer"].get("accelerator") == "cpu"}
    assert set(DRAFTER_KINDS) | set(HEAD_KINDS) <= cpu, sorted(set(DRAFTER_KINDS) | set(HEAD_KINDS) - cpu)
    assert any(raw["model"]["init_args"].get("topk_weight", 0) > 0 for raw in raws.values())  # HASS's loss
    strategies = {str(raw["trainer"].get("strategy", "auto")) for raw in raws.values()}
    assert any("FSDP" in s for s in strategies) and any("'stage': 2" in s for s in strategies)
    assert any("'stage': 3" in s for s in strategies) and "ddp" in strategies


def build_strategy(spec):
    from pytorch_lightning.strategies import StrategyRegistry

    if spec == "auto":
        return None  # the trainer picks single-device; built above
    if isinstance(spec, str):
        return StrategyRegistry.get(spec)
    module, _, name = spec["class_path"].rpartition(".")
    return getattr(importlib.import_module(module), name)(**spec.get("init_args", {}))


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_recipe_instantiates(path, tmp_path):
    from pytorch_lightning.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy

    from draftsmith.train.cli import lightning_cli

    raw = yaml.safe_load(path.read_text())
    # the trainer on this CPU; the recipe's own strategy is built on its own below
    cli = lightning_cli(["--config", str(path), "--trainer.accelerator", "cpu", "--trainer.devices", "1",
                         "--trainer.strategy", "auto", "--trainer.precision", "32-true",
                         "--trainer.default_root_dir", str(tmp_path)], run=False)
    assert type(cli.model).__name__ == raw["model"]["class_path"].rsplit(".", 1)[1]
    assert type(cli.datamodule).__name__ == raw["data"]["class_path"].rsplit(".", 1)[1]
    assert cli.datamodule.hint["target"] if hasattr(cli.datamodule, "hint") else cli.datamodule.target
    assert cli.trainer.max_steps == raw["trainer"].get("max_steps", -1)
    # logs land beside the run's checkpoints, in a format that needs no extra package
    assert [type(lg).__name__ for lg in cli.trainer.loggers] == ["CSVLogger"]
    assert "logger" not in raw["trainer"]  # the logger follows default_root_dir, named nowhere
    assert cli.trainer.logger.save_dir == str(tmp_path)  # --trainer.default_root_dir moves logs and checkpoints
    # the recipe's checkpoints, or the base recipe's
    ckpt = next(cb for cb in cli.trainer.callbacks if type(cb).__name__ == "ModelCheckpoint")
    # drafters keep the best simulated acceptance length; stop heads the lowest validation loss
    heads = raw["model"]["class_path"].endswith("StopHeadModule")
    assert (ckpt.monitor, ckpt.mode) == (("val/loss", "min") if heads else ("val/tau", "max"))
    # last.ckpt follows the steps (a monitored save_last writes it only when the top-k changes)
    kept = [cb for cb in cli.trainer.callbacks if type(cb).__name__ == "ModelCheckpoint"]
    assert [bool(cb.save_last) for cb in kept] == [False, True]
    assert kept[1].monitor is None and kept[1]._every_n_train_steps > 0 and kept[1].save_top_k == 0
    strategy = build_strategy(raw["trainer"].get("strategy", "auto"))
    spec = raw["trainer"].get("strategy")
    if isinstance(spec, dict) and "FSDP" in spec["class_path"]:
        assert isinstance(strategy, FSDPStrategy)
    elif isinstance(spec, dict) and "DeepSpeed" in spec["class_path"]:
        assert isinstance(strategy, DeepSpeedStrategy)
        assert strategy.config["zero_optimization"]["stage"] == spec["init_args"]["stage"]
    elif spec == "ddp":
        assert isinstance(strategy, DDPStrategy)
