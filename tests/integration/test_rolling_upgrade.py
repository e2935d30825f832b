"""A rolling upgrade within one protocol version: every node of a running swarm is stopped
in turn (SIGTERM) and started again with --resume, standing for the new release (the
current code is both releases here), rejoining by state sync before the next one goes; the
swarm ends as one model. 127.0.0.1, 3 nodes, about 3 min on 2 cores."""

from __future__ import annotations

import signal

import pytest

from tests.support.config import LOOPBACK_NETWORK, nano_config
from tests.support.swarm import assert_one_model, nodes_by_hand


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_node_upgraded_one_at_a_time_ends_as_one_model(tmp_path) -> None:
    cfg = nano_config(tmp_path, run_id="rolling-test", total_steps=240,
                      network=dict(LOOPBACK_NETWORK, min_peers=3),
                      diloco={"pacing": "steps"}, checkpoint={"every_steps": 6})
    with nodes_by_hand(cfg) as hand:
        nodes = {i: hand.start(i) for i in range(3)}
        nodes[0].wait_for("progress", 120, min_step=6)
        for i in range(3):
            nodes[i].proc.send_signal(signal.SIGTERM)
            assert nodes[i].proc.wait(timeout=60) == 0, f"node-{i} did not stop cleanly"
            nodes[i] = hand.start(i, "--resume")
            # Rejoined: it trains again, with the peers' state.
            nodes[i].wait_for("progress", 120)
        summaries = {f"node-{i}": n.wait_for("summary", 240) for i, n in nodes.items()}
    assert_one_model(summaries)
