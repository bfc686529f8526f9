"""The command map: each command's options are its config dataclass's fields, stated once and documented."""

import re
from dataclasses import fields

import pytest

from draftsmith.cli import COMMANDS, main


def commands(entries=COMMANDS, prefix=()):
    for name, entry in entries.items():
        if isinstance(entry, dict):
            yield from commands(entry, prefix + (name,))
        else:
            yield prefix + (name,), entry


@pytest.mark.parametrize("path,entry", list(commands()), ids=[" ".join(p) for p, _ in commands()])
def test_options_are_the_config_fields_each_with_its_help(path, entry, capsys):
    config, command = entry
    with pytest.raises(SystemExit) as done:
        main([*path, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    options = set(re.findall(r"^\s+--(\w+)", out, re.M)) - {"help"}
    assert options == {f.name for f in fields(config)}
    assert command.__doc__.split("\n")[0][:40] in " ".join(out.split())
    documented = "".join(c.__doc__ or "" for c in config.__mro__)
    assert all(f"{f.name}:" in documented for f in fields(config)), config


@pytest.mark.parametrize("command, positional", [("run", "RECIPE"), ("export", "CHECKPOINT")])
def test_a_positional_argument_is_shown_as_one(command, positional, capsys):
    """`draftsmith run RECIPE` is the README's form: the usage line gives it, not a required --recipe."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert capsys.readouterr().out.startswith(f"usage: draftsmith {command} {positional} [options]")


def test_a_config_check_is_a_clear_error_from_the_command_line(capsys):
    with pytest.raises(SystemExit) as done:
        main(["eval", "--target", "x", "--lookup", "4"])
    assert done.value.code == 2
    assert "--lookup grafts a branch on EAGLE-2 trees" in capsys.readouterr().err


def test_the_command_map_imports_no_torch():
    """`draftsmith --help` and `data stats` start without loading torch: the config classes stay light."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "import sys, draftsmith.cli; "
                          "print(sorted(m for m in ('torch', 'transformers', 'pytorch_lightning') if m in sys.modules))"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]
