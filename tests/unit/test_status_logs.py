"""Terminal output of `dilonode run`: JSON log lines when not on a terminal, and on a terminal
one progress line that log records print above without garbling it."""

from __future__ import annotations

import io
import json
import logging
import sys

import pytest

from dilonode.cli import logs


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logs._handler = None


def test_json_when_not_a_terminal(monkeypatch, restore_logging):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    assert logs.setup_logging(None) == "json"
    logging.getLogger("dilonode.x").warning("peer %s dropped", "QmA")
    record = json.loads(err.getvalue().strip())
    assert record["level"] == "WARNING" and record["msg"] == "peer QmA dropped"
    assert record["logger"] == "dilonode.x"
    assert logs.progress_line() is None  # no progress line off a terminal


def test_json_level_names_do_not_follow_a_renamed_level(monkeypatch, restore_logging):
    # importing hivemind renames WARNING to "WARN" for the whole process
    monkeypatch.setattr(logging, "_levelToName", {**logging._levelToName, logging.WARNING: "WARN"})
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    logs.setup_logging("json")
    logging.getLogger("dilonode.x").warning("late round")
    assert logging.getLevelName(logging.WARNING) == "WARN"
    assert json.loads(err.getvalue().strip())["level"] == "WARNING"


def test_progress_line_keeps_logs_above_it(monkeypatch, restore_logging):
    tty = FakeTty()
    monkeypatch.setattr(sys, "stderr", tty)
    assert logs.setup_logging(None) == "text"
    line = logs.progress_line()
    assert line is not None
    line.update("step 1/10", force=True)
    logging.getLogger("dilonode").info("joined a group")
    line.update("step 2/10", force=True)
    line.close()
    out = tty.getvalue()
    # each redraw starts with "carriage return, erase line"; the record ends with a newline
    frames = out.split("\r\x1b[K")
    assert frames[1] == "step 1/10"
    assert frames[2].endswith("INFO dilonode: joined a group\nstep 1/10")
    assert frames[3] == "step 2/10"
    assert frames[4] == "step 2/10\n"  # close() leaves the last line and a newline


def test_progress_updates_are_throttled():
    tty = FakeTty()
    line = logs.ProgressLine(tty, min_interval=3600)
    line.update("a", force=True)
    line.update("b")  # within the interval: remembered, not drawn
    assert tty.getvalue() == "\r\x1b[Ka"
    assert line.text == "b"
