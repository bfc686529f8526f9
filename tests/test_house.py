"""The house rules, checked: imports run one way, a kind is a registry entry, files stay readable."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from draftsmith import DraftsmithError
from draftsmith.models.registry import DRAFTER_KINDS, FORMATS, HEAD_KINDS, check_format

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "draftsmith"
MAX_LINES = 400


def test_imports_run_one_way(capsys):
    """pyproject.toml's import-linter contracts: each layer imports only the ones below it."""
    from importlinter.cli import lint_imports

    code = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True)
    assert code == 0, capsys.readouterr().out


def test_drafter_kinds_are_named_only_in_the_registry_and_the_model_modules():
    pattern = re.compile(r'"(?:p?eagle3?|dflash|dspark|standalone)"')
    allowed = {PACKAGE / "models" / "registry.py"}
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in PACKAGE.rglob("*.py") if p not in allowed
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "kind names tested outside models/registry.py:\n" + "\n".join(found)


def test_no_module_is_longer_than_a_reading():
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by concept): {long}"


def test_make_help_names_every_target():
    import subprocess

    makefile = (ROOT / "Makefile").read_text()
    targets = re.search(r"^\.PHONY:(.*)$", makefile, re.M).group(1).split()
    shown = subprocess.run(["make", "-s", "-C", str(ROOT), "help"], capture_output=True, text=True, check=True).stdout
    named = {line.split()[1] for line in shown.splitlines() if line.startswith("make ")}
    assert set(targets) - {"help"} <= named, f"`make help` leaves out {sorted(set(targets) - {'help'} - named)}"


@pytest.mark.parametrize("name", sorted(DRAFTER_KINDS))
def test_every_drafter_kind_names_classes_that_exist_and_formats_that_are_written(name):
    from draftsmith.export import writers

    kind = DRAFTER_KINDS[name]
    assert kind.formats[0] == "native" and set(kind.formats) <= set(writers()) == set(FORMATS)
    if kind.reads_features:  # built from a target by the constructor every feature drafter shares
        assert callable(kind.model_class.from_target)
    else:
        assert kind.trainer_class.kind is kind
    for fmt in FORMATS:
        if fmt in kind.formats:
            check_format(kind, fmt)
        else:
            with pytest.raises(DraftsmithError, match=f"this is {kind.title}"):
                check_format(kind, fmt)


@pytest.mark.parametrize("name", sorted(HEAD_KINDS))
def test_every_head_kind_builds_from_its_config_and_decodes_as_a_policy(name):
    from dataclasses import asdict

    from draftsmith.runtime.policies import POLICY_KINDS, make_policy

    kind = HEAD_KINDS[name]
    head = kind.build({"hidden_size": 8} if name == "specdec" else {})
    assert head.kind == name and kind.build(asdict(head.config)).config == head.config
    policy = POLICY_KINDS[name]  # the policy that decodes with it carries its name and builds from the head
    assert policy.head_kind is kind and make_policy(name, head=head, threshold=0.5, k=3).name == name


def test_policy_names_are_compared_only_in_the_policy_registry():
    """A policy is a registry entry (`runtime.policies.POLICY_KINDS`): what it needs and how it is tuned are
    its attributes, so no code outside the registry tests which policy it has by its name."""
    from draftsmith.runtime.policies import POLICY_KINDS

    names = "|".join(POLICY_KINDS)
    literal = rf'"(?:{names})"'
    compared = re.compile(rf'(?:==|!=)\s*{literal}|{literal}\s*(?:==|!=)|policy[\w.]*\s+(?:not\s+)?in\s*\([^)]*{literal}'
                          rf'|policy[\w.]*\s*(?:==|!=)\s*\w')
    allowed = {PACKAGE / "runtime" / "policies.py"}
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in [*PACKAGE.rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
             if p not in allowed for i, line in enumerate(p.read_text().splitlines(), 1) if compared.search(line)]
    assert not found, "policy names compared outside runtime/policies.py:\n" + "\n".join(found)


def test_every_policy_builds_from_its_settings_with_its_name():
    from draftsmith.runtime.policies import POLICY_KINDS, PolicySettings

    for name, kind in POLICY_KINDS.items():
        settings = PolicySettings(k=3, threshold=0.5, references={(): ([1, 2], {})})
        assert kind.build(settings)([]).name == name
        assert (kind.tune == "decode") == bool(kind.grid and kind.ks)
        assert kind.head is None or kind.tuned  # eval reads a head's settings where it reads tuned ones
