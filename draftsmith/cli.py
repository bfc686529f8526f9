"""The `draftsmith` command map. Each subcommand is one function taking its config dataclass: the
dataclass's fields are the command's options (their help comes from its docstring), the function's
docstring is the command's help. `draftsmith COMMAND --help` lists them.

    draftsmith data stats --data SOURCE [--target T] [--json]
    draftsmith regenerate --target T --data SOURCE --out CHATS.jsonl [--turns first|all] ...
    draftsmith extract --target T --data SOURCE --out DIR [--layer_ids [2,15,27]] ...
    draftsmith fit --config RECIPE.yaml [--trainer.max_steps N] [--data.features_dir DIR] [--ckpt_path last]
    draftsmith labels --target T --drafter DIR --data CHATS --out LABELS [--k 8] ...
    draftsmith export CKPT_OR_RUN_DIR --format native|eagle|eagle3|speculators --out DIR
    draftsmith tune --target T --drafter DIR --policy specdec|disco|confidence ...
    draftsmith eval --target T --drafter DIR [--prompts mtbench,humaneval,heldout,long] [--policy specdec] ...
    draftsmith profile --target T [--drafter DIR] --out PROFILE.json
    draftsmith run RECIPE.yaml [--prompts heldout] ...

Options take `--max_length` or `--max-length` alike; a bare `--json` means `--json true`.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from draftsmith import DraftsmithError
from draftsmith.data.conversations import DataStatsConfig
from draftsmith.jobs.regenerate import RegenerateConfig
from draftsmith.eval.evaluate import EvalConfig
from draftsmith.eval.profile import ProfileConfig
from draftsmith.eval.tune import TuneConfig
from draftsmith.export import ExportConfig
from draftsmith.jobs.extract import ExtractConfig
from draftsmith.jobs.labels import LabelsConfig
from draftsmith.models.registry import HEAD_KINDS
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

        tokenizer = load_tokenizer(cfg.target, trust_remote_code=cfg.trust_remote_code,
                                   chat_template=cfg.chat_template, template_kwargs=cfg.template_kwargs)
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

    from draftsmith.jobs.extract import extract as run_extract, summary_table

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

    from draftsmith.jobs.labels import labels as run_labels

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
                                                                   if k in ("threshold", "k", "tokens_per_second", "cost"))
                    + f" (written into {cfg.drafter})")


def profile(cfg: ProfileConfig) -> None:
    """Measure this machine's cost profile: what verifying n rows and a drafter forward cost in target steps.

    `draftsmith eval --cost_profile FILE` prices a run's counted rounds by it (modelled speedup).
    """
    from rich.console import Console

    from draftsmith.eval.profile import run_profile

    made = run_profile(cfg)
    Console().print("[bold]verify[/] (rows: steps) " + ", ".join(f"{r}: {s:.3f}" for r, s in made.verify)
                    + "  [bold]draft[/] " + (", ".join(f"{k} {v:.3f} steps a forward" for k, v in made.draft.items())
                                             or "(no drafter)") + f"  step {made.step_ms:.2f} ms  -> {cfg.out}")


def regenerate(cfg: RegenerateConfig) -> None:
    """Let the target answer the chats' user turns itself and write the chats to OUT (.jsonl).

    Drafters are judged on the target's own text; features of that text (`draftsmith extract
    --data OUT`) teach them what they will see. Conversation ids are kept, so the train/validation
    split matches the source's. Rerunning the same command resumes after the chats written.
    """
    from rich.console import Console

    from draftsmith.jobs.regenerate import regenerate as run_regenerate

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
    what = "stop head" if result["kind"] in HEAD_KINDS else "drafter"
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
    from draftsmith.eval.report import plots, print_table, write_results

    results = run_evaluate(cfg)
    path = write_results(results, Path(cfg.out))
    pngs = plots(results, Path(cfg.out))
    console = Console()
    print_table(console, results)
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
                            "tune": (TuneConfig, tune), "profile": (ProfileConfig, profile), "run": (RunConfig, run)}
LIGHTNING_COMMANDS = ("fit", "validate")


def build_parser() -> Any:
    """A jsonargparse parser with one subcommand per command; a command's options are its config's fields."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(prog="draftsmith", description="Train speculative-decoding drafters and measure them. "
                            "`draftsmith fit --config RECIPE.yaml` trains (LightningCLI); the commands below do the rest.")
    _add_commands(parser, COMMANDS, "draftsmith", help_only={"fit": FIT_HELP})
    return parser


# `fit` is LightningCLI's (main hands it over before this parser runs); listed here so that --help names it
FIT_HELP = "Train a drafter or stop head from a recipe: `draftsmith fit --config RECIPE.yaml` (LightningCLI; --help lists every option)."


def _add_commands(parser: Any, commands: dict[str, Any], prog: str, help_only: dict[str, str] | None = None) -> None:
    from jsonargparse import ArgumentParser

    subcommands = parser.add_subcommands(dest="command")
    for name, summary in (help_only or {}).items():
        subcommands.add_subcommand(name, ArgumentParser(prog=f"{prog} {name}", description=summary), help=summary)
    nested = []
    for name, entry in commands.items():
        if isinstance(entry, dict):  # a command group, e.g. `data stats`: its own commands are added after it
            sub = ArgumentParser(prog=f"{prog} {name}")
            nested.append((sub, entry, f"{prog} {name}"))
            summary = f"{name} commands: {', '.join(entry)}"
        else:
            config, command = entry
            positional = POSITIONAL.get(name)  # `draftsmith run RECIPE`: the usage line says so
            usage = f"{prog} {name} {positional[2:].upper()} [options]" if positional else None
            sub = ArgumentParser(prog=f"{prog} {name}", description=command.__doc__, usage=usage)
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


# What an interrupted command leaves, and how to go on (Ctrl-C): each says only what it keeps.
INTERRUPTED = {
    "extract": "finished shards are kept; rerun the same command to resume",
    "labels": "finished shards are kept; rerun the same command to resume",
    "regenerate": "the chats written are kept; rerun the same command to resume",
    "run": "finished stages are kept (training's last.ckpt too); rerun the same command to resume",
    "fit": "training's last.ckpt is kept; rerun with --ckpt_path last to resume",
    "eval": "an eval keeps nothing until it ends; rerun it",
    "tune": "tune writes its choice at the end: nothing was written; rerun it",
    "profile": "profile writes its file at the end: nothing was written; rerun it",
}


def main(argv: list[str] | None = None) -> None:
    argv = normalize_argv(list(sys.argv[1:] if argv is None else argv))
    try:
        if argv and argv[0] in LIGHTNING_COMMANDS:
            from draftsmith.train.cli import lightning_cli

            lightning_cli(argv)
            return
        dispatch(build_parser().parse_args(argv).as_dict())
    except DraftsmithError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"interrupted: {INTERRUPTED.get(argv[0] if argv else '', 'nothing is kept')}", file=sys.stderr)
        sys.exit(130)
    except SystemExit as stop:  # Lightning's stop on SIGTERM is a SystemExit of status 0
        lightning = sys.modules.get("pytorch_lightning.utilities.exceptions")
        if lightning is not None and isinstance(stop, lightning.SIGTERMException):
            print("stopped by SIGTERM: training's last.ckpt is saved; rerun the same command (fit: with "
                  "--ckpt_path last) to resume", file=sys.stderr)
            sys.exit(143)
        raise


if __name__ == "__main__":
    main()
