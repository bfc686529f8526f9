"""The `draftsmith` command map. Each subcommand is one function taking its config dataclass: the
dataclass's fields are the command's options (their help comes from its docstring), the function's
docstring is the command's help. `draftsmith COMMAND --help` lists them.

    draftsmith data stats --data SOURCE [--target T] [--json]
    draftsmith regenerate --target T --data SOURCE --out CHATS.jsonl [--turns first|all] ...
    draftsmith extract --target T --data SOURCE --out DIR [--layer_ids [2,15,27]] ...
    draftsmith fit --config RECIPE.yaml [--trainer.max_steps N] [--data.features_dir DIR] [--ckpt_path last]
    draftsmith labels --target T --drafter DIR --data CHATS --out LABELS [--k_max 8] ...
    draftsmith export CKPT_OR_RUN_DIR --format native|eagle|eagle3|speculators --out DIR
    draftsmith tune --target T --drafter DIR --policy specdec|disco|confidence ...
    draftsmith eval --target T --drafter DIR [--prompts mtbench|humaneval|heldout] [--policy specdec] ...
    draftsmith run RECIPE.yaml [--prompts heldout] ...

Options take `--max_length` or `--max-length` alike; a bare `--json` means `--json true`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from draftsmith import DraftsmithError
from draftsmith.data.conversations import DataStatsConfig
from draftsmith.data.regenerate import RegenerateConfig
from draftsmith.eval.evaluate import EvalConfig
from draftsmith.eval.tune import TuneConfig
from draftsmith.export import ExportConfig
from draftsmith.extract import ExtractConfig
from draftsmith.labels import LabelsConfig
from draftsmith.pipeline import RunConfig

BARE_FLAGS = ("--json", "--trust_remote_code")


def data_stats(cfg: DataStatsConfig) -> None:
    """Report what a chat source yields: read, kept, skipped (reason → count), truncated.

    With a target, also tokenize every kept chat with the target's chat template and report
    token counts and the assistant loss mask (the mask audit fails on a degenerate mask).
    """
    from collections import Counter

    from draftsmith.data.chat import MaskAudit, tokenize_many
    from draftsmith.data.conversations import load_conversations

    convs, report = load_conversations(cfg.data, limit=cfg.limit)
    stats: dict[str, Any] = report.as_dict()
    if cfg.target is not None:
        from draftsmith.models.target import load_tokenizer

        tokenizer = load_tokenizer(cfg.target, trust_remote_code=cfg.trust_remote_code)
        skipped, truncated, audit = Counter(), Counter(), MaskAudit()
        tokenize_many(tokenizer, convs, cfg.max_length, skipped, truncated, audit)
        stats["tokenized"] = {
            "target": cfg.target, "max_length": cfg.max_length,
            "kept": len(convs) - sum(skipped.values()),
            "skipped": dict(sorted(skipped.items())), "truncated": dict(sorted(truncated.items())),
            **audit.summary(),
        }
        audit.check(cfg.data)
    if cfg.json:
        print(json.dumps(stats))
        return
    _print_stats(stats)


def extract(cfg: ExtractConfig) -> None:
    """Run the frozen target over the chats and write feature shards + manifest.json to OUT.

    Rerunning the same command resumes from the finished shards. Shards made from another
    target, tokenizer, layer set or data are refused.
    """
    from rich.console import Console

    from draftsmith.extract import extract as run_extract, summary_table

    manifest = run_extract(cfg)
    if manifest:
        Console().print(summary_table(manifest, cfg.out))


def labels(cfg: LabelsConfig) -> None:
    """Run a trained drafter and its target over chats and label every drafted token for stop heads.

    After every assistant position the drafter drafts K_MAX tokens as the runtime would; the rows
    (drafter hidden state, top-k probabilities, entropy, tokens, both models' probabilities, soft and
    hard acceptance labels) go into resumable shards that `draftsmith fit` reads (the specdec/disco recipes).
    """
    from rich.console import Console

    from draftsmith.labels import labels as run_labels

    manifest = run_labels(cfg)
    by_depth = manifest["by_depth"]
    Console().print(f"[bold]labelled[/] {manifest['num_chats']} chats, {manifest['num_rows']:,} drafted tokens in "
                    f"{manifest['this_run']['seconds']} s; accepted by depth (greedy): "
                    + " ".join(f"{x:.2f}" for x in by_depth["hard"]) + "; T = 1: "
                    + " ".join(f"{x:.2f}" for x in by_depth["soft"]))


def tune(cfg: TuneConfig) -> None:
    """Choose a draft-length policy's settings on held-out prompts and write them into the drafter's export.

    specdec and disco: the fastest (threshold, maximum length) of a grid by measured tokens/s;
    confidence: transformers' ROC rule (minimum FPR + 3·FNR) on labelled drafts.
    """
    from rich.console import Console

    from draftsmith.eval.tune import tune as run_tune

    chosen = run_tune(cfg)
    Console().print(f"[bold]tuned[/] {cfg.policy}: " + ", ".join(f"{k} {v}" for k, v in chosen.items()
                                                                   if k in ("threshold", "max_k", "tokens_per_second", "cost"))
                    + f" (written into {cfg.drafter})")


def regenerate(cfg: RegenerateConfig) -> None:
    """Let the target answer the chats' user turns itself and write the chats to OUT (.jsonl).

    Drafters are judged on the target's own text; features of that text (`draftsmith extract
    --data OUT`) teach them what they will see. Conversation ids are kept, so the train/validation
    split matches the source's. Rerunning the same command resumes after the chats written.
    """
    from rich.console import Console

    from draftsmith.data.regenerate import regenerate as run_regenerate

    summary = run_regenerate(cfg)
    Console().print(f"[bold]regenerated[/] {summary['conversations']} conversations "
                    f"({summary['already_done']} already in {cfg.out}): {summary.get('answers', 0)} answers, "
                    f"{summary.get('answer_tokens', 0)} tokens at {summary['answer_tokens_per_second']} tok/s; "
                    f"cut at max_new_tokens {summary.get('answers_cut_at_max_new_tokens', 0)}, empty "
                    f"{summary.get('empty_answers', 0)}, no room {summary.get('turns_without_room', 0)}; "
                    f"next: draftsmith extract --target {cfg.target} --data {cfg.out} --out DIR")


def export(cfg: ExportConfig) -> None:
    """Export a trained drafter: a .ckpt, a DeepSpeed ZeRO checkpoint directory, or a run directory
    (the checkpoint Lightning's ModelCheckpoint recorded as best; the newest one without a monitor).

    Each export is checked against its consumer's contract (tensor names and shapes, config
    fields), then reloaded and its logits compared with the trained module's.
    """
    from rich.console import Console

    from draftsmith.export import export as run_export

    result = run_export(cfg.checkpoint, cfg.format, cfg.out, cfg.speculative_tokens, cfg.verifier)
    what = "stop head" if result["kind"] in ("specdec", "disco") else "drafter"
    Console(soft_wrap=True).print(f"[bold]exported[/] {result['kind']} {what} ({result['checkpoint']}) as {result['format']}: "
                    f"{', '.join(result['directories'])} (contract ok, reloaded logits within "
                    f"{result['max_logit_error']:.1e})")


def evaluate(cfg: EvalConfig) -> None:
    """Measure a drafter with its target: τ, mean accepted, α_j, speedup over autoregressive decoding.

    Writes OUT/results.json and PNG plots, and prints a table per category.
    """
    from pathlib import Path

    from rich.console import Console

    from draftsmith.eval.evaluate import evaluate as run_evaluate
    from draftsmith.eval.report import plots, table, write_results

    results = run_evaluate(cfg)
    path = write_results(results, Path(cfg.out))
    pngs = plots(results, Path(cfg.out))
    console = Console()
    console.print(table(results))
    console.print(f"results: {path}" + (f"\nplots: {', '.join(pngs)}" if pngs else ""))


def run(cfg: RunConfig) -> None:
    """Run a recipe end to end: extract → fit → export → eval; each finished stage is skipped on a rerun.

    Features are extracted when the recipe's feature directory has none (resuming a partial
    extraction); training resumes from the run's last.ckpt and is skipped once max_steps is
    reached; the checkpoint Lightning recorded as best is exported in the native format and
    evaluated; held-out prompts are the recipe's own validation split.
    """
    from rich.console import Console

    from draftsmith.pipeline import run_recipe

    run_recipe(cfg, console=Console())


COMMANDS: dict[str, Any] = {"data": {"stats": (DataStatsConfig, data_stats)}, "regenerate": (RegenerateConfig, regenerate),
                            "extract": (ExtractConfig, extract), "labels": (LabelsConfig, labels),
                            "export": (ExportConfig, export), "eval": (EvalConfig, evaluate),
                            "tune": (TuneConfig, tune), "run": (RunConfig, run)}
LIGHTNING_COMMANDS = ("fit", "validate")


def build_parser() -> Any:
    """A jsonargparse parser with one subcommand per command; a command's options are its config's fields."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(prog="draftsmith", description="Train speculative-decoding drafters and measure them. "
                            "`draftsmith fit --config RECIPE.yaml` trains (LightningCLI); the commands below do the rest.")
    _add_commands(parser, COMMANDS, "draftsmith")
    return parser


def _add_commands(parser: Any, commands: dict[str, Any], prog: str) -> None:
    from jsonargparse import ArgumentParser

    subcommands = parser.add_subcommands(dest="command")
    nested = []
    for name, entry in commands.items():
        if isinstance(entry, dict):  # a command group, e.g. `data stats`: its own commands are added after it
            sub = ArgumentParser(prog=f"{prog} {name}")
            nested.append((sub, entry, f"{prog} {name}"))
            summary = f"{name} commands: {', '.join(entry)}"
        else:
            config, command = entry
            sub = ArgumentParser(prog=f"{prog} {name}", description=command.__doc__)
            sub.add_class_arguments(config, None, as_group=False)
            summary = command.__doc__.split("\n")[0]
        subcommands.add_subcommand(name, sub, help=summary)
    for sub, entry, sub_prog in nested:
        _add_commands(sub, entry, sub_prog)


def dispatch(namespace: dict[str, Any], commands: dict[str, Any] = COMMANDS) -> None:
    """Build the chosen command's config from its parsed options and call the command."""
    name = namespace["command"]
    options, entry = namespace[name], commands[name]
    if isinstance(entry, dict):
        dispatch(options, entry)
        return
    config, command = entry
    command(config(**options))


def _not_litlogger_tip(record: Any) -> bool:
    return "litlogger" not in str(record.msg)


def lightning_cli(argv: list[str], run: bool = True, resume: Path | None = None) -> Any:
    """`draftsmith fit --config RECIPE [--trainer.max_steps N ...]`: LightningCLI over a recipe.

    The recipe names the LightningModule (`model.class_path`) and DataModule (`data.class_path`);
    `data.init_args.target` follows `model.init_args.target`. `resume`: the last.ckpt the caller will fit
    from (`draftsmith run`); `--ckpt_path last` finds it. Either way the run's checkpoints stay beside it
    (`keep_checkpoints_beside`).
    """
    import logging
    import warnings

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

    # `--trainer.default_root_dir DIR` moves the whole run: a recipe's logger (and so the checkpoints, which
    # Lightning keeps under the logger's directory) follows it unless the logger is set on the command line too
    root_moved = any(a.split("=")[0] == "--trainer.default_root_dir" for a in argv)
    logger_given = any(a.startswith("--trainer.logger") for a in argv)

    class DraftsmithCLI(LightningCLI):
        def add_arguments_to_parser(self, parser: Any) -> None:
            parser.link_arguments("model.init_args.target", "data.init_args.target")
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
            logger = trainer.logger
            if root_moved and not logger_given and "save_dir" in getattr(logger, "init_args", {}):
                logger.init_args.save_dir = trainer.default_root_dir
            self.resume_from = resume
            if self._get(self.config, "ckpt_path") == "last":
                self.resume_from = last_checkpoint(trainer)
                if self.resume_from is not None:  # else Lightning looks where its callbacks write, says so, starts over
                    self.config.get(str(self.subcommand), self.config)["ckpt_path"] = str(self.resume_from)
                    from pytorch_lightning.utilities import rank_zero_info

                    rank_zero_info(f"resuming from {self.resume_from}")

        def after_instantiate_classes(self) -> None:
            super().after_instantiate_classes()
            if self.resume_from is not None:
                keep_checkpoints_beside(self.trainer, Path(self.resume_from))

    return DraftsmithCLI(trainer_class=Trainer, args=argv, run=run, subclass_mode_model=True, subclass_mode_data=True,
                         save_config_callback=_config_saver(), save_config_kwargs={"overwrite": True},
                         auto_configure_optimizers=False)


def last_checkpoint(trainer: Any) -> Path | None:
    """The newest last.ckpt (or last-vN.ckpt) in the logger's version directories, for a trainer config
    whose ModelCheckpoints name no dirpath, so that Lightning keeps their files under the logger's version
    (`logs/version_N/checkpoints`); None when there is none, or when they have a fixed place, where
    Lightning finds `last` itself."""
    checkpoints = [cb for cb in trainer.callbacks or [] if str(getattr(cb, "class_path", "")).endswith("ModelCheckpoint")]
    args = getattr(trainer.logger, "init_args", None)
    if not checkpoints or any(cb.init_args.get("dirpath") for cb in checkpoints) or args is None \
            or args.get("version") is not None:
        return None
    base = Path(args.get("save_dir") or trainer.default_root_dir or ".")
    base = base / args["name"] if args.get("name") else base
    found = sorted(base.glob("version_*/checkpoints/last*.ckpt"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def keep_checkpoints_beside(trainer: Any, last: Path) -> None:
    """A resumed run logs to a new version of its logger; its ModelCheckpoints (those given no dirpath)
    keep writing in `last`'s directory, named as the checkpoint recorded it (Lightning restores a
    ModelCheckpoint's best-so-far and its last file only when its dirpath equals the recorded one, and
    records a dirpath it resolved itself unresolved: `runs/...` where a dirpath given is made absolute)."""
    from draftsmith.export.checkpoint import checkpoint_state

    states = checkpoint_state(last).get("callbacks", {})
    recorded = {state.get("dirpath") for key, state in states.items() if str(key).startswith("ModelCheckpoint")}
    here = os.path.realpath(last.parent)
    where = next((d for d in recorded if d and os.path.realpath(d) == here), here)
    for cb in trainer.checkpoint_callbacks:
        if cb.dirpath is None:  # setup() would have put its files in the new version
            cb.dirpath = where


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
            from pathlib import Path

            Path(where).mkdir(parents=True, exist_ok=True)
            self.parser.save(self.config, str(Path(where) / self.config_filename), skip_none=False,
                             overwrite=self.overwrite, multifile=self.multifile)

    return SaveConfigBesideRun


def _print_stats(stats: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"data source: {stats['source']}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for key in ("read", "kept"):
        table.add_row(key, f"{stats[key]:,}")
    for group in ("skipped", "truncated"):
        for reason, count in stats[group].items():
            table.add_row(f"{group}: {reason}", f"{count:,}")
    for key, value in stats.get("tokenized", {}).items():
        if isinstance(value, dict):
            for reason, count in value.items():
                table.add_row(f"tokenized {key}: {reason}", f"{count:,}")
        else:
            table.add_row(f"tokenized {key}", f"{value:,}" if isinstance(value, int) else str(value))
    Console().print(table)


POSITIONAL = {"export": "--checkpoint", "run": "--recipe"}  # `draftsmith export CKPT`, `draftsmith run RECIPE`


def normalize_argv(argv: list[str]) -> list[str]:
    """`--max-length` → `--max_length`; a bare boolean flag → `--flag=true`; `export CKPT` → `--checkpoint CKPT`."""
    if len(argv) > 1 and argv[0] in POSITIONAL and not argv[1].startswith("-"):
        argv = [argv[0], POSITIONAL[argv[0]], *argv[1:]]
    out = []
    for i, arg in enumerate(argv):
        if arg.startswith("--") and not arg.startswith("---"):
            name, eq, value = arg.partition("=")
            arg = name[:2] + name[2:].replace("-", "_") + eq + value
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if not eq and arg in BARE_FLAGS and (nxt is None or nxt.startswith("-")):
                arg += "=true"
        out.append(arg)
    return out


def main(argv: list[str] | None = None) -> None:
    argv = normalize_argv(list(sys.argv[1:] if argv is None else argv))
    try:
        if argv and argv[0] in LIGHTNING_COMMANDS:
            lightning_cli(argv)
            return
        dispatch(build_parser().parse_args(argv).as_dict())
    except DraftsmithError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted: finished shards (or regenerated chats) are kept; rerun the same command to resume",
              file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
