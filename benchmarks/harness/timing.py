"""The median time of a call, the way the micro-benchmarks measure a step."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

__all__ = ["median_seconds"]


def median_seconds(f: Callable[[], object], reps: int, *, warmup: int = 1,
                   sync: Callable[[], object] | None = None) -> float:
    """Median wall seconds of `f()` over `reps` calls, after `warmup` calls that are not
    counted (caches, allocators, compiled kernels). `sync` runs after every call and
    inside the timing: `torch.cuda.synchronize` for work a GPU runs asynchronously."""
    if reps < 1:
        raise ValueError(f"reps = {reps}: must be >= 1")
    for _ in range(warmup):
        f()
        if sync is not None:
            sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        if sync is not None:
            sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
