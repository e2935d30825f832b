"""Where a process's CPU goes, by sampling it with Linux `perf` (benchmarks only).

cProfile misleads for the all-reduce: it sees Python functions only, adds overhead per call,
and with a process-wide CPU clock it charges one thread's work to whatever another thread
was running. `perf record` samples the whole process (every thread, the kernel's socket
copies, native libraries) at a fixed rate, so the shares below are of real CPU time.

    with PerfSampler(Path("out/float32.perf")) as sampler:
        ...                                   # the work to measure, in this process
    print(format_shares(sampler.shares()))

`perf` must be installed and allowed (root, or kernel.perf_event_paranoid <= 1).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import TracebackType

__all__ = ["CATEGORIES", "PerfSampler", "format_shares", "perf_available"]

# (category, regex over perf's "dso  symbol" column), first match wins.
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("GMAC frame tags (AES-GCM)", r"aes_gcm|gcm_|ghash"),
    ("BLAKE3 digests", r"blake3"),
    ("kernel: socket copies", r"\[k\] _copy_(to|from)_iter"),
    ("kernel: TCP, scheduling, faults", r"kernel\.kallsyms"),
    ("user-space copies (memmove)", r"memmove|memcpy"),
    ("torch kernels (sums, adds, copies)", r"libtorch|libc10|libgomp"),
    ("numpy kernels", r"_multiarray|umath"),
    ("Python interpreter", r"libpython"),
    ("pydantic, msgpack, event loop", r"pydantic|msgpack|loop\.cpython|_asyncio"),
)


def perf_available() -> bool:
    return shutil.which("perf") is not None


class PerfSampler:
    """`perf record` of this process (all threads) while the `with` block runs."""

    def __init__(self, out: Path, *, freq: int = 2000, start_timeout: float = 10.0) -> None:
        self.out = out
        self.freq = freq
        self.start_timeout = start_timeout
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> PerfSampler:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.unlink(missing_ok=True)
        self._proc = subprocess.Popen(
            ["perf", "record", "-q", "-F", str(self.freq), "-p", str(os.getpid()),
             "-o", str(self.out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        # perf creates its output once it is attached; samples start then.
        deadline = time.monotonic() + self.start_timeout
        while not self.out.exists():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                err = self._proc.stderr.read().decode() if self._proc.stderr else ""
                self._proc.kill()
                raise RuntimeError(f"perf record did not start: {err.strip()[:300]}")
            time.sleep(0.01)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGINT)
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            raise RuntimeError("perf record did not stop within 60 s") from None

    def shares(self) -> dict[str, float]:
        """Percent of the sampled CPU time per category of `CATEGORIES` (+ "other")."""
        report = subprocess.run(
            ["perf", "report", "-i", str(self.out), "--no-children", "--sort", "dso,symbol",
             "-q", "-g", "none"], capture_output=True, text=True, timeout=120, check=True)
        shares: dict[str, float] = {}
        for line in report.stdout.splitlines():
            m = re.match(r"\s*([\d.]+)%\s+(.*)", line)
            if not m:
                continue
            name = next((c for c, rx in CATEGORIES if re.search(rx, m.group(2))), "other")
            shares[name] = shares.get(name, 0.0) + float(m.group(1))
        return shares


def format_shares(shares: dict[str, float], cpu_s: float | None = None) -> str:
    """One line per category, largest first; with `cpu_s`, also CPU seconds of each."""
    lines = []
    for name, pct in sorted(shares.items(), key=lambda kv: -kv[1]):
        secs = f"  {pct / 100 * cpu_s:.4f} s" if cpu_s is not None else ""
        lines.append(f"  {pct:5.1f}%{secs}  {name}")
    return "\n".join(lines)
