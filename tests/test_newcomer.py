"""What a newcomer following the README and docs/usage.md met, each held to its mend: the messages say what
happened and what to do."""

from __future__ import annotations

import json

import pytest

from draftsmith import DraftsmithError
from tests.conftest import run_cli, save_tiny_target


def test_ctrl_c_says_what_each_command_keeps(monkeypatch, capsys):
    import draftsmith.cli as cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "dispatch", interrupted)
    for args, says in ((["eval", "--target", "t"], "an eval keeps nothing until it ends"),
                       (["extract", "--target", "t", "--data", "d", "--out", "o"], "finished shards are kept")):
        with pytest.raises(SystemExit) as stop:
            cli.main(args)
        assert stop.value.code == 130 and says in capsys.readouterr().err


def test_a_lossy_mode_names_the_rule_it_runs():
    from draftsmith.eval.evaluate import EvalConfig

    assert EvalConfig(target="", mode="cascade").rule == "chow"  # results.json says which, not null
    assert EvalConfig(target="", mode="bild").rule == "rollback" and EvalConfig(target="").rule is None


def test_a_missing_drafter_directory_is_called_missing(tiny_features, tmp_path):
    result = run_cli("eval", "--target", str(tiny_features / "target"), "--drafter", str(tmp_path / "nowhere"),
                     "--out", str(tmp_path / "e"))
    assert result.returncode == 2 and "no such directory" in result.stderr and "not a drafter export" not in result.stderr


def test_a_drafter_for_another_target_must_be_trained_again(eagle_ckpt, tmp_path):
    from draftsmith.export import export
    from draftsmith.models.loading import load_native
    from draftsmith.models.target import load_target

    export(str(eagle_ckpt), "native", str(tmp_path / "d"))
    other = load_target(str(save_tiny_target(tmp_path / "other", seed=3)), dtype="float32")
    with pytest.raises(DraftsmithError, match="trained for another target.*train one for this target") as refused:
        load_native(tmp_path / "d", other)
    assert "re-export" not in str(refused.value)


def test_help_lists_fit_and_its_trainer_options_say_what_they_do(capsys):
    from draftsmith.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    assert "fit                 Train a drafter" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--trainer.accelerator ACCELERATOR \"cpu\", \"gpu\"" in shown and "whichever trains faster" in shown


def test_outputs_that_differ_state_the_agreement_once():
    from rich.console import Console

    from draftsmith.eval.report import table

    results = {"config": {"prompts": "mtbench", "drafter": "d", "target": "t", "mode": "exact", "dtype": "bfloat16"},
               "acceptance": {"tau": 2.0, "mean_accepted": 1.0, "alpha": [0.5]},
               "speed": {"valid": True, "speedup": 1.5, "repeats": 1, "method": {"tokens_per_second": 3.0},
                         "autoregressive": {"tokens_per_second": 2.0}},
               "per_category": {}, "quality": {"agreement": 0.8}}
    shown = Console(record=True, width=400)
    shown.print(table(results))
    text = shown.export_text()
    assert "OUTPUTS DIFFER" in text and text.count("agreement") == 1


def test_run_takes_the_prompt_length_and_a_too_short_one_says_what_to_raise(tiny_features, tmp_path):
    from draftsmith.pipeline import RunConfig

    assert RunConfig(recipe="r.yaml", max_prompt_length=900).max_prompt_length == 900
    chats = tmp_path / "chats.json"
    chats.write_text(json.dumps(json.loads((tiny_features / "chats.json").read_text())[:20]))
    result = run_cli("eval", "--target", str(tiny_features / "target"), "--prompts", "heldout", "--data", str(chats),
                     "--val_fraction", "0.5", "--max_prompt_length", "2", "--out", str(tmp_path / "e"))
    assert result.returncode == 2 and "heldout prompts is at most --max_prompt_length 2" in result.stderr
    assert "give a larger --max_prompt_length" in result.stderr
