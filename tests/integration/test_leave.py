"""Leaving: a node stopped while a round cannot finish abandons it within
`network.leave_timeout`, withdraws its peer record and exits (127.0.0.1).

Node B publishes its record and is then frozen (SIGSTOP), so node A's first round waits for
it (a long matchmaking window). A is told to stop while that round is in flight; without the
bound it would wait out the window and the all-reduce timeout.
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.support.config import nano_config
from tests.support.swarm import nodes_by_hand
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_sigterm_abandons_a_stuck_round_withdraws_and_exits(tmp_path):
    pytest.importorskip("hivemind")
    from dilonode.swarm.dht import SwarmDHT
    from dilonode.swarm.records import group_key

    # B's record must outlive the test (peer_ttl); A asks frozen B for state and gives up
    # after request_timeout.
    net = {"matchmaking_window": 60.0, "matchmaking_timeout": 90.0, "peer_ttl": 120.0,
           "allreduce_timeout": 60.0, "max_attempts": 1, "leave_timeout": 2.0}
    cfg = nano_config(tmp_path, run_id="join-test", seed=5, eval_every=6, total_steps=100000,
                      codec={"name": "float32"}, network=net,
                      checkpoint={"every_steps": 0},
                      statesync={"request_timeout": 2.0, "snapshot_wait": 1.0})
    observer = None
    with nodes_by_hand(cfg) as swarm:
        try:
            # The observer joins first, while the box is quiet: started after A (training)
            # and B (frozen), its DHT once missed its 30 s start deadline in a CI run.
            observer = SwarmDHT(cfg.run_id, swarm.maddrs).start()
            b = swarm.start(1)
            b.wait_for("started", 120)
            b.proc.send_signal(signal.SIGSTOP)  # B: a record, but never a round
            a = swarm.start(0, "--set", "network.min_peers=2")
            started = a.wait_for("started", 120)
            key = group_key(cfg.run_id, 0, 0, 0)  # A's first round: registered, waiting for B
            wait_until(lambda: started["peer_id"] in observer.get_raw(key, timeout=5.0), 60,
                       interval=0.05, what="A's entry for its first round")
            t0 = time.monotonic()
            a.proc.send_signal(signal.SIGTERM)
            summary = a.wait_for("summary", 30)
            # The exit once hung here for up to the matchmaking window: a DHT read in flight
            # when the DHT closed was never answered (SwarmDHT.close now fails such calls).
            assert a.proc.wait(timeout=30) == 0
            took = time.monotonic() - t0
            records = {r.peer_id: r for r in observer.fetch_peers(timeout=10.0)}
        finally:
            if observer is not None:
                observer.close()
    assert took < 15, f"stopping took {took:.1f} s"
    assert summary["stopped_early"] is True
    assert "round 0 abandoned" in (tmp_path / "n0.log").read_text()
    a = records.get(started["peer_id"])
    assert a is not None and a.status == {"leaving": True}, a  # withdrawn, not just expired
