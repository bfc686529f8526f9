"""Whether a timing was this machine's alone: the CPU time other processes took while ours was timed.

A speedup is a ratio of two timed arms; when another process takes a core, both arms slow but not alike, and
the ratio is not the machine's. The 1-minute load average cannot tell: it lags a minute behind (a busy core
for the whole of a short run leaves it under the core count; a job that has just ended keeps it high) and it
counts our own threads. `CpuShare` reads the kernel's counters (Linux `/proc/stat` and `/proc/self/stat`)
around the timed work instead: the machine's busy time (the host's steal included) less our process's, over
the wall time × the CPUs. Elsewhere it reads nothing and the load average is all there is.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

OTHERS_LIMIT = 0.25  # other processes may take at most this share of the machine's CPU time while arms are timed


def cpu_times() -> tuple[float, float, int] | None:
    """(busy seconds of every CPU, seconds of this process and its children, CPUs), or None without /proc."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
        mine = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in lines[0].split()[1:9])
    cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    ours = sum(int(x) for x in mine[11:15])  # utime, stime, cutime, cstime
    return (user + nice + system + irq + softirq + steal) / tick, ours / tick, cpus


class CpuShare:
    """`with CpuShare() as share:` around timed work; then `share.others`: the share of the machine's CPU time
    (0 to 1) other processes took meanwhile, or None where the counters cannot be read."""

    def __init__(self) -> None:
        self.others: float | None = None

    def __enter__(self) -> "CpuShare":
        self._start, self._wall = cpu_times(), time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        end, wall = cpu_times(), time.monotonic() - self._wall
        if self._start is None or end is None or wall <= 0:
            return
        (busy0, ours0, cpus), (busy1, ours1, _) = self._start, end
        self.others = round(min(1.0, max(0.0, (busy1 - busy0 - (ours1 - ours0)) / (wall * cpus))), 3)


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def cpu_model() -> str:
    """The CPU's model name, as /proc/cpuinfo says (else what `platform` knows)."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        name = None
    return name or platform.processor() or platform.machine()


def cpu_name() -> str:
    """The CPU's model name and core count (what a measured cost profile was timed on)."""
    return f"{cpu_model()}, {os.cpu_count()} cores"
