"""Progress bars that still report when their stream is not a terminal.

rich draws a live bar on a terminal and, on a redirected or backgrounded stream, only the final state
when the job ends: `make demo > log` would show nothing for the minutes an extraction takes. `Bars` is
rich's `Progress` that, off a terminal, also prints a plain line for each task every `every_seconds`:
its name, count, the fields its columns show, the time elapsed and an estimate of what is left.
"""

from __future__ import annotations

import time
from typing import Any

from rich.progress import Progress, TaskID

REPORT_SECONDS = 30.0


def clock(seconds: float) -> str:
    """`m:ss`, or `h:mm:ss` from an hour."""
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"


class Bars(Progress):
    """rich's `Progress`; off a terminal, a line per task every `every_seconds` (REPORT_SECONDS by default)
    as it advances."""

    def __init__(self, *columns: Any, every_seconds: float | None = None, **kwargs: Any):
        super().__init__(*columns, **kwargs)
        self.every = REPORT_SECONDS if every_seconds is None else every_seconds
        self._reported: dict[TaskID, float] = {}

    def update(self, task_id: TaskID, **kwargs: Any) -> None:
        super().update(task_id, **kwargs)
        self._report(task_id)

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._report(task_id)

    def _report(self, task_id: TaskID) -> None:
        if self.disable or self.console.is_terminal:
            return
        now = time.monotonic()
        last = self._reported.setdefault(task_id, now)
        if now - last < self.every:
            return
        self._reported[task_id] = now
        task = self._tasks[task_id]
        done = f"{task.completed:g}/{task.total:g}" if task.total is not None else f"{task.completed:g}"
        fields = [f"{key} {value}" for key, value in task.fields.items()]
        left = f", ~{clock(task.time_remaining)} left" if task.time_remaining is not None else ""
        line = "  ".join([f"{time.strftime('%H:%M:%S')} {task.description} {done}", *fields,
                          f"{clock(task.elapsed or 0.0)} elapsed{left}"])
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)
