"""A node that falls behind its peers (frozen longer than a round timeout) goes on alone,
then catches up by fetching their state, and the run ends with identical outer weights."""

from __future__ import annotations

import os
import signal

import pytest

pytest.importorskip("hivemind")

from dilonode.cli.local_swarm import LocalSwarm  # noqa: E402
from tests.integration.test_swarm import BASE, _cfg, _start_node, _wait_for  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.timeout(420)
def test_frozen_node_catches_up_from_its_peers(tmp_path):
    # A peer that a retry left out is not waited for during one record ttl (it is grouped
    # only when it registers in time); a short ttl lets the woken node be waited for again
    # well before the run ends, instead of going alone in its last rounds as peers finish.
    cfg = _cfg(tmp_path, total_steps=90, eval_every=6,
               network={**BASE["network"], "min_peers": 3, "allreduce_timeout": 6.0,
                        "matchmaking_window": 3.0, "matchmaking_timeout": 8.0,
                        "peer_ttl": 6.0})
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(cfg.model_dump_json())
    swarm = LocalSwarm(cfg, 0)
    nodes = []
    try:
        swarm.start_bootstrap()
        nodes = [_start_node(tmp_path, cfg_path, swarm.maddrs, i) for i in range(3)]
        first = _wait_for(nodes[2], "progress", 240)
        os.kill(nodes[2].pid, signal.SIGSTOP)  # the trainer only: its DHT child keeps running
        try:
            # the others time out on it, drop it and train on for two more eval periods
            seen = _wait_for(nodes[0], "progress", 120)
            while seen["step"] < first["step"] + 3 * cfg.eval_every:
                seen = _wait_for(nodes[0], "progress", 120)
        finally:
            os.kill(nodes[2].pid, signal.SIGCONT)
        summaries = [_wait_for(n, "summary", 300) for n in nodes]
        for n in nodes:
            assert n.wait(timeout=30) == 0
    finally:
        swarm.stop()
        for n in nodes:
            if n.poll() is None:
                n.kill()
    log = (tmp_path / "n2.log").read_text()
    assert "state sync: recovered step" in log, log[-3000:]
    for s in summaries:
        assert s["steps"] == 90
    assert len({s["outer_digest"] for s in summaries}) == 1, [
        (s["worker_id"], s["outer_digest"][:12], s["dropped_peers"][-3:]) for s in summaries]
