"""Handing freed memory back to the system between training steps and between a run's stages.

A training step's tensors change shape with every packed batch. glibc keeps freed blocks in its heap
(it raises its mmap threshold to the largest block freed so far, up to 32 MiB), and the blocks a step
keeps — optimizer state, logged values, the next batch — pin that heap, so the pages of the freed
blocks stay resident: a run's memory grows step after step. `malloc_trim(0)` returns every whole free
page of the heap. Serving every large block by its own mapping (`M_MMAP_THRESHOLD`) would bound it as
well, but faults each step's pages in afresh (measured: `benchmarks/fit_memory.py`).
"""

from __future__ import annotations

import ctypes
import sys
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def _glibc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:  # musl and others: no glibc heap to trim
        return None


def release_freed_memory() -> bool:
    """Return the free pages of the process's heap to the system; True when some were (glibc only)."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
