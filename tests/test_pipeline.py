import json

import pytest
import yaml

from draftsmith import DraftsmithError

from tests.conftest import run_cli, sample_chats, save_tiny_target
from tests.conftest import recipe


def validation_ids(cfg: dict) -> list[str]:
    """The conversation ids the training run validated on (its DataModule's split)."""
    from draftsmith.data.modules import FeatureDataModule

    args = {k: v for k, v in cfg["data"]["init_args"].items() if k in ("features_dir", "val_fraction", "max_tokens")}
    dm = FeatureDataModule(**args)
    dm.setup("fit")
    return [dm.dataset.ids[i] for i in dm.val_indices]


def test_heldout_prompts_are_exactly_the_recipe_validation_split(tmp_path):
    from draftsmith.eval.evaluate import DecodeOptions
    from draftsmith.eval.prompts import load_prompts
    from draftsmith.jobs.extract import ExtractConfig, extract
    from draftsmith.pipeline import recipe_eval_config

    root = tmp_path / "tiny"
    save_tiny_target(root / "target")
    (root / "chats.json").write_text(json.dumps(sample_chats(60)))
    path = recipe(root, tmp_path)
    cfg = yaml.safe_load(path.read_text())
    cfg["data"]["init_args"].update(data=str(root / "chats.json"), limit=50, val_fraction=0.3)
    extract(ExtractConfig(target=str(root / "target"), data=str(root / "chats.json"), out=str(root / "features"),
                          max_length=256, limit=50, dtype="float32", feature_dtype="float32"))
    eval_cfg = recipe_eval_config(cfg, None, str(tmp_path / "eval"), DecodeOptions(prompts="heldout"))
    prompts = load_prompts(eval_cfg.prompts, None, "first", eval_cfg.data, eval_cfg.val_fraction, eval_cfg.data_limit)
    expected = validation_ids(cfg)
    assert len(expected) >= 5 and [p["id"] for p in prompts] == expected
    # no prompt longer than the chats the drafter trained on (the recipe's data.max_length)
    cfg["data"]["init_args"]["max_length"] = 40
    eval_cfg = recipe_eval_config(cfg, None, str(tmp_path / "eval"), DecodeOptions(prompts="heldout"))
    assert eval_cfg.max_prompt_length == 40
    longer = recipe_eval_config(cfg, None, str(tmp_path / "eval"), DecodeOptions(prompts="heldout", max_prompt_length=900))
    assert longer.max_prompt_length == 900  # `run --max_prompt_length` overrides the recipe's
    short = load_prompts(eval_cfg.prompts, None, "first", eval_cfg.data, eval_cfg.val_fraction, eval_cfg.data_limit,
                         lambda p: len(p["turns"][0]) < 30)
    assert [p["id"] for p in short] == [p["id"] for p in prompts if len(p["turns"][0]) < 30] != expected


