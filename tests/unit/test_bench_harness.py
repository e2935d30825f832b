"""The benchmarks' shared helpers: option lists, median timing, result files."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks.harness.args import chosen, floats, ints, names
from benchmarks.harness.results import save_rows, write_json, write_text
from benchmarks.harness.timing import median_seconds


def test_comma_lists_drop_blanks_and_empty_items():
    assert names(" int4, float32,,") == ["int4", "float32"]
    assert floats("100, 20") == [100.0, 20.0]
    assert ints("0,1,2") == [0, 1, 2]
    assert names("") == []
    with pytest.raises(ValueError):
        ints("0,x")


def test_chosen_items_must_be_known_and_a_bad_one_is_named():
    assert chosen("b, a", {"a": 1, "b": 2}, "x.py: --runs") == ["b", "a"]
    with pytest.raises(SystemExit, match=r"^x.py: --runs c,d: not one of a,b$"):
        chosen("a,c,d", ["a", "b"], "x.py: --runs")


def test_median_seconds_counts_only_the_timed_calls():
    calls, syncs = [], []
    median = median_seconds(lambda: calls.append(1), 5, warmup=2, sync=lambda: syncs.append(1))
    assert len(calls) == len(syncs) == 7 and median >= 0.0
    with pytest.raises(ValueError):
        median_seconds(lambda: None, 0)


def test_results_go_to_new_folders_and_nowhere_without_a_path(tmp_path: Path):
    args = argparse.Namespace(rates="100,20", json=tmp_path / "a" / "rows.json")
    save_rows(args.json, args, [{"rate": 100.0}])
    doc = json.loads(args.json.read_text())
    assert doc == {"args": {"rates": "100,20", "json": str(args.json)}, "rows": [{"rate": 100.0}]}
    write_json(tmp_path / "b" / "doc.json", {"path": tmp_path})
    assert json.loads((tmp_path / "b" / "doc.json").read_text()) == {"path": str(tmp_path)}
    write_text(tmp_path / "c" / "table.md", "| a |\n")
    assert (tmp_path / "c" / "table.md").read_text() == "| a |\n"
    save_rows(None, args, [])
    write_json(None, {})
    write_text(None, "")
