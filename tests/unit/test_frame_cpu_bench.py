"""benchmarks/micro/frame_cpu.py measures the real per-frame steps: its decode gives back the
payload its encode sent (else it refuses to report), and it prints every step."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.micro import frame_cpu

ROOT = Path(__file__).resolve().parents[2]


def test_every_step_is_timed_for_the_chunk_asked_for() -> None:
    got = frame_cpu.measure(numel=70_000, reps=3)
    assert got["bytes"] == 70_000 * 4
    for step in ("seal", "hash", "encode", "decode"):
        assert got[step] > 0, step


def test_it_prints_rates_and_microseconds(capsys) -> None:
    assert frame_cpu.main(["--numel", "70000", "--reps", "2"]) == 0
    out = capsys.readouterr().out
    assert "one frame of 70,000 float32 values (0.28 MB)" in out
    assert out.count("GB/s") == 2 and out.count(" us") == 4


def test_bad_arguments_are_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        frame_cpu.main(["--reps", "0"])
    assert "--numel and --reps must be >= 1" in capsys.readouterr().err
