"""benchmarks/loopback/join_wait.py reads the wait for a joiner off node 0's log: the gap between
its last group without the joiner and its first group with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.loopback import join_wait

ROOT = Path(__file__).resolve().parents[2]




def _log(run: Path, lines: list[tuple[float, str]]) -> None:
    (run / "node-0").mkdir(parents=True)
    text = "\n".join(json.dumps({"ts": ts, "level": "INFO", "msg": msg}) for ts, msg in lines)
    (run / "node-0" / "stderr.log").write_text("not json: a startup line\n" + text + "\n")


def test_the_gap_before_the_first_group_with_the_joiner(tmp_path: Path) -> None:
    jw = join_wait
    _log(tmp_path, [(10.0, "group g/0/1/0: closed with 4 member(s), digest a"),
                    (13.0, "group g/1/1/0: 4 member(s), I am #2, digest b"),
                    (14.0, "state sync: something else"),
                    (16.0, "group g/2/1/0: closed with 4 member(s), digest c"),
                    (27.5, "group g/0/2/0: 5 member(s), I am #1, digest d"),
                    (30.5, "group g/1/2/0: closed with 5 member(s), digest e")])
    wait, median = jw.join_wait(tmp_path)
    assert wait == pytest.approx(11.5) and median == pytest.approx(3.0)


def test_a_run_where_nobody_joined_is_refused_with_a_reason(tmp_path: Path) -> None:
    jw = join_wait
    _log(tmp_path, [(1.0, "group g/0/1/0: closed with 4 member(s), digest a"),
                    (2.0, "group g/1/1/0: closed with 4 member(s), digest b")])
    with pytest.raises(SystemExit, match="no group larger than the first"):
        jw.join_wait(tmp_path)
