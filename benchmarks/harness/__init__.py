"""What the benchmarks share: where results go (`results`), comma-separated options (`args`),
the median of repeated calls (`timing`), CPU sampling (`perf`), and how a benchmark starts a
copy of itself in another process (`module_argv`). benchmarks/README.md describes each.

Benchmarks run as modules from the repository root (`python -m benchmarks.sim.quality`), so
they import `dilonode`, `testbed` and each other without touching `sys.path`.
"""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["ROOT", "module_argv"]

ROOT = Path(__file__).resolve().parents[2]


def module_argv(module: str) -> list[str]:
    """The command that runs `module` (a benchmark's `__spec__.name`) in a new interpreter;
    start it with `cwd=ROOT` so the packages of the repository import."""
    return [sys.executable, "-m", module]
