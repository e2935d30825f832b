"""The re-merge policy, the 'alone' warning and the DHT part's restart hooks, with fakes and
a fake clock: no DHT, no sockets, no sleeping."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from dilonode.collective import RoundReport
from dilonode.config import SuperviseConfig
from dilonode.node.remerge import Remerger
from dilonode.node.supervised_parts import DHTPart
from dilonode.node.supervisor import PartDown
from dilonode.status.isolation import AloneWatch
from dilonode.status.snapshot import NodeStatus, QuietFacts


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def rec(peer: str, leaving: bool = False):
    return SimpleNamespace(peer_id=peer, status={"leaving": True} if leaving else {})


class FakeDHT:
    """Live records are `live`; reconnect() answers with `reachable` and, like a healed
    partition, makes them live again."""

    peer_id = "me"

    def __init__(self, live: set[str]) -> None:
        self.live = set(live)
        self.leaving: set[str] = set()
        self.reachable: set[str] = set()
        self.dials: list[dict[str, list[str]]] = []

    def fetch_peers(self):
        return [rec(p) for p in sorted(self.live | {"me"})] + [rec(p, True) for p in self.leaving]

    def remember_peers(self):
        return {}

    def known_peers(self):
        return {p: [f"/ip4/10.0.0.{i}/tcp/1"] for i, p in enumerate(["boot", "a", "b", "c"])}

    def reconnect(self, peers, timeout=None):
        self.dials.append(peers)
        found = [p for p in peers if p in self.reachable]
        self.live |= set(found) - {"boot"}
        return found


CFG = SuperviseConfig(remember_for=100.0, remerge_backoff_max=8.0)


def run(rm: Remerger, clock: Clock, seconds: float, step: float = 1.0) -> None:
    end = clock.t + seconds
    while clock.t < end:
        rm.tick()
        clock.t += step


def test_a_whole_swarm_is_not_redialled():
    dht, clock = FakeDHT({"a", "b", "c"}), Clock()
    rm = Remerger(dht, CFG, clock=clock)
    run(rm, clock, 30)
    assert dht.dials == [] and rm.missing_since is None


def test_missing_peers_are_redialled_with_backoff_until_they_are_back(caplog):
    dht, clock = FakeDHT({"a", "b", "c"}), Clock()
    rm = Remerger(dht, CFG, clock=clock)
    run(rm, clock, 5)
    dht.live = {"a"}  # partition: b and c gone
    with caplog.at_level(logging.INFO, logger="dilonode.node.remerge"):
        run(rm, clock, 60)
        assert len(dht.dials) >= 4
        # every attempt dials the initial and every remembered peer
        assert all(set(d) == {"boot", "a", "b", "c"} for d in dht.dials)
        dht.reachable = {"boot", "b", "c"}  # healed
        run(rm, clock, 20)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "2 peer(s)" in warnings[0].getMessage()
    assert "live again" in caplog.text
    assert rm.missing_since is None and len(rm.healed_after) == 1
    # backed off: 60 s missing cost about 1 + log2(8) + 60 / 8 attempts, not 60
    assert rm.attempts <= 14


def test_backoff_waits_double_up_to_the_maximum():
    dht, clock = FakeDHT({"a"}), Clock()
    rm = Remerger(dht, CFG, clock=clock)
    rm.tick()
    dht.live = set()
    at = []
    for _ in range(80):
        before = len(dht.dials)
        rm.tick()
        if len(dht.dials) > before:
            at.append(clock.t)
        clock.t += 0.5
    gaps = [b - a for a, b in zip(at, at[1:], strict=False)]
    assert gaps[:5] == [1.0, 2.0, 4.0, 8.0, 8.0], gaps


def test_peers_that_left_or_were_not_seen_for_long_are_not_looked_for():
    dht, clock = FakeDHT({"a", "b"}), Clock()
    rm = Remerger(dht, CFG, clock=clock)
    rm.tick()
    dht.live, dht.leaving = {"a"}, {"b"}  # b left cleanly
    run(rm, clock, 20)
    assert dht.dials == []
    dht.live = set()  # a vanished without a word: looked for until forgotten
    run(rm, clock, 150)
    n = len(dht.dials)
    assert n > 0 and rm.seen == {}
    run(rm, clock, 50)
    assert len(dht.dials) == n


def test_a_briefly_missing_record_is_not_a_partition():
    dht, clock = FakeDHT({"a", "b"}), Clock()
    rm = Remerger(dht, CFG, clock=clock)
    for i in range(30):
        dht.live = {"a"} if i % 3 == 1 else {"a", "b"}  # b missing from one read in three
        rm.tick()
        clock.t += 1
    assert dht.dials == []


def test_alone_warning_after_n_rounds_while_peers_are_live(caplog):
    clock = Clock()
    w = AloneWatch(warn_after=3, log_every=60.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="dilonode.alone"):
        for _ in range(2):
            w.on_round(1, 2)
        assert w.warning() is None
        w.on_round(1, 2)
        assert w.warning() == "alone for 3 rounds while 2 peers are live"
        for _ in range(10):  # rate-limited: no new line within log_every
            clock.t += 1
            w.on_round(1, 2)
        clock.t += 60
        w.on_round(1, 2)
        w.on_round(2, 2)  # back in a group
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert lines == ["alone for 3 rounds while 2 peers are live",
                     "alone for 14 rounds while 2 peers are live"]
    assert "back in a group of 2 after 14 round(s) alone" in caplog.text
    assert w.snapshot() == {"rounds": 0, "live_peers": 2, "warning": None, "episodes": 1}


def test_alone_with_nobody_live_is_not_a_warning():
    w = AloneWatch(warn_after=1)
    for _ in range(5):
        w.on_round(1, 0)
    assert w.warning() is None and w.rounds == 0


class _Facts(QuietFacts):
    def __init__(self, others: int, health: dict) -> None:
        self.others, self.parts = others, health

    def live_others(self) -> int:
        return self.others

    def health(self) -> dict:
        return self.parts


def test_the_status_snapshot_carries_the_warning_and_the_parts():
    w = AloneWatch(warn_after=2)
    st = NodeStatus("r", 10, alone=w,
                    facts=_Facts(3, {"parts": {"dht": {"state": "ok"}}, "failure": None}))
    key = SimpleNamespace(kind="fragment", fragment=0, round=1)
    result = SimpleNamespace(report=RoundReport(1, 0, 0, members=("me",)))
    for r in range(3):
        key.round = r
        st.on_sync(key, result, step=r)
    snap = st.snapshot()
    assert snap["alone"]["warning"] == "alone for 3 rounds while 3 peers are live"
    assert snap["supervision"]["parts"]["dht"]["state"] == "ok"


class FakeSwarmDHT:
    def __init__(self) -> None:
        self.healthy, self.restarts = True, 0

    def health(self, timeout):
        if not self.healthy:
            raise PartDown("DHT process 1 was killed by signal 9")

    def restart(self, timeout):
        self.restarts += 1
        self.healthy = True


def test_dht_part_runs_its_hooks_after_a_restart_and_stays_down_until_they_succeed():
    dht = FakeSwarmDHT()
    calls = []
    fail = {"tunnel": True}

    def tunnel():
        calls.append("tunnel")
        if fail["tunnel"]:
            raise OSError("p2pd socket missing")

    part = DHTPart(dht, [("re-attaching the tunnel", tunnel),
                         ("re-publishing", lambda: calls.append("publish"))])
    dht.healthy = False
    with pytest.raises(PartDown, match="DHT process 1 was killed"):
        part.health(1.0)
    with pytest.raises(PartDown, match="re-attaching the tunnel failed"):
        part.restart(1.0)
    assert calls == ["tunnel", "publish"] and dht.restarts == 1
    with pytest.raises(PartDown, match="not yet: re-attaching the tunnel"):
        part.health(1.0)
    fail["tunnel"] = False
    part.restart(1.0)  # the DHT is fine: only the hook that failed runs again
    assert calls == ["tunnel", "publish", "tunnel"] and dht.restarts == 1
    part.health(1.0)


def test_the_status_table_shows_the_warning_and_parts_down():
    from dilonode.status.table import format_node

    st = NodeStatus("r", 10, alone=AloneWatch(warn_after=1),
                    facts=_Facts(2, {"parts": {"data": {"state": "down", "down_s": 4.0,
                                                        "reason": "refused", "restarts": 2,
                                                        "last_outage_s": None}},
                                     "failure": None}))
    key = SimpleNamespace(kind="fragment", fragment=0, round=0)
    st.on_sync(key, SimpleNamespace(report=RoundReport(1, 0, 0, members=("me",))), step=1)
    text = format_node(st.snapshot())
    assert "WARNING     alone for 1 rounds while 2 peers are live" in text
    assert "data for 4.0 s: refused" in text
