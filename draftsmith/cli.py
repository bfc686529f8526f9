"""The `draftsmith` command map. Each subcommand is one typed function; its docstring is its help.

    draftsmith data stats --data SOURCE [--target T] [--json]
    draftsmith regenerate --target T --data SOURCE --out CHATS.jsonl [--turns first|all] ...
    draftsmith extract --target T --data SOURCE --out DIR [--layer_ids [2,15,27]] ...
    draftsmith fit --config RECIPE.yaml [--trainer.max_steps N] [--data.features_dir DIR] [--ckpt_path last]

Options take `--max_length` or `--max-length` alike; a bare `--json` means `--json true`.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from draftsmith import DraftsmithError

BARE_FLAGS = ("--json", "--trust_remote_code")


def data_stats(data: str, target: str | None = None, max_length: int = 2048, limit: int | None = None,
               json: bool = False, trust_remote_code: bool = False) -> None:
    """Report what a chat source yields: read, kept, skipped (reason → count), truncated.

    With a target, also tokenize every kept chat with the target's chat template and report
    token counts and the assistant loss mask (the mask audit fails on a degenerate mask).

    Args:
        data: `sharegpt` (embedded), a .json/.jsonl file, a `datasets` directory, .parquet/.csv, or hf:NAME[:SPLIT].
        target: a target (embedded alias, .gguf, model directory or hub id) whose tokenizer to use.
        max_length: token budget per chat; longer chats are truncated (counted).
        limit: stop after this many kept conversations.
        json: print exactly one JSON object on stdout instead of tables.
        trust_remote_code: allow a hub tokenizer's own code to run.
    """
    from collections import Counter

    from draftsmith.data.chat import MaskAudit, tokenize_many
    from draftsmith.data.conversations import load_conversations

    convs, report = load_conversations(data, limit=limit)
    stats: dict[str, Any] = report.as_dict()
    if target is not None:
        from draftsmith.models.target import load_tokenizer

        tokenizer = load_tokenizer(target, trust_remote_code=trust_remote_code)
        skipped, truncated, audit = Counter(), Counter(), MaskAudit()
        tokenize_many(tokenizer, convs, max_length, skipped, truncated, audit)
        stats["tokenized"] = {
            "target": target, "max_length": max_length,
            "kept": len(convs) - sum(skipped.values()),
            "skipped": dict(sorted(skipped.items())), "truncated": dict(sorted(truncated.items())),
            **audit.summary(),
        }
        audit.check(data)
    if json:
        print(_json_dumps(stats))
        return
    _print_stats(stats)


def extract(target: str, data: str, out: str, layer_ids: list[int] | None = None, max_length: int = 2048,
            limit: int | None = None, shard_size: int = 64, batch_tokens: int = 8192, dtype: str = "bfloat16",
            feature_dtype: str = "bfloat16", device: str = "cpu", devices: int = 1, device_map: str | None = None,
            adapter: str | None = None, trust_remote_code: bool = False) -> None:
    """Run the frozen target over the chats and write feature shards + manifest.json to OUT.

    Rerunning the same command resumes from the finished shards. Shards made from another
    target, tokenizer, layer set or data are refused.

    Args:
        target: embedded:smollm2-135m-instruct, a .gguf file, a model directory, or a hub id.
        data: chat source, as for `draftsmith data stats`.
        out: the feature directory.
        layer_ids: extra hidden states to keep (id i = output_hidden_states[i]), e.g. [2,15,27] for EAGLE-3.
        max_length: tokens per chat; longer chats are truncated (counted in the manifest).
        limit: use only the first LIMIT kept conversations.
        shard_size: conversations per shard (the unit of resumption).
        batch_tokens: padded tokens per forward batch.
        dtype: the target's compute dtype (bfloat16 is ~4x faster than float32 on recent CPUs).
        feature_dtype: dtype of the stored features.
        device: cpu, cuda, cuda:1, ...
        devices: processes to extract with (each takes every N-th shard); torchrun works too.
        device_map: accelerate placement for a target larger than one device (e.g. auto).
        adapter: a peft LoRA adapter directory merged into the target on load.
        trust_remote_code: allow a hub model's own code to run.
    """
    from rich.console import Console

    from draftsmith.extract import ExtractConfig, extract as run_extract, summary_table

    cfg = ExtractConfig(target=target, data=data, out=out, layer_ids=list(layer_ids or []), max_length=max_length,
                        limit=limit, shard_size=shard_size, batch_tokens=batch_tokens, dtype=dtype,
                        feature_dtype=feature_dtype, device=device, devices=devices, device_map=device_map,
                        adapter=adapter, trust_remote_code=trust_remote_code)
    manifest = run_extract(cfg)
    if manifest:
        Console().print(summary_table(manifest, out))


def regenerate(target: str, data: str, out: str, limit: int | None = None, turns: str = "first",
               max_new_tokens: int = 512, max_length: int = 2048, temperature: float = 0.0, top_p: float | None = None,
               batch_size: int = 16, dtype: str = "bfloat16", device: str = "cpu", seed: int = 0,
               trust_remote_code: bool = False) -> None:
    """Let the target answer the chats' user turns itself and write the chats to OUT (.jsonl).

    Drafters are judged on the target's own text; features of that text (`draftsmith extract
    --data OUT`) teach them what they will see. Conversation ids are kept, so the train/validation
    split matches the source's. Rerunning the same command resumes after the chats written.

    Args:
        target: the target model, as for extract.
        data: chat source whose user turns are answered, as for `draftsmith data stats`.
        out: the .jsonl file to write (with OUT.meta.json: target and settings).
        limit: use only the first LIMIT kept conversations.
        turns: first (answer the first user turn only) or all (every user turn, after the target's own earlier answers).
        max_new_tokens: longest answer; longer ones are cut (counted).
        max_length: prompt + answer tokens; a turn without room for a full answer ends its conversation.
        temperature: 0 for greedy answers (what greedy decoding will see); > 0 samples.
        top_p: nucleus filtering when sampling.
        batch_size: prompts generated together (grouped by length).
        dtype: the target's compute dtype.
        device: cpu, cuda, ...
        seed: sampling seed.
        trust_remote_code: allow a hub model's own code to run.
    """
    from rich.console import Console

    from draftsmith.data.regenerate import RegenerateConfig, regenerate as run_regenerate

    cfg = RegenerateConfig(target=target, data=data, out=out, limit=limit, turns=turns, max_new_tokens=max_new_tokens,
                           max_length=max_length, temperature=temperature, top_p=top_p, batch_size=batch_size,
                           dtype=dtype, device=device, seed=seed, trust_remote_code=trust_remote_code)
    summary = run_regenerate(cfg)
    Console().print(f"[bold]regenerated[/] {summary['conversations']} conversations "
                    f"({summary['already_done']} already in {out}): {summary.get('answers', 0)} answers, "
                    f"{summary.get('answer_tokens', 0)} tokens at {summary['answer_tokens_per_second']} tok/s; "
                    f"cut at max_new_tokens {summary.get('answers_cut_at_max_new_tokens', 0)}, empty "
                    f"{summary.get('empty_answers', 0)}, no room {summary.get('turns_without_room', 0)}; "
                    f"next: draftsmith extract --target {target} --data {out} --out DIR")


def export(checkpoint: str, format: str = "native", out: str = "export", speculative_tokens: int = 3) -> None:
    """Export a trained drafter: a .ckpt, a DeepSpeed ZeRO checkpoint directory, or a run directory
    (the checkpoint Lightning's ModelCheckpoint recorded as best; the newest one without a monitor).

    Each export is checked against its consumer's contract (tensor names and shapes, config
    fields), then reloaded and its logits compared with the trained module's.

    Args:
        checkpoint: the Lightning checkpoint or run directory.
        format: native (draftsmith's runtime), eagle (EAGLE-1/2/HASS for vLLM, SGLang, EAGLE code), eagle3 (vLLM, SGLang) or speculators (vLLM).
        out: the output directory.
        speculative_tokens: tokens per proposal written into the speculators config.
    """
    from rich.console import Console

    from draftsmith.export import export as run_export

    result = run_export(checkpoint, format, out, speculative_tokens)
    Console().print(f"[bold]exported[/] {result['kind']} drafter as {result['format']}: "
                    f"{', '.join(result['directories'])} (contract ok, reloaded logits within "
                    f"{result['max_logit_error']:.1e})")


def evaluate_command(target: str, drafter: str | None = None, prompts: str = "mtbench", limit: int | None = None,
         turns: str = "first", data: str = "sharegpt", max_new_tokens: int = 256, temperature: float = 0.0,
         top_k: int | None = None, top_p: float | None = None, policy: str = "cost", k: int = 4,
         threshold: float = 0.4, tree: str | None = None, lookup: int = 0, head_vocab: int = 8192,
         dtype: str = "bfloat16", device: str = "cpu", repeats: int = 3, seed: int = 0, out: str = "runs/eval") -> None:
    """Measure a drafter with its target: τ, mean accepted, α_j, speedup over autoregressive decoding.

    Writes OUT/results.json and PNG plots, and prints a table per category.

    Args:
        target: the target model.
        drafter: a native export directory (`draftsmith export --format native`); omit for autoregressive only.
        prompts: mtbench, humaneval, or heldout (the validation split of --data).
        limit: number of prompts (spread over categories).
        turns: first, or both (MT-bench's second turn after the target's own first answer).
        data: the chat source for heldout prompts.
        max_new_tokens: tokens generated per prompt.
        temperature: 0 for greedy; otherwise sampling with top_k / top_p.
        top_k: top-k filtering (applied to target and drafter alike).
        top_p: nucleus filtering (applied to target and drafter alike).
        policy: draft length: cost (draft a token only while it is expected to pay for its measured
            cost), static, heuristic, confidence or oracle.
        k: draft length (static), starting length (heuristic) or maximum (cost, confidence, oracle).
        threshold: the confidence policy's threshold.
        tree: EAGLE-2 dynamic tree drafting as DEPTH,TOPK,TOKENS (e.g. 5,8,32; feature drafters);
            omit for chain drafts with --policy.
        lookup: with --tree, graft a prompt-lookup branch of up to this many tokens on every tree (the
            tokens that followed the latest earlier occurrence of the text's ending); 0 = off.
        head_vocab: a standalone drafter drafts among its training data's most frequent tokens, its
            head computed over those rows only (exports carry the counts); 0 = the full head.
        dtype: target and drafter dtype (the same for both arms).
        device: cpu or cuda.
        repeats: timed repeats after a warm-up (median reported).
        seed: sampling seed.
        out: the results directory.
    """
    from rich.console import Console

    from draftsmith.eval.evaluate import EvalConfig, evaluate
    from draftsmith.eval.report import plots, table, write_results

    cfg = EvalConfig(target=target, drafter=drafter, prompts=prompts, limit=limit, turns=turns, data=data,
                     max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, policy=policy,
                     k=k, threshold=threshold, tree=tree, lookup=lookup, head_vocab=head_vocab, dtype=dtype,
                     device=device, repeats=repeats, seed=seed, out=out)
    results = evaluate(cfg)
    from pathlib import Path

    path = write_results(results, Path(out))
    pngs = plots(results, Path(out))
    console = Console()
    console.print(table(results))
    console.print(f"results: {path}" + (f"\nplots: {', '.join(pngs)}" if pngs else ""))


def run(recipe: str, prompts: str = "mtbench", limit: int | None = 10, max_new_tokens: int = 128,
        temperature: float = 0.0, policy: str = "cost", k: int = 4, tree: str | None = None, lookup: int = 0,
        dtype: str = "bfloat16", repeats: int = 3, out: str | None = None) -> None:
    """Run a recipe end to end: extract → fit → export → eval; each finished stage is skipped on a rerun.

    Features are extracted when the recipe's feature directory has none (resuming a partial
    extraction); training resumes from the run's last.ckpt and is skipped once max_steps is
    reached; the best checkpoint (by val/tau) is exported in the native format and evaluated.

    Args:
        recipe: the recipe YAML (as for `draftsmith fit --config`).
        prompts: mtbench, humaneval or heldout.
        limit: prompts to evaluate on (spread over categories).
        max_new_tokens: tokens generated per prompt.
        temperature: 0 for greedy decoding.
        policy: draft-length policy: cost, static, heuristic, confidence or oracle.
        k: draft length (or its maximum).
        tree: EAGLE-2 tree drafting as DEPTH,TOPK,TOKENS (e.g. 5,8,32); omit for chain drafts.
        lookup: with --tree, a prompt-lookup branch of up to this many tokens on every tree; 0 = off.
        dtype: dtype of target and drafter during evaluation.
        repeats: timed repeats after a warm-up.
        out: where to write the export and the evaluation (default: the recipe's default_root_dir).
    """
    from rich.console import Console

    from draftsmith.pipeline import run_recipe

    run_recipe(recipe, prompts=prompts, limit=limit, max_new_tokens=max_new_tokens, temperature=temperature,
               policy=policy, k=k, tree=tree, lookup=lookup, dtype=dtype, repeats=repeats, out=out, console=Console())


COMMANDS = {"data": {"stats": data_stats}, "regenerate": regenerate, "extract": extract, "export": export,
            "eval": evaluate_command, "run": run}
LIGHTNING_COMMANDS = ("fit", "validate")


def _not_litlogger_tip(record: Any) -> bool:
    return "litlogger" not in str(record.msg)


def lightning_cli(argv: list[str], run: bool = True) -> Any:
    """`draftsmith fit --config RECIPE [--trainer.max_steps N ...]`: LightningCLI over a recipe.

    The recipe names the LightningModule (`model.class_path`) and DataModule (`data.class_path`);
    `data.init_args.target` follows `model.init_args.target`.
    """
    import logging
    import warnings

    from pytorch_lightning.cli import LightningCLI

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
            # draftsmith's DataModules shard batches across ranks themselves (length-bucketed)
            parser.set_defaults({"trainer.use_distributed_sampler": False})

        def before_instantiate_classes(self) -> None:
            trainer = self._get(self.config, "trainer")
            logger = trainer.logger
            if root_moved and not logger_given and "save_dir" in getattr(logger, "init_args", {}):
                logger.init_args.save_dir = trainer.default_root_dir

    return DraftsmithCLI(args=argv, run=run, subclass_mode_model=True, subclass_mode_data=True,
                         save_config_callback=_config_saver(), save_config_kwargs={"overwrite": True},
                         auto_configure_optimizers=False)


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


def _json_dumps(obj: Any) -> str:
    return json.dumps(obj)


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
    from jsonargparse import CLI

    argv = normalize_argv(list(sys.argv[1:] if argv is None else argv))
    try:
        if argv and argv[0] in LIGHTNING_COMMANDS:
            lightning_cli(argv)
            return
        CLI(COMMANDS, args=argv, as_positional=False)
    except DraftsmithError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted: finished shards (or regenerated chats) are kept; rerun the same command to resume",
              file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
