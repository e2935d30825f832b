"""Restarts of a running swarm, on one swarm of 3 nodes on 127.0.0.1 (about 3 min alone on 2
cores, one set-up for both):

1. A rolling upgrade within one protocol version: every node is stopped in turn (SIGTERM)
   and started again with --resume, standing for the new release (the current code is both
   releases here), rejoining by state sync before the next one goes.
2. The whole swarm restarts: every node killed (SIGKILL) at once, then started again with
   --resume one after another, the one with the oldest checkpoint first. Training continues
   from the newest state any node held: no node's state after the restart is older than the
   newest checkpoint.

The swarm ends as one model."""

from __future__ import annotations

import re
import signal

import pytest

from tests.support.config import LOOPBACK_NETWORK, nano_config
from tests.support.swarm import assert_one_model, nodes_by_hand
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

# node-0 checkpoints only when it stops (in the rolling upgrade): its newest checkpoint is
# older than the others', which go on checkpointing every 6 steps after it.
SPARSE_CHECKPOINTS = ("--set", "checkpoint.every_steps=0")


def _newest_checkpoint(out) -> int:
    steps = [int(m.group(1)) for p in (out / "ckpt").glob("ckpt-*.json")
             if (m := re.match(r"ckpt-(\d+)\.json", p.name))]
    return max(steps, default=0)


def _extra(i: int) -> tuple[str, ...]:
    return SPARSE_CHECKPOINTS if i == 0 else ()


@pytest.mark.timeout(600)
def test_a_rolling_upgrade_then_every_node_killed_at_once_end_as_one_newest_model(
        tmp_path) -> None:
    cfg = nano_config(tmp_path, run_id="restart-test", total_steps=400,
                      network=dict(LOOPBACK_NETWORK, min_peers=3),
                      diloco={"pacing": "steps"}, checkpoint={"every_steps": 6})
    with nodes_by_hand(cfg) as hand:
        nodes = {i: hand.start(i, *_extra(i)) for i in range(3)}
        nodes[0].wait_for("progress", 120, min_step=6)
        for i in range(3):  # the rolling upgrade
            nodes[i].proc.send_signal(signal.SIGTERM)
            assert nodes[i].proc.wait(timeout=60) == 0, f"node-{i} did not stop cleanly"
            nodes[i] = hand.start(i, "--resume", *_extra(i))
            nodes[i].wait_for("progress", 120)  # rejoined: it trains again
        for node in nodes.values():
            node.proc.send_signal(signal.SIGKILL)
        for node in nodes.values():
            node.proc.wait(timeout=30)
        held = {i: _newest_checkpoint(n.out) for i, n in nodes.items()}
        newest = max(held.values())
        assert held[0] < newest, f"the checkpoints do not differ: {held}"
        # The restarted swarm trains a few rounds past the newest state, not the rest of
        # the 400 steps the first life was given so that it would not end mid-upgrade.
        until = ("--steps", str(newest + 24))
        for i in sorted(held, key=held.get):  # the oldest checkpoint comes back first
            nodes[i] = hand.start(i, "--resume", *until, *_extra(i))
            wait_until(lambda n=nodes[i]: "resumed from checkpoint" in n.log.read_text(),
                       120, what=f"node-{i} resumed")
        summaries = {f"node-{i}": n.wait_for("summary", 300) for i, n in nodes.items()}
        logs = {i: n.log.read_text() for i, n in nodes.items()}
    assert_one_model(summaries)
    for i, text in logs.items():
        resumed = int(re.findall(r"resumed from checkpoint \S+ at step (\d+)", text)[-1])
        recovered = [int(s) for s in re.findall(r"recovered step (\d+)", text)]
        start = max([resumed, *recovered])
        assert start >= newest, (f"node-{i} went on from step {start}, older than the newest "
                                 f"checkpoint {newest} (held: {held})")
        # A node that came back before its peers catches up once they are live, before
        # its first round: it does not train on from its own older checkpoint.
        first_round = text.find("group dilonode/")
        assert 0 <= text.find("recovered step") < first_round or resumed >= newest, (
            f"node-{i} resumed at step {resumed} and took part in a round before it "
            f"fetched the newer state")
