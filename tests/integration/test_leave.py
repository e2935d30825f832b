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

from dilonode.config import load_config
from tests.integration.test_join import BASE, _Proc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_sigterm_abandons_a_stuck_round_withdraws_and_exits(tmp_path):
    pytest.importorskip("hivemind")
    from dilonode.cli.local_swarm import LocalSwarm
    from dilonode.swarm.dht import SwarmDHT
    from dilonode.swarm.records import group_key

    # B's record must outlive the test (peer_ttl); A asks frozen B for state and gives up
    # after request_timeout.
    net = {"matchmaking_window": 60.0, "matchmaking_timeout": 90.0, "peer_ttl": 120.0,
           "allreduce_timeout": 60.0, "max_attempts": 1, "leave_timeout": 2.0}
    cfg = load_config(overrides={**BASE, "network": net, "paths": {"out_dir": str(tmp_path)},
                                 "checkpoint": {"every_steps": 0},
                                 "statesync": {"request_timeout": 2.0,
                                               "snapshot_wait": 1.0}})
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(cfg.model_dump_json())
    swarm = LocalSwarm(cfg, 0)
    procs: list[_Proc] = []
    observer = None
    try:
        maddrs = swarm.start_bootstrap()
        # The observer joins first, while the box is quiet: started after A (training) and
        # B (frozen), its DHT once missed its 30 s start deadline in a CI run.
        observer = SwarmDHT(cfg.run_id, maddrs).start()
        procs.append(_Proc(tmp_path, cfg_path, maddrs, 1))
        procs[0].wait_for("started", 120)
        procs[0].proc.send_signal(signal.SIGSTOP)  # B: a record, but never a round
        procs.append(_Proc(tmp_path, cfg_path, maddrs, 0, "--set", "network.min_peers=2"))
        started = procs[1].wait_for("started", 120)
        key = group_key(cfg.run_id, 0, 0, 0)  # A's first round: registered, waiting for B
        deadline = time.monotonic() + 60
        while started["peer_id"] not in observer.get_raw(key, timeout=5.0):
            assert time.monotonic() < deadline, "A never registered for its first round"
        t0 = time.monotonic()
        procs[1].proc.send_signal(signal.SIGTERM)
        summary = procs[1].wait_for("summary", 30)
        # The exit once hung here for up to the matchmaking window: a DHT read in flight
        # when the DHT closed was never answered (SwarmDHT.close now fails such calls).
        assert procs[1].proc.wait(timeout=30) == 0
        took = time.monotonic() - t0
        records = {r.peer_id: r for r in observer.fetch_peers(timeout=10.0)}
    finally:
        for p in procs:
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGCONT)
                p.proc.kill()
        if observer is not None:
            observer.close()
        swarm.stop()
    assert took < 15, f"stopping took {took:.1f} s"
    assert summary["stopped_early"] is True
    assert "round 0 abandoned" in (tmp_path / "n0.log").read_text()
    a = records.get(started["peer_id"])
    assert a is not None and a.status == {"leaving": True}, a  # withdrawn, not just expired