def test_run_goes_end_to_end_and_skips_finished_stages(tmp_path):
    root = tmp_path / "tiny"
    save_tiny_target(root / "target")
    (root / "chats.json").write_text(json.dumps(sample_chats(40)))
    path = recipe(root, tmp_path, kind="eagle3", aux_layer_ids=[0, 1, 2], draft_vocab_size=40)
    cfg = yaml.safe_load(path.read_text())
    cfg["data"]["init_args"].update(data=str(root / "chats.json"), max_length=256)  # features: not there yet
    cfg["trainer"]["max_steps"] = 3
    path.write_text(yaml.safe_dump(cfg))
    args = ["run", str(path), "--prompts", "heldout", "--limit", "2", "--max_new_tokens", "8", "--repeats", "1",
            "--dtype", "float32"]
    first = run_cli(*args, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "1/4 extract" in first.stdout and "2/4 fit" in first.stdout and "speedup =" in first.stdout
    assert (root / "features" / "manifest.json").is_file()
    results = json.loads((tmp_path / "run" / "eval" / "results.json").read_text())
    assert results["config"]["drafter"].startswith("eagle3") and results["acceptance"]["rounds"] > 0
    # held-out prompts are the recipe's own validation chats, not the embedded ShareGPT's
    assert results["config"]["data"] == str(root / "chats.json")
    assert set(results["config"]["prompt_ids"]) <= set(validation_ids(cfg)) and results["config"]["prompt_ids"]
    # Lightning names a last checkpoint last-v1.ckpt where an older last.ckpt was in its way: still the run's last
    (tmp_path / "run" / "ckpt" / "last.ckpt").rename(tmp_path / "run" / "ckpt" / "last-v1.ckpt")
    again = run_cli(*args, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "1/4 extract" not in again.stdout and "2/4 fit" not in again.stdout and "4/4 eval" in again.stdout


def test_a_shared_feature_directory_is_re_extracted_with_the_layers_a_recipe_adds(tmp_path):
    from rich.console import Console

    from draftsmith.data.features import read_manifest
    from draftsmith.pipeline import ensure_features

    root = tmp_path / "tiny"
    save_tiny_target(root / "target")
    (root / "chats.json").write_text(json.dumps(sample_chats(12)))

    def shared(name, data_layers=None, **model):
        path = recipe(root, tmp_path / name, **model)
        cfg = yaml.safe_load(path.read_text())
        cfg["data"]["init_args"].update(data=str(root / "chats.json"), max_length=128)
        if data_layers is not None:
            cfg["data"]["init_args"]["layer_ids"] = data_layers
        path.write_text(yaml.safe_dump(cfg))
        return path

    console, features = Console(quiet=True), root / "features"
    ensure_features(shared("eagle"), console)  # EAGLE fuses no layers
    first = read_manifest(features)
    assert first["layer_ids"] == []
    stale = root / "features.relayered"  # a re-extraction for other layers, killed: started over
    stale.mkdir()
    (stale / "run.json").write_text(json.dumps({"layer_ids": [1]}))
    ensure_features(shared("eagle3", kind="eagle3", aux_layer_ids=[0, 2]), console)
    second = read_manifest(features)
    assert second["layer_ids"] == [0, 2] and second["num_tokens"] == first["num_tokens"]
    assert not (root / "features.relayered").exists()
    ensure_features(shared("eagle-keeps-1", data_layers=[1]), console)  # the layers held before are kept
    assert read_manifest(features)["layer_ids"] == [0, 1, 2]
    stamp = (features / "manifest.json").stat().st_mtime_ns
    ensure_features(shared("eagle3-again", kind="eagle3", aux_layer_ids=[0, 2]), console)  # nothing missing
    assert (features / "manifest.json").stat().st_mtime_ns == stamp
    other = shared("other-chats")  # the same directory named by a recipe of other chats: refused, not reused
    cfg = yaml.safe_load(other.read_text())
    cfg["data"]["init_args"].update(limit=5, max_length=64)
    other.write_text(yaml.safe_dump(cfg))
    with pytest.raises(DraftsmithError, match=r"holds features of other chats or another target \(max_length: 128 "
                                              r"there, 64 in the recipe\)"):
        ensure_features(other, console)
    cfg["data"]["init_args"].update(max_length=128)  # fewer of the same chats: the directory is cut to them
    other.write_text(yaml.safe_dump(cfg))
    ensure_features(other, console)
    assert read_manifest(features)["num_records"] == 5 and read_manifest(features)["layer_ids"] == [0, 1, 2]
    cfg["data"]["init_args"].update(limit=None, max_length=128)  # the same chats, for another target
    cfg["model"]["init_args"]["target"] = str(save_tiny_target(root / "other-target", seed=1))
    other.write_text(yaml.safe_dump(cfg))
    with pytest.raises(DraftsmithError, match=r"another target \(target: '.*/target' there, '.*/other-target' in"):
        ensure_features(other, console)
    cfg["model"]["init_args"].update(target=str(root / "target"), chat_template="llama3")  # another template
    other.write_text(yaml.safe_dump(cfg))
    with pytest.raises(DraftsmithError, match=r"another target \(the target's tokenizer or chat template"):
        ensure_features(other, console)


def test_a_recipes_mixed_directories_are_extracted_as_each_says_and_trained_on(tmp_path):
    """`data.init_args.mix`: `run` extracts each mixed directory as its entry says (here the same chats packed
    two to a sequence), and fit trains on both directories."""
    from rich.console import Console

    from draftsmith.data.features import read_manifest
    from draftsmith.pipeline import ensure_features

    root = tmp_path / "tiny"
    save_tiny_target(root / "target")
    (root / "chats.json").write_text(json.dumps(sample_chats(12)))
    path = recipe(root, tmp_path / "mixed", kind="eagle3", aux_layer_ids=[0, 2])
    cfg = yaml.safe_load(path.read_text())
    packed = root / "packed"
    cfg["data"]["init_args"].update(data=str(root / "chats.json"), max_length=128, max_tokens=512, mix=[
        {"features_dir": str(packed), "weight": 0.5, "data": str(root / "chats.json"), "max_length": 256,
         "pack": 256}])
    path.write_text(yaml.safe_dump(cfg))
    ensure_features(path, Console(quiet=True))
    short, long = read_manifest(root / "features"), read_manifest(packed)
    assert long["layer_ids"] == short["layer_ids"] == [0, 2] and long["data"]["pack"] == 256
    assert long["num_records"] < short["num_records"] and long["num_tokens"] >= short["num_tokens"]
    done = run_cli("fit", "--config", str(path), "--trainer.max_steps", "2", "--trainer.val_check_interval", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    cfg["data"]["init_args"]["mix"][0]["max_length"] = 512  # the directory is of other chats now: refused
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(DraftsmithError, match="max_length: 256 there, 512 in the recipe"):
        ensure_features(path, Console(quiet=True))
