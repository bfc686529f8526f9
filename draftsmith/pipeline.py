"""`draftsmith run RECIPE`: extract → fit → export → eval, each stage skipped once done."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from draftsmith import DraftsmithError
from draftsmith.eval.evaluate import DecodeOptions


@dataclass(kw_only=True)
class RunConfig(DecodeOptions):
    """Options of `draftsmith run` (DecodeOptions' and these); the evaluation's target, chats and
    validation split come from the recipe.

    Args:
        recipe: the recipe YAML (as for `draftsmith fit --config`).
        out: where to write the run, the export and the evaluation (default: the recipe's default_root_dir).
        limit: prompts to evaluate on (spread over categories).
    """

    recipe: str
    out: str | None = None
    limit: int | None = 10


def _newest(root: Path, pattern: str) -> Path | None:
    found = sorted(root.glob(f"**/{pattern}"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def recipe_eval_config(raw: dict[str, Any], drafter: str | None, out: str, options: DecodeOptions) -> Any:
    """The eval config `run` uses: the recipe's target, and for held-out prompts exactly the recipe's
    validation split (its chats, its data.limit, its data.val_fraction), prompts no longer than the chats it
    trained on (its data.max_length); `options` decode as run was told."""
    from draftsmith.data.conversations import VAL_FRACTION
    from draftsmith.eval.evaluate import EvalConfig

    model, data = raw["model"]["init_args"], raw["data"]["init_args"]
    decode = {f.name: getattr(options, f.name) for f in fields(DecodeOptions)}
    decode["max_prompt_length"] = options.max_prompt_length or data.get("max_length")
    return EvalConfig(target=model["target"], chat_template=model.get("chat_template"),
                      template_kwargs=model.get("template_kwargs"), drafter=drafter, data=data.get("data", "sharegpt"),
                      val_fraction=data.get("val_fraction", VAL_FRACTION), data_limit=data.get("limit"), out=out, **decode)


def _layers_needed(model: dict[str, Any], data: dict[str, Any]) -> list[int]:
    """Hidden-state layers a recipe's feature directory must hold: those the drafter fuses (EAGLE-3's
    default when none are named) and the data's `layer_ids` (layers kept for other recipes sharing it)."""
    from draftsmith.models.registry import DRAFTER_KINDS

    layer_ids = list(model.get("aux_layer_ids") or [])
    kind = DRAFTER_KINDS.get(model.get("kind", ""))
    if kind is not None and kind.fused_layers and not layer_ids:
        from draftsmith.models.target import load_target

        layer_ids = load_target(model["target"]).default_aux_layer_ids()
    return sorted(set(layer_ids) | set(data.get("layer_ids") or []))


def _check_feature_source(out: Path, chats: dict[str, Any], model: dict[str, Any], recipe: Path) -> None:
    """Refuse a feature directory made from other chats than the recipe's `chats` (data, max_length; a
    limit may differ: extraction extends or cuts the directory to the recipe's) or for another target than
    its `model`'s (its name, or its tokenizer and chat template): it would resume or be reused as if it
    were the recipe's."""
    from draftsmith.data.shards import recorded

    source = recorded(out, "data")
    if source is None:
        return
    held = {"data": source["source"], "max_length": recorded(out, "max_length")}
    diffs = [f"{k}: {held[k]!r} there, {chats[k]!r} in the recipe" for k in held if held[k] != chats[k]]
    target = recorded(out, "target") or {}
    if target.get("name") != model["target"]:
        diffs.append(f"target: {target.get('name')!r} there, {model['target']!r} in the recipe")
    else:
        from draftsmith.models.target import load_tokenizer
        from draftsmith.models.tokenizer import tokenizer_hash

        if target.get("tokenizer_hash") != tokenizer_hash(load_tokenizer(model["target"],
                                                                         chat_template=model.get("chat_template"),
                                                                         template_kwargs=model.get("template_kwargs"))):
            diffs.append("the target's tokenizer or chat template (model.init_args.chat_template, template_kwargs) "
                         "differs")
    if diffs:
        raise DraftsmithError(f"{out} holds features of other chats or another target ({'; '.join(diffs)}): set "
                              f"{recipe}'s data.init_args.features_dir to a new directory, or delete {out}")


def ensure_features(recipe: Path, console: Any, title: str = "extract") -> None:
    """Extract an offline recipe's features when its feature directory has none (a partial extraction
    resumes) or holds another number of the chats (it is extended or cut to the recipe's limit: only the
    parts it lacks are extracted), or when it lacks layers the recipe needs: then the directory is
    re-extracted with the layers it held and the new ones (into a sibling folder, swapped in once
    complete), so the recipes that share it keep working."""
    import json
    import shutil

    import yaml

    from draftsmith.data.features import read_manifest
    from draftsmith.data.shards import MANIFEST_FILE, RUN_FILE
    from draftsmith.jobs.extract import ExtractConfig, extract, summary_table

    raw = yaml.safe_load(recipe.read_text())
    model, data = raw["model"]["init_args"], raw["data"]["init_args"]
    if "features_dir" not in data:
        return
    needed = _layers_needed(model, data)
    for mixed in data.get("mix") or []:  # FeatureDataModule's `mix`: more directories, made as each says
        _ensure_mixed(mixed, model, needed, recipe, console, title)
    out = Path(data["features_dir"])
    chats = {"data": data.get("data", "sharegpt"), "limit": data.get("limit"), "max_length": data.get("max_length", 2048)}
    _check_feature_source(out, chats, model, recipe)
    held, lacking = None, False
    if (out / MANIFEST_FILE).is_file():
        manifest = read_manifest(out)
        held = manifest["layer_ids"]
        lacking = not set(needed) <= set(held)
        if not lacking and manifest["data"]["limit"] == chats["limit"]:
            return
    layer_ids = sorted(set(needed) | set(held or []))
    console.rule(f"[bold]{title}")
    dest = out
    if lacking:
        dest = out.with_name(out.name + ".relayered")
        started = dest / RUN_FILE
        if started.is_file() and json.loads(started.read_text()).get("layer_ids") != layer_ids:
            shutil.rmtree(dest)  # a killed re-extraction for other layers: it cannot resume
        console.print(f"{out} holds layers {held}; {recipe} needs {needed}: extracting layers {layer_ids} into "
                      f"{dest}, which replaces it once complete")
    manifest = extract(ExtractConfig(target=model["target"], chat_template=model.get("chat_template"),
                                     template_kwargs=model.get("template_kwargs"), out=str(dest),
                                     layer_ids=layer_ids, **chats))
    if dest != out:
        shutil.rmtree(out)
        dest.rename(out)
    console.print(summary_table(manifest, str(out)))


def _ensure_mixed(mixed: dict[str, Any], model: dict[str, Any], needed: list[int], recipe: Path, console: Any,
                  title: str) -> None:
    """Extract a directory of a recipe's `data.init_args.mix` when it has no features yet (a partial extraction
    resumes); refuse one made from other chats or without the layers the drafter fuses."""
    from draftsmith.data.features import read_manifest
    from draftsmith.data.mixing import MixedFeatures
    from draftsmith.data.shards import MANIFEST_FILE
    from draftsmith.jobs.extract import ExtractConfig, extract, summary_table

    m = MixedFeatures(**mixed)
    out = Path(m.features_dir)
    _check_feature_source(out, {"data": m.data, "max_length": m.max_length}, model, recipe)
    if (out / MANIFEST_FILE).is_file():
        held = read_manifest(out)["layer_ids"]
        if not set(needed) <= set(held):
            raise DraftsmithError(f"{out} (data.mix) holds layers {held}; {recipe} needs {needed}: delete it and "
                                  "rerun, and draftsmith extracts it again")
        return
    console.rule(f"[bold]{title} {out.name}")
    manifest = extract(ExtractConfig(target=model["target"], chat_template=model.get("chat_template"),
                                     template_kwargs=model.get("template_kwargs"), out=str(out), layer_ids=needed,
                                     data=m.data, limit=m.limit, max_length=m.max_length, pack=m.pack))
    console.print(summary_table(manifest, str(out)))


def between_stages() -> None:
    """A stage's objects are gone: collect them and hand their memory back before the next stage loads its own."""
    import gc

    from draftsmith.memory import release_freed_memory

    gc.collect()
    release_freed_memory()


def run_recipe(cfg: RunConfig, console: Any) -> dict[str, Any]:
    import yaml

    from draftsmith.train.cli import lightning_cli
    from draftsmith.eval.evaluate import evaluate
    from draftsmith.eval.report import plots, print_table, write_results
    from draftsmith.export import export
    from draftsmith.train.checkpoints import best_checkpoint, checkpoint_state, training_finished

    path, out = Path(cfg.recipe), cfg.out
    if not path.is_file():
        raise DraftsmithError(f"recipe {cfg.recipe} not found")
    raw = yaml.safe_load(path.read_text())
    trainer = raw["trainer"]
    root = Path(out or trainer.get("default_root_dir") or f"runs/{path.stem}")

    # 1. features (offline recipes)
    ensure_features(path, console, "1/4 extract")
    between_stages()

    # 2. training, resumed from the newest last checkpoint, skipped once its steps or its time were spent
    last = _newest(root, "last*.ckpt")  # last-vN.ckpt: where Lightning had to keep an older last.ckpt
    done = last is not None and training_finished(checkpoint_state(last), trainer.get("max_steps", -1),
                                                  trainer.get("max_time"))
    if not done:
        console.rule("[bold]2/4 fit")
        args = ["--config", str(path)] + (["--trainer.default_root_dir", str(root)] if out else [])
        cli = lightning_cli(args, run=False, resume=last)
        cli.trainer.fit(cli.model, cli.datamodule, ckpt_path=str(last) if last else None)
        del cli
    between_stages()
    best = best_checkpoint(root)  # Lightning's record of the best score, not a file name

    # 3. export
    console.rule("[bold]3/4 export")
    exported = export(str(best), "native", str(root / "export-native"))
    console.print(f"exported {best} → {exported['out']}")

    # 4. evaluation
    console.rule("[bold]4/4 eval")
    eval_cfg = recipe_eval_config(raw, exported["out"], str(root / "eval"), cfg)
    results = evaluate(eval_cfg, console)
    results["checkpoint"] = str(best)
    json_path = write_results(results, Path(eval_cfg.out))
    pngs = plots(results, Path(eval_cfg.out))
    print_table(console, results)
    if "acceptance" in results:  # a --sweep has its rows in the table
        acc, speed = results["acceptance"], results["speed"]
        console.print(f"[bold]τ = {acc['tau']:.2f}[/] (mean accepted {acc['mean_accepted']:.2f}), "
                      f"[bold]speedup = {speed['speedup']:.2f}x[/] over autoregressive decoding "
                      f"({speed['method']['tokens_per_second']:.1f} vs {speed['autoregressive']['tokens_per_second']:.1f} tok/s)")
    console.print(f"results: {json_path}")
    for png in pngs:
        console.print(f"plot: {png}")
    return results
