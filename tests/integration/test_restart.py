"""The whole swarm restarts: every node killed (SIGKILL) at once mid-run, then started again
with --resume one after another, the one with the oldest checkpoint first. They end as one
model, and training continues from the newest state any node held: no node's state after
the restart is older than the newest checkpoint. 127.0.0.1, 3 nodes, about 3 min on 2
cores. Known to fail (xfail, strict): see the mark's reason."""

from __future__ import annotations

import re
import signal

import pytest

from tests.support.config import LOOPBACK_NETWORK, nano_config
from tests.support.swarm import assert_one_model, nodes_by_hand
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow


def _newest_checkpoint(out) -> int:
    steps = [int(m.group(1)) for p in (out / "ckpt").glob("ckpt-*.json")
             if (m := re.match(r"ckpt-(\d+)\.json", p.name))]
    return max(steps, default=0)


@pytest.mark.xfail(strict=True, reason=(
    "the first node back sees its killed peers' records until they expire, so min_peers "
    "does not hold it: it trains alone from its older checkpoint, its round counters pass "
    "the newer checkpoints', and the later nodes adopt that state (more rounds wins)"))
@pytest.mark.timeout(600)
def test_every_node_killed_at_once_resumes_from_the_newest_state(tmp_path) -> None:
    cfg = nano_config(tmp_path, run_id="restart-test", total_steps=240,
                      network=dict(LOOPBACK_NETWORK, min_peers=3),
                      diloco={"pacing": "steps"}, checkpoint={"every_steps": 6})
    with nodes_by_hand(cfg) as hand:
        # node-0 checkpoints less often: its newest checkpoint is older than the others'.
        nodes = {i: hand.start(i, *(["--set", "checkpoint.every_steps=30"] if i == 0 else []))
                 for i in range(3)}
        nodes[1].wait_for("progress", 180, min_step=70)
        for node in nodes.values():
            node.proc.send_signal(signal.SIGKILL)
        for node in nodes.values():
            node.proc.wait(timeout=30)
        held = {i: _newest_checkpoint(n.out) for i, n in nodes.items()}
        newest = max(held.values())
        assert held[0] < newest, f"the checkpoints do not differ: {held}"
        for i in sorted(held, key=held.get):  # the oldest checkpoint comes back first
            nodes[i] = hand.start(i, "--resume", *(["--set", "checkpoint.every_steps=30"]
                                                   if i == 0 else []))
            wait_until(lambda n=nodes[i]: "resumed from checkpoint" in n.log.read_text(),
                       120, what=f"node-{i} resumed")
        summaries = {f"node-{i}": n.wait_for("summary", 300) for i, n in nodes.items()}
        logs = {i: n.log.read_text() for i, n in nodes.items()}
    assert_one_model(summaries)
    for i, text in logs.items():
        resumed = int(re.search(r"resumed from checkpoint \S+ at step (\d+)", text).group(1))
        recovered = [int(s) for s in re.findall(r"recovered step (\d+)", text)]
        start = max([resumed, *recovered])
        assert start >= newest, (f"node-{i} went on from step {start}, older than the newest "
                                 f"checkpoint {newest} (held: {held})")
