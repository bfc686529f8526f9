"""The docs, checked: commands a page shows run as typed, the figures file stays a table a user can read,
the usage guide stays a guide."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def test_the_engines_commands_the_docs_show_are_the_ones_the_engine_tests_run():
    """vLLM's CPU build installs a `vllm` script that dies (PackageNotFoundError: it looks for a package
    named vllm): a page may show `.venv-engines/bin/python [-m MODULE]` (MODULE one the engines tests start)
    or draftsmith's own script there, which they run as `-m draftsmith.cli`."""
    started = {m for p in (ROOT / "tests" / "engines").glob("*.py")
               for m in re.findall(r'"-m", "([\w.]+)"', p.read_text())}
    shown = [(page.name, program, module) for page in PAGES
             for program, module in re.findall(r"\.venv-engines/bin/(\S+)(?: -m ([\w.]+))?", page.read_text())]
    assert shown, "the docs show no command to run in .venv-engines"
    wrong = [(page, program, module) for page, program, module in shown
             if program not in ("python", "draftsmith") or (module and module not in started)]
    assert not wrong, f"commands the engines tests never run: {wrong} (they start {sorted(started)})"
