"""Timing helpers shared by the benchmarks: best-of-N wall time and this machine's memcpy
bandwidth, measured in the same run as the thing it is compared with."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np


def best_of(fn: Callable[[], object], n: int = 3) -> float:
    """Seconds of the fastest of ``n`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def memcpy_gbps(nbytes: int = 1 << 28) -> float:
    """GB/s copied by numpy between two ``nbytes`` buffers."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    return nbytes / best_of(lambda: np.copyto(dst, src)) / 1e9
