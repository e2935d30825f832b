"""Chaos, fast cases (the full matrix is benchmarks/testbed/chaos.py): one swarm of three nodes on
loopback (nano model) in which each supervised part of some node is broken once, one at a
time: kill -9 of the DHT process and of p2pd, each listener (data, state, status) destroyed
under the node, and short stops (SIGSTOP of the DHT process, a data listener that drops
everything). Every fault must heal within a bound. Last, node-2's data listener drops
everything for longer than `supervise.give_up_after`: node-2 must give up loudly (exit 1,
a one-line reason, a checkpoint) while the others train on. The swarm-level invariant is
asserted from outside (exit codes, the summaries' `outer_digest`, the last stderr line).

Needs `ss` (to destroy a socket) and root with iptables (to filter a port); about two
minutes on an idle 2-core box, up to seven on one shared with other swarms.
"""

from __future__ import annotations

import os
import shutil

import pytest

pytest.importorskip("hivemind")

from testbed.chaos import Fault, run_chaos  # noqa: E402
from tests.support.config import nano_config  # noqa: E402
from tests.support.swarm import assert_one_model  # noqa: E402

REASON = ("needs root, `ss` and `iptables`"
          if os.geteuid() != 0 or not shutil.which("ss") or not shutil.which("iptables")
          else None)
pytestmark = [pytest.mark.slow, pytest.mark.host_network,
              pytest.mark.skipif(REASON is not None, reason=REASON or "")]

CFG = {
    "run_id": "chaos-test", "seed": 3, "total_steps": 250, "eval_every": 5,
    "data": {"eval_batches": 1},
    "diloco": {"sync_every": 12,
               # A fixed clock (250 reference steps: 105 s, what the faults need; they fall
               # on the swarm's steps 15..160, node-2 gives up about 40 steps after the last
               # one and the others train on for about 50 more):
               # rounds stalled by the faults would otherwise slow it and stretch the run.
               "step_seconds": 0.42, "retune_clock": False},
    "network": {"matchmaking_window": 3.0, "matchmaking_timeout": 8.0,
                "allreduce_timeout": 8.0, "max_attempts": 3, "peer_ttl": 6.0},
    "supervise": {"check_interval": 1.0, "check_timeout": 3.0, "give_up_after": 12.0},
}
# One part at a time, on different nodes, spaced so each heals before the next.
FAULTS = [
    Fault(0, "dht", "kill", at_step=15),
    Fault(1, "p2pd", "kill", at_step=35),
    Fault(2, "data", "kill", at_step=55),
    Fault(0, "state", "kill", at_step=75),
    Fault(1, "status", "kill", at_step=95),
    Fault(2, "dht", "stop", at_step=115, seconds=6.0),
    Fault(0, "data", "stop", at_step=135, seconds=10.0),  # noticed after 2 unanswered checks
]
GIVE_UP = Fault(2, "data", "stop", at_step=160, seconds=30.0)  # > give_up_after + noticing
HEAL_BOUND_S = 15.0  # check_interval + a restart, or the stop's length + a check


@pytest.mark.timeout(720)
def test_three_nodes_heal_every_broken_part_and_end_with_one_model(tmp_path):
    cfg = nano_config(**CFG)
    res = run_chaos(cfg, 3, [*FAULTS, GIVE_UP], tmp_path, deadline_s=660)
    rows = res.per_fault()
    for row in rows:
        print(row)
    assert res.violations() == []
    assert len(res.faults) == len(FAULTS) + 1, "some fault was never injected"
    for row in rows[:-1]:
        assert row["heal_s"] is not None and row["heal_s"] <= HEAL_BOUND_S, row
    quitter = res.nodes["node-2"]
    assert quitter.returncode == 1
    assert quitter.last_stderr_line.startswith("dilonode: data down for "), quitter
    assert "supervise.give_up_after = 12" in quitter.last_stderr_line
    assert list((tmp_path / "node-2" / "ckpt").glob("ckpt-*.json")), "no exit checkpoint"
    others = {name: res.nodes[name] for name in ("node-0", "node-1")}
    for name, e in others.items():  # the others healed everything and trained on
        assert e.returncode == 0, (name, e.last_stderr_line)
    assert_one_model({name: e.summary for name, e in others.items()})
