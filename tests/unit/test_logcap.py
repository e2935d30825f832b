"""Peer-caused log lines: capped text, the first event per source in full, then one summary
line per reason per interval; no input rate or number of addresses grows the log without
bound. Fake clock, a list-backed logger: no sleeping, no I/O."""

from __future__ import annotations

import logging
import random
import time

import pytest

from dilonode.net.peer_log import CAP, PeerLog, cap


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def sink():
    logger = logging.getLogger("tests.logcap")
    logger.propagate, logger.level = False, logging.DEBUG
    handler = Lines()
    logger.handlers[:] = [handler]
    yield logger, handler.lines
    logger.handlers[:] = []


def _log(sink, **kw) -> tuple[PeerLog, list[str], Clock]:
    logger, lines = sink
    clock = Clock()
    return PeerLog(logger, "data port", clock=clock, **kw), lines, clock


def test_cap_keeps_short_text_and_flattens_control_characters():
    assert cap("wrong run 'x'") == "wrong run 'x'"
    assert cap("a\nb\r\n\tc\x00d") == "a b c?d"


def test_cap_cuts_a_megabyte_quickly_and_says_how_long_it_was():
    garbage = "\x00" * (1 << 20)
    t0 = time.perf_counter()
    out = cap(garbage)
    assert time.perf_counter() - t0 < 0.05  # only a prefix is looked at
    assert out.startswith("?" * CAP) and out.endswith("... (1,048,576 chars)")
    assert len(out) < CAP + 30 and "\n" not in out


def test_first_event_per_source_in_full_then_one_summary_per_interval(sink):
    plog, lines, clock = _log(sink, interval=60.0)
    assert plog.event("idle", "10.0.0.1", "closed an idle connection from 10.0.0.1")
    for _ in range(1873):
        assert not plog.event("idle", "10.0.0.1", "closed an idle connection from 10.0.0.1")
    assert plog.event("idle", "10.0.0.2", "closed an idle connection from 10.0.0.2")
    assert len(lines) == 2 and plog.flush() == 0  # the interval is not over
    clock.t += 60.0
    assert plog.flush() == 1
    assert lines[-1] == "data port: 1,873 more idle from 1 address in the last 60 s"
    assert (plog.lines, plog.folded) == (3, 1873)
    clock.t += 600.0
    assert plog.flush(force=True) == 0  # nothing new: no line
    assert not plog.event("idle", "10.0.0.1", "again")  # still remembered: folded


def test_a_reason_with_a_phrase_reads_as_a_sentence(sink):
    plog, lines, clock = _log(sink, phrases={"idle": "idle connections closed"})
    plog.event("idle", "a", "x")
    plog.event("idle", "a", "x")
    plog.event("idle", "b", "y", key="")
    plog.flush(force=True)
    assert lines[-1] == "data port: 1 more idle connections closed from 1 address in the " \
                        "last 0 s"


def test_key_tells_apart_events_from_one_address(sink):
    plog, lines, _ = _log(sink)
    assert plog.event("unauthorized", "127.0.0.1", "claimed A", key="A")
    assert plog.event("unauthorized", "127.0.0.1", "claimed B", key="B")
    assert not plog.event("unauthorized", "127.0.0.1", "claimed A again", key="A")
    assert lines == ["claimed A", "claimed B"]


def test_many_addresses_get_a_few_full_lines_per_interval(sink):
    plog, lines, clock = _log(sink, full_per_interval=5)
    for i in range(10_000):
        plog.event("handshake_timeout", f"10.0.{i // 256}.{i % 256}", f"from {i}")
    clock.t += 60.0
    plog.flush()
    assert len(lines) == 6
    assert lines[-1] == ("data port: 9,995 more handshake_timeout from 9,995 addresses in the "
                         "last 60 s")


def test_no_input_rate_grows_the_log_without_bound(sink):
    """Random reasons, sources and rates over 10 intervals: at most (full + 1) lines per
    reason per interval, whatever the number of events."""
    plog, lines, clock = _log(sink, full_per_interval=3, remember=64)
    rng = random.Random(7)
    reasons = ["idle", "malformed", "unauthorized"]
    start = clock.t
    for _ in range(50_000):
        clock.t += rng.expovariate(50_000 / 600.0)  # ~600 s in all
        plog.event(rng.choice(reasons), f"10.1.{rng.randrange(256)}.{rng.randrange(256)}",
                   "x" * rng.randrange(1, 2000), key=str(rng.randrange(1000)))
    plog.flush(force=True)
    intervals = (clock.t - start) / 60.0 + 1
    assert len(lines) <= len(reasons) * (3 + 1) * (intervals + 1)
    assert all(len(line) <= 512 for line in lines)
    assert plog.truncated > 0  # the over-long texts were cut (the caller forgot to cap)
    assert plog.lines == len(lines) and plog.folded > 49_000


def test_peerlog_cap_counts_what_it_cut(sink):
    plog, _, _ = _log(sink)
    assert plog.cap("short") == "short" and plog.truncated == 0
    assert plog.cap("y" * 1000, 50).endswith("(1,000 chars)") and plog.truncated == 1


def test_bad_settings_are_refused(sink):
    logger, _ = sink
    with pytest.raises(ValueError):
        PeerLog(logger, "x", interval=0)
