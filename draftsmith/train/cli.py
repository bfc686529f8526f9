"""`draftsmith fit`: LightningCLI over a recipe, with draftsmith's links between model and data, its
resume rules and its config saving."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from draftsmith.train.checkpoints import keep_checkpoints_beside, last_checkpoint, save_last_at_stop

BASE_RECIPE = Path(__file__).with_name("base.yaml")  # what every recipe extends


def _not_litlogger_tip(record: Any) -> bool:
    return "litlogger" not in str(record.msg)


def lightning_cli(argv: list[str], run: bool = True, resume: Path | None = None) -> Any:
    """`draftsmith fit --config RECIPE [--trainer.max_steps N ...]`: LightningCLI over a recipe.

    The recipe extends `BASE_RECIPE` (its seed, logging interval and checkpoint callbacks) and names the
    LightningModule (`model.class_path`) and DataModule (`data.class_path`); `data.init_args.target`
    follows `model.init_args.target`; without a logger named, the run logs CSV under
    `trainer.default_root_dir`/logs. `resume`: the last.ckpt the caller will fit
    from (`draftsmith run`); `--ckpt_path last` finds it. Either way the run's checkpoints stay beside it
    (`keep_checkpoints_beside`).
    """
    import logging
    import warnings

    from jsonargparse import Namespace
    from pytorch_lightning.cli import LightningCLI

    from draftsmith.train.trainer import Trainer

    # draftsmith's DataModules resume mid-epoch themselves (their state_dict records the batches
    # done; a test shows bit-identical weights), so Lightning's "dataloader is not resumable" is moot
    warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")
    # Lightning 2.6's own use of a torch pytree API that torch 2.13 deprecates: nothing a user can change
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    # draftsmith always hands LightningCLI its arguments (the ones after `draftsmith fit`, or a recipe's
    # built by `draftsmith run` / a benchmark), so the process's own sys.argv is never meant for it
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended to run from within Python")
    # Lightning's advert for its hosted logger, printed by every Trainer: not something a run can act on
    logging.getLogger("pytorch_lightning.utilities.rank_zero").addFilter(_not_litlogger_tip)  # added once

    class DraftsmithCLI(LightningCLI):
        def add_arguments_to_parser(self, parser: Any) -> None:
            parser.link_arguments("model.init_args.target", "data.init_args.target")
            parser.link_arguments("model.init_args.chat_template", "data.init_args.chat_template")
            parser.link_arguments("model.init_args.template_kwargs", "data.init_args.template_kwargs")
            # what the data decides, handed to the model once both exist: whether the target runs inside the
            # step (no stored features), and the training data's token counts (EAGLE-3's draft vocabulary,
            # a standalone drafter's ranked head)
            parser.link_arguments("data", "model.init_args.online", compute_fn=_data_online, apply_on="instantiate")
            parser.link_arguments("data", "model.init_args.count_tokens", compute_fn=_data_token_counts,
                                  apply_on="instantiate")
            # draftsmith's DataModules shard batches across ranks themselves (length-bucketed)
            parser.set_defaults({"trainer.use_distributed_sampler": False})

        def before_instantiate_classes(self) -> None:
            trainer = self._get(self.config, "trainer")
            if trainer.logger is None or trainer.logger is True:  # no logger named: the run's CSV logs
                trainer.logger = Namespace(class_path="pytorch_lightning.loggers.CSVLogger",
                                           init_args=Namespace(save_dir=trainer.default_root_dir or ".", name="logs"))
            self.resume_from = resume
            if self._get(self.config, "ckpt_path") == "last":
                self.resume_from = last_checkpoint(trainer)
                if self.resume_from is not None:  # else Lightning looks where its callbacks write, says so, starts over
                    self.config.get(str(self.subcommand), self.config)["ckpt_path"] = str(self.resume_from)
                    from pytorch_lightning.utilities import rank_zero_info

                    rank_zero_info(f"resuming from {self.resume_from}")

        def after_instantiate_classes(self) -> None:
            super().after_instantiate_classes()
            self.trainer.callbacks.append(save_last_at_stop())
            from draftsmith.train.progress import ProgressLog, mend_progress_bar

            from draftsmith.train.trainer import ReleaseFreedMemory

            mend_progress_bar(self.trainer)
            for callback in (ProgressLog, ReleaseFreedMemory):
                if not any(isinstance(c, callback) for c in self.trainer.callbacks):
                    self.trainer.callbacks.append(callback())
            if self.resume_from is not None:
                keep_checkpoints_beside(self.trainer, Path(self.resume_from))

    return DraftsmithCLI(trainer_class=Trainer, args=argv, run=run, subclass_mode_model=True, subclass_mode_data=True,
                         parser_kwargs=_base_recipe(run),
                         save_config_callback=_config_saver(), save_config_kwargs={"overwrite": True},
                         auto_configure_optimizers=False)


def _base_recipe(run: bool) -> dict[str, Any]:
    """LightningCLI's parser arguments that read BASE_RECIPE first: the subcommands' parsers when it runs one."""
    from pytorch_lightning.cli import LightningCLI

    base = {"default_config_files": [str(BASE_RECIPE)]}
    return {command: base for command in LightningCLI.subcommands()} if run else base


def _data_online(data: Any) -> bool:
    return bool(getattr(data, "online", False))


def _data_token_counts(data: Any) -> Any:
    return getattr(data, "token_counts", None)


def _config_saver() -> type:
    """LightningCLI's config saving, moved beside the run's checkpoints.

    Lightning writes config.yaml into `trainer.log_dir`, which is the working directory when a
    recipe has no logger; this writes it where the run keeps its files (the logger's directory,
    else the checkpoint directory) once training starts, and nowhere when the run keeps none."""
    from pytorch_lightning.cli import SaveConfigCallback

    class SaveConfigBesideRun(SaveConfigCallback):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, "save_to_log_dir": False})

        def save_config(self, trainer: Any, pl_module: Any, stage: str) -> None:
            pass  # at setup the checkpoint directory is not resolved yet: on_train_start writes

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            checkpoint = trainer.checkpoint_callback
            where = trainer.log_dir if trainer.loggers else getattr(checkpoint, "dirpath", None)
            if where is None or not trainer.is_global_zero:
                return
            Path(where).mkdir(parents=True, exist_ok=True)
            self.parser.save(self.config, str(Path(where) / self.config_filename), skip_none=False,
                             overwrite=self.overwrite, multifile=self.multifile)

    return SaveConfigBesideRun
