"""benchmarks/harness.py: a trained arm is reused only under the settings and recipe contents it was trained with."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from harness import changed_options, kept_arm  # noqa: E402


def test_a_kept_arm_is_reused_until_its_settings_or_its_recipe_change(tmp_path):
    recipe, done, record = tmp_path / "recipe.yaml", tmp_path / "trained.ckpt", tmp_path / "arm.json"
    recipe.write_text("model:\n  alignment_steps: 3\n")
    key, kept = kept_arm(done, record, recipe, overrides=["--x", "1"], minutes=8)
    assert kept is None  # nothing trained yet
    done.write_bytes(b"weights")
    record.write_text(json.dumps({"key": key, "steps": 40}))
    assert kept_arm(done, record, recipe, overrides=["--x", "1"], minutes=8)[1] == {"key": key, "steps": 40}
    assert kept_arm(done, record, recipe, overrides=["--x", "2"], minutes=8)[1] is None
    recipe.write_text("model:\n  alignment_steps: 2\n")  # the same path, edited
    assert kept_arm(done, record, recipe, overrides=["--x", "1"], minutes=8)[1] is None
    recipe.write_text("model:\n  alignment_steps: 3\n")
    done.unlink()  # a record without its weights is not an arm
    assert kept_arm(done, record, recipe, overrides=["--x", "1"], minutes=8)[1] is None


def test_a_setting_may_name_the_recipe_as_drafter_kinds_does(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model: {}\n")
    key, kept = kept_arm(tmp_path / "trained.ckpt", tmp_path / "arm.json", recipe, recipe="recipes/x.yaml")
    assert kept is None and key["recipe"] == "recipes/x.yaml" and len(key["recipe_sha256"]) == 64


@pytest.mark.parametrize("kinds, says", [("eagle3,dsprak", "--kinds: dsprak; the arms are eagle3, eagle31"),
                                         ("", "--kinds: no arm named")])  # no arm and no --lever
def test_drafter_kinds_stops_on_an_arm_it_does_not_have_before_it_trains(tmp_path, kinds, says):
    import subprocess

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "drafter_kinds.py"
    run = subprocess.run([sys.executable, str(script), "--kinds", kinds, "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert says in run.stderr
    assert not any(tmp_path.iterdir())  # nothing extracted or trained


def test_a_lever_is_an_eagle3_arm_with_its_overrides_and_a_malformed_one_is_refused():
    from drafter_kinds import ARMS, EAGLE3, lever_arms

    arms = lever_arms(["min_lr=--model.init_args.min_lr_ratio 0.0", "ema=--trainer.callbacks+=EMAWeightAveraging "
                       "--trainer.callbacks.decay=0.98"])
    assert arms == {"min_lr": (EAGLE3, ("--model.init_args.min_lr_ratio", "0.0"), 3, None),
                    "ema": (EAGLE3, ("--trainer.callbacks+=EMAWeightAveraging", "--trainer.callbacks.decay=0.98"),
                            3, None)}
    assert "min_lr" not in ARMS  # the script's own arms stay as they are until main adds the levers
    for spec, says in (("min_lr", "expected NAME=OVERRIDES"), ("Min=--x 1", "not a lower-case name"),
                       ("dspark=--x 1", "dspark is already an arm"), ("b=", "must start with an option"),
                       ("c=min_lr_ratio 0", "must start with an option")):
        with pytest.raises(SystemExit, match=says):
            lever_arms([spec])
    with pytest.raises(SystemExit, match="a is already an arm"):
        lever_arms(["a=--x 1", "a=--x 2"])


def test_drafter_kinds_stops_on_a_malformed_lever_before_it_trains(tmp_path):
    import subprocess

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "drafter_kinds.py"
    run = subprocess.run([sys.executable, str(script), "--kinds", "eagle3", "--lever", "min_lr_ratio 0.0",
                          "--train-only", "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "--lever min_lr_ratio 0.0: expected NAME=OVERRIDES" in run.stderr
    assert not any(tmp_path.iterdir())


def test_a_kept_checkpoint_names_the_options_the_code_has_changed_since(tmp_path):
    import torch

    done = tmp_path / "trained.ckpt"
    torch.save({"hyper_parameters": {"_class_path": "x", "lr": 0.003, "betas": [0.9, 0.99], "label": "sampled"}},
               done)
    assert changed_options(done, {"lr": 0.003, "betas": [0.9, 0.99], "label": "sampled"}) == []
    # an option the code no longer has, one it has gained, one whose value (a default) moved
    assert changed_options(done, {"lr": 0.001, "betas": [0.9, 0.99], "gamma": 1}) == ["gamma", "label", "lr"]


def test_a_kept_arm_trained_with_other_options_than_the_module_built_now_trains_again(tmp_path):
    import torch

    recipe, done, record = tmp_path / "recipe.yaml", tmp_path / "trained.ckpt", tmp_path / "arm.json"
    recipe.write_text("model: {}\n")
    key, _ = kept_arm(done, record, recipe, minutes=8)
    torch.save({"hyper_parameters": {"lr": 0.003, "label": "sampled"}}, done)
    record.write_text(json.dumps({"key": key, "steps": 40}))
    assert kept_arm(done, record, recipe, options={"lr": 0.003, "label": "sampled"}, minutes=8)[1] == \
        {"key": key, "steps": 40}
    assert kept_arm(done, record, recipe, options={"lr": 0.003}, minutes=8)[1] is None  # `label` since removed


def test_an_arm_trained_again_drops_the_old_weights_and_log_before_it_trains(tmp_path, monkeypatch):
    """A retrain killed part way leaves no old checkpoint and record beside the new run's log, which a later run
    would otherwise take for one arm."""
    from types import SimpleNamespace

    import drafter_kinds

    (tmp_path / "trained.ckpt").write_bytes(b"old weights")
    (tmp_path / "arm.json").write_text(json.dumps({"key": {"minutes": 1}, "trained_steps": 9}))  # another key
    (tmp_path / "train.log").write_text("the old run's lines\n")

    def killed(*args, **kwargs):
        assert not any(tmp_path.iterdir())  # gone before the first step
        raise KeyboardInterrupt

    cli = SimpleNamespace(model=SimpleNamespace(hparams={}), trainer=SimpleNamespace(fit=killed), datamodule=None)
    monkeypatch.setattr(drafter_kinds, "build", lambda *args, **kwargs: cli)
    with pytest.raises(KeyboardInterrupt):
        drafter_kinds.train_arm("eagle3", 2.0, tmp_path)
    assert not any(tmp_path.iterdir())


def test_a_benchmark_takes_its_options_as_the_commands_spell_them_and_with_hyphens():
    from harness import parser

    ap = parser(None)
    ap.add_argument("--max_new_tokens", type=int, default=1)
    assert ap.parse_args(["--max-new-tokens", "7"]).max_new_tokens == 7
    assert ap.parse_args(["--max_new_tokens=9"]).max_new_tokens == 9
