"""Admission bookkeeping: caps per port and per source, eviction of the heaviest source,
counters by reason, sizing from the open-files limit. No sockets (the listeners' side is
tests/integration/test_flood.py)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from dilonode.config import AdmissionConfig
from dilonode.net.admission import Admission, Limits, limits_for


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _gate(limits: Limits, clock: Clock | None = None):
    return Admission(limits, clock=clock or Clock()).gate("data")


class Conn:
    """Stands for a connection: records whether the gate closed it."""

    def __init__(self, gate, source: str) -> None:
        self.ticket = gate.admit(source)
        self.closed = False
        if self.ticket is not None:
            self.ticket.close = self.close

    def close(self) -> None:
        self.closed = True


def test_sizing_leaves_a_reserve_and_splits_the_rest_between_ports():
    assert limits_for(1024) == Limits(max_open=256, max_pending=128, max_pending_per_source=32)
    big = limits_for(1 << 20)
    assert big == Limits(max_open=4096, max_pending=256, max_pending_per_source=32)
    tiny = limits_for(64)  # below the reserve: still a working minimum
    assert tiny.max_open == 4 and tiny.max_pending == 2 and tiny.max_pending_per_source == 2
    for nofile in (64, 256, 1024, 4096, 20_000, 1 << 20):
        lim = limits_for(nofile)
        held = 3 * lim.max_open
        assert held <= max(nofile - 256, 12)  # three ports never eat the reserve


def test_limits_must_nest():
    with pytest.raises(ValueError):
        Limits(max_open=10, max_pending=20)
    with pytest.raises(ValueError):
        Limits(max_pending=4, max_pending_per_source=8)


def test_one_source_is_capped_and_refusals_are_counted_and_logged_once(caplog):
    gate = _gate(Limits(max_open=100, max_pending=50, max_pending_per_source=3))
    with caplog.at_level(logging.WARNING, "dilonode.net.admission"):
        conns = [Conn(gate, "10.0.0.9") for _ in range(10)]
    assert sum(c.ticket is not None for c in conns) == 3
    assert gate.refused["source_full"] == 7 and gate.pending == gate.open == 3
    assert len(caplog.records) == 1  # the rest folded into a summary
    assert "refused a connection from 10.0.0.9" in caplog.records[0].getMessage()
    other = Conn(gate, "10.0.0.10")
    assert other.ticket is not None  # another address still gets in


def test_a_newcomer_evicts_the_oldest_pending_of_the_heaviest_source():
    gate = _gate(Limits(max_open=100, max_pending=4, max_pending_per_source=4))
    flood = [Conn(gate, "6.6.6.6") for _ in range(4)]
    assert all(c.ticket for c in flood) and gate.pending == 4
    legit = Conn(gate, "1.2.3.4")
    assert legit.ticket is not None and flood[0].closed and not flood[1].closed
    assert gate.closed["evicted"] == 1 and gate.pending == 4
    assert Conn(gate, "5.5.5.5").ticket is not None  # 6.6.6.6 still holds the most
    assert flood[1].closed
    # Now 6.6.6.6 holds 2, the others 1 each: one more newcomer evicts again, but once
    # every source holds about as many as the newcomer would, the port is full.
    assert Conn(gate, "7.7.7.7").ticket is not None and flood[2].closed
    assert Conn(gate, "8.8.8.8").ticket is None and gate.refused["port_full"] == 1


def test_established_connections_leave_the_pending_caps_but_count_as_open():
    gate = _gate(Limits(max_open=3, max_pending=2, max_pending_per_source=2))
    a, b = Conn(gate, "10.0.0.1"), Conn(gate, "10.0.0.1")
    gate.established(a.ticket)
    assert gate.pending == 1 and gate.open == 2
    c = Conn(gate, "10.0.0.1")  # a's pending slot is free again
    assert c.ticket is not None and gate.open == 3
    assert Conn(gate, "10.0.0.2").ticket is None and gate.refused["port_full"] == 1
    gate.release(b.ticket, "handshake_timeout")
    gate.release(b.ticket, "handshake_timeout")  # idempotent
    assert gate.closed["handshake_timeout"] == 1 and gate.open == 2 and gate.pending == 1
    gate.established(b.ticket)  # too late: no effect
    assert gate.pending == 1


def test_closing_counts_and_logs_through_the_aggregator(caplog):
    clock = Clock()
    gate = _gate(Limits(), clock)
    with caplog.at_level(logging.WARNING, "dilonode.net.admission"):
        for _ in range(1000):
            c = Conn(gate, "9.9.9.9")
            gate.closing(c.ticket, "handshake_timeout", "closed an idle one from 9.9.9.9")
        clock.t += 60.0
        gate.log.flush()
    lines = [r.getMessage() for r in caplog.records]
    assert gate.closed["handshake_timeout"] == 1000 and gate.open == 0
    assert lines == ["closed an idle one from 9.9.9.9",
                     "data port: 999 more connections closed with no handshake in time from "
                     "1 address in the last 60 s"]


def test_snapshot_is_plain_json_with_counters_per_port():
    adm = Admission(Limits(max_open=8, max_pending=4, max_pending_per_source=2))
    data, status = adm.gate("data"), adm.gate("status")
    assert adm.gate("data") is data
    Conn(data, "1.1.1.1")
    for _ in range(3):
        Conn(status, "2.2.2.2")
    snap = json.loads(json.dumps(adm.snapshot()))
    assert snap["ports"]["data"]["open"] == 1
    assert snap["ports"]["status"]["refused"]["source_full"] == 1
    assert snap["ports"]["status"]["limits"]["max_pending_per_source"] == 2
    assert snap["log"]["lines"] == 1


def test_setup_sizes_from_the_limit_and_config_caps_take_precedence():
    adm = Admission()
    limits = adm.setup(AdmissionConfig(raise_nofile=False, max_pending=40,
                                       max_pending_per_source=5))
    assert adm.nofile and limits.max_pending == min(40, limits.max_open)
    assert limits.max_pending_per_source == 5
    assert adm.gate("state").limits == limits


_RAISE = """
import json, resource, sys
sys.path.insert(0, sys.argv[1])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
from dilonode.net.admission import raise_nofile_limit
got = raise_nofile_limit()
print(json.dumps([got, resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard]))
"""


def test_raise_nofile_limit_lifts_the_soft_limit_to_the_hard_one():
    root = str(Path(__file__).parents[2])
    out = subprocess.run([sys.executable, "-c", _RAISE, root], capture_output=True,
                         text=True, timeout=60, check=True)
    got, soft, hard = json.loads(out.stdout)
    assert got == soft == hard or (hard == -1 and soft >= 10240)


def test_counters_reach_the_status_snapshot_and_metrics():
    from prometheus_client.parser import text_string_to_metric_families

    from dilonode.status.metrics import node_metrics, render
    from dilonode.status.snapshot import NodeStatus, QuietFacts

    class Admitting(QuietFacts):
        def admission(self) -> dict:
            return adm.snapshot()

    adm = Admission(Limits(max_open=8, max_pending=4, max_pending_per_source=1))
    gate = adm.gate("state")
    held = Conn(gate, "3.3.3.3")
    Conn(gate, "3.3.3.3")  # refused: one pending per address
    gate.closing(held.ticket, "handshake_timeout", "closed one from 3.3.3.3")
    status = NodeStatus("run-1", facts=Admitting())
    assert status.snapshot()["admission"]["ports"]["state"]["closed"]["handshake_timeout"] == 1
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(render(node_metrics(status.snapshot())))
               for s in f.samples}
    assert samples[("dilonode_connections_refused_total",
                    (("port", "state"), ("reason", "source_full")))] == 1
    assert samples[("dilonode_connections_closed_total",
                    (("port", "state"), ("reason", "handshake_timeout")))] == 1
    assert samples[("dilonode_connections_open", (("port", "state"),))] == 0
    assert samples[("dilonode_peer_log_lines_total", ())] == 2
    plain = render(node_metrics(NodeStatus("run-1").snapshot()))
    assert "dilonode_connections" not in plain  # no admission provider: no such families
