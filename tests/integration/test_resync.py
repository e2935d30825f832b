"""A node that falls behind its peers (frozen longer than a round timeout) goes on alone,
then catches up by fetching their state, and the run ends with identical outer weights."""

from __future__ import annotations

import os
import signal

import pytest

pytest.importorskip("hivemind")

from tests.integration.test_swarm import _cfg  # noqa: E402
from tests.support.swarm import assert_one_model, nodes_by_hand  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.timeout(420)
def test_frozen_node_catches_up_from_its_peers(tmp_path):
    # A peer that a retry left out is not waited for during one record ttl (it is grouped
    # only when it registers in time); a short ttl lets the woken node be waited for again
    # well before the run ends, instead of going alone in its last rounds as peers finish.
    cfg = _cfg(tmp_path, total_steps=90, eval_every=6,
               network={"min_peers": 3, "allreduce_timeout": 6.0, "matchmaking_window": 3.0,
                        "matchmaking_timeout": 8.0, "peer_ttl": 6.0})
    with nodes_by_hand(cfg) as swarm:
        nodes = [swarm.start(i) for i in range(3)]
        first = nodes[2].wait_for("progress", 240)
        # the trainer only: its DHT child keeps running
        os.kill(nodes[2].proc.pid, signal.SIGSTOP)
        try:
            # the others time out on it, drop it and train on for two more eval periods
            seen = nodes[0].wait_for("progress", 120)
            while seen["step"] < first["step"] + 3 * cfg.eval_every:
                seen = nodes[0].wait_for("progress", 120)
        finally:
            os.kill(nodes[2].proc.pid, signal.SIGCONT)
        summaries = [n.wait_for("summary", 300) for n in nodes]
        for n in nodes:
            assert n.proc.wait(timeout=30) == 0
    log = (tmp_path / "n2.log").read_text()
    assert "state sync: recovered step" in log, log[-3000:]
    for s in summaries:
        assert s["steps"] == 90
    assert_one_model(summaries)
