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


FIGURES = DOCS / "benchmarks.md"
MAX_FIGURES_CHARS = 40_000
MAX_CELL = 300


def tables(text: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """(section heading, header cells, rows of cells) of every markdown table, in order."""
    found, heading, block = [], "", []

    def close():
        if block:
            cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in block]
            found.append((heading, cells[0], [r for r in cells[2:]]))
        block.clear()

    for line in text.splitlines():
        if line.startswith("#"):
            close()
            heading = line.lstrip("#").strip()
        elif line.startswith("|"):
            block.append(line)
        else:
            close()
    close()
    return found


def test_the_figures_file_is_one_short_row_per_benchmark_and_machine_kind():
    """docs/benchmarks.md: every table names a known machine kind and a date per row, each (variant, machine
    kind) once per section, cells short enough to read at a glance, no commit hashes, the page under its
    size; the full rows are kept in docs/results/, and each link there resolves."""
    text = FIGURES.read_text()
    assert len(text) <= MAX_FIGURES_CHARS, f"benchmarks.md is {len(text)} characters (at most {MAX_FIGURES_CHARS})"
    found = tables(text)
    kinds = {row[0] for heading, header, rows in found if heading == "Machine kinds" for row in rows}
    assert {"Intel Xeon", "AMD EPYC", "AMD EPYC AVX2", "NVIDIA H100"} <= kinds
    figures = [(h, header, rows) for h, header, rows in found if h != "Machine kinds"]
    assert len(figures) >= 20
    for heading, header, rows in figures:
        assert "machine" in header and "date" in header, f"{heading}: a table needs machine and date columns"
        m, d = header.index("machine"), header.index("date")
        keys = [tuple(row[:m + 1]) for row in rows]
        assert len(keys) == len(set(keys)), f"{heading}: more than one row for {[k for k in keys if keys.count(k) > 1]}"
        for row in rows:
            assert len(row) == len(header), f"{heading}: row {row[:2]} has {len(row)} cells, the header {len(header)}"
            assert row[m] in kinds, f"{heading}: {row[m]!r} is not a machine kind of the page's table"
            assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", row[d]), f"{heading}: date {row[d]!r}"
            long = [c for c in row if len(c) > MAX_CELL]
            assert not long, f"{heading}: a cell of {len(long[0])} characters (at most {MAX_CELL}): {long[0][:80]}…"
    hashes = re.findall(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b", text)
    assert not hashes, f"benchmarks.md names commits {hashes}: a row says what it measures, not when it was coded"
    for link in re.findall(r"\]\(((?:results|img)/[^)#]+)", text):
        assert (DOCS / link).exists(), f"benchmarks.md links {link}, which does not exist"


def test_the_usage_guide_stays_a_guide():
    lines = len((DOCS / "usage.md").read_text().splitlines())
    assert lines <= 300, f"docs/usage.md is {lines} lines: move the details to a reference page"


OTHER_PROGRAMS_OPTIONS = {  # vLLM's, SGLang's, torchrun's and nvidia-smi's own spellings, which are theirs to choose
    "--served-model-name", "--max-model-len", "--speculative-config", "--speculative-algorithm", "--speculative-num-steps",
    "--speculative-num-draft-tokens", "--speculative-eagle-topk", "--speculative-draft-model-path", "--model-path",
    "--nproc-per-node", "--query-gpu"}


def test_every_option_is_spelled_one_way_in_the_docs_and_the_benchmarks():
    """draftsmith's commands and its benchmarks spell options with underscores (`--max_new_tokens`); both also
    take the hyphens, so a page never needs them."""
    option = re.compile(r"(?<![\w`#(-])--[a-z0-9]+(?:-[a-z0-9]+)+(?![\w-])")
    files = [*PAGES, *sorted((ROOT / "benchmarks").glob("*.py"))]
    found = sorted({(f.name, m) for f in files for m in option.findall(f.read_text())} - {
        (f.name, m) for f in files for m in OTHER_PROGRAMS_OPTIONS})
    assert not found, f"options spelled with hyphens: {found}"
