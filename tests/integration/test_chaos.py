"""Chaos, fast cases (the full matrix is benchmarks/chaos.py): one swarm of three nodes on
loopback (nano model) in which each supervised part of some node is broken once, one at a
time: kill -9 of the DHT process and of p2pd, each listener (data, state, status) destroyed
under the node, and short stops (SIGSTOP of the DHT process, a data listener that drops
everything). The swarm-level invariant is asserted from outside (exit codes, the summaries'
`outer_digest`, the last stderr line), and every fault must heal within a bound.

Needs `ss` (to destroy a socket) and root with iptables (to filter a port); about a minute
and a half on an idle 2-core box.
"""

from __future__ import annotations

import os
import shutil

import pytest

pytest.importorskip("hivemind")

from deploy.chaos import Fault, run_chaos  # noqa: E402
from dilonode.config import load_config  # noqa: E402

REASON = ("needs root, `ss` and `iptables`"
          if os.geteuid() != 0 or not shutil.which("ss") or not shutil.which("iptables")
          else None)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

CFG = {
    "run_id": "chaos-test", "seed": 3, "total_steps": 170, "eval_every": 5, "device": "cpu",
    "model": {"preset": "nano"}, "data": {"seq_len": 32, "batch_size": 4, "eval_batches": 1},
    "diloco": {"mode": "streaming", "sync_every": 12, "num_fragments": 3,
               "fragment_sync_delay": 1, "fragment_update_alpha": 0.5},
    "network": {"matchmaking_window": 3.0, "matchmaking_timeout": 8.0,
                "allreduce_timeout": 8.0, "max_attempts": 3, "peer_ttl": 6.0},
    "supervise": {"check_interval": 1.0, "check_timeout": 3.0, "give_up_after": 60.0},
}
# One part at a time, on different nodes, spaced so each heals before the next.
FAULTS = [
    Fault(0, "dht", "kill", at_step=15),
    Fault(1, "p2pd", "kill", at_step=35),
    Fault(2, "data", "kill", at_step=55),
    Fault(0, "state", "kill", at_step=75),
    Fault(1, "status", "kill", at_step=95),
    Fault(2, "dht", "stop", at_step=115, seconds=6.0),
    Fault(0, "data", "stop", at_step=135, seconds=6.0),
]
HEAL_BOUND_S = 15.0  # check_interval + a restart, or the stop's length + a check


@pytest.mark.timeout(420)
def test_three_nodes_heal_every_broken_part_and_end_with_one_model(tmp_path):
    cfg = load_config(overrides=CFG)
    res = run_chaos(cfg, 3, FAULTS, tmp_path, deadline_s=360)
    rows = res.per_fault()
    for row in rows:
        print(row)
    assert res.violations() == []
    assert len(res.faults) == len(FAULTS), "some fault was never injected"
    for e in res.nodes.values():  # every part healed: nobody had to give up
        assert e.returncode == 0, (e.name, e.last_stderr_line)
        assert e.summary["steps"] == cfg.total_steps
    for row in rows:
        assert row["heal_s"] is not None and row["heal_s"] <= HEAL_BOUND_S, row
    assert len({e.summary["outer_digest"] for e in res.nodes.values()}) == 1
