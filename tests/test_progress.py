import io
import re

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn

from draftsmith.jobs.extract import extract
from draftsmith.progress import Bars, clock
from tests.test_extract import cfg


def bars(console, every):
    return Bars(TextColumn("[bold]job"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
                console=console, every_seconds=every)


def test_off_a_terminal_each_task_reports_plain_lines_on_its_interval():
    out = io.StringIO()
    with bars(Console(file=out, force_terminal=False), 0.0) as progress:
        task = progress.add_task("work", total=4, rate="-")
        for i in range(4):
            progress.update(task, advance=1, rate=f"{i * 10} tok/s")
    lines = [line for line in out.getvalue().splitlines() if re.match(r"\d\d:\d\d:\d\d ", line)]
    assert len(lines) == 4
    assert re.search(r"work 1/4  rate 0 tok/s  0:00 elapsed", lines[0]) and "work 4/4  rate 30 tok/s" in lines[3]

    quiet = io.StringIO()  # the interval not yet passed: nothing but rich's own final bar
    with bars(Console(file=quiet, force_terminal=False), 3600.0) as progress:
        task = progress.add_task("work", total=4, rate="-")
        progress.advance(task, 4)
    assert not re.search(r"^\d\d:\d\d:\d\d ", quiet.getvalue(), re.M)


def test_on_a_terminal_only_the_bar_draws():
    out = io.StringIO()
    with bars(Console(file=out, force_terminal=True), 0.0) as progress:
        task = progress.add_task("work", total=2, rate="-")
        progress.advance(task, 2)
    assert "elapsed" not in out.getvalue()


def test_a_redirected_extraction_reports_as_it_goes(tiny_target_dir, chats_file, tmp_path, monkeypatch):
    from draftsmith import progress

    monkeypatch.setattr(progress, "REPORT_SECONDS", 0.0)
    out = io.StringIO()
    extract(cfg(tiny_target_dir, chats_file, tmp_path / "f"), console=Console(file=out, force_terminal=False))
    lines = [line for line in out.getvalue().splitlines() if " elapsed" in line]
    assert lines and all(re.search(r"extract \d+/\d+  rate [\d,]+ tok/s", line) for line in lines[1:])


def test_clock_reads_minutes_then_hours():
    assert clock(75) == "1:15" and clock(3725) == "1:02:05"
