"""benchmarks/loopback/allreduce.py fails fast: a chunk size the rounds would refuse is an argument
error, and a worker that dies ends the run with its exit code instead of leaving the
parent waiting on the others, which block in a barrier for it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.loopback import allreduce

ROOT = Path(__file__).resolve().parents[2]


def test_a_chunk_off_the_codec_blocks_is_an_argument_error(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        allreduce.parse_args(["--chunk", "2500000"])
    assert exc.value.code == 2
    assert "--chunk 2500000: must be a positive multiple of --block-size 64" in \
        capsys.readouterr().err


@pytest.mark.timeout(120)
def test_a_failing_worker_ends_the_run() -> None:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.loopback.allreduce", "--procs", "2",
                           "--numel", "4096", "--rounds", "1", "--codecs", "nosuchcodec",
                           "--no-gloo"], capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert proc.returncode != 0
    assert "worker(s) [" in proc.stderr and "failed" in proc.stderr, proc.stderr[-2000:]
    assert time.monotonic() - started < 100
