"""After a 2|2 network partition heals, the two halves of the swarm's DHT find each other
again (`node/remerge.py`): on the WAN test bed, a bootstrap and four training nodes (nano
model) at 100 Mbit/s; node-2 and node-3 are cut off from the bootstrap and node-0/node-1 for
15 s, then the cut is removed, and every node must read all peers live again within a bound
(without the re-merge they do not: benchmarks/testbed/chaos.py runs that control). Then the
halves, which trained apart, must become one model again: the chain check at matchmaking
leaves the half whose state does not stand out of a round, that half adopts the standing
state, and every node ends the run with identical outer weights (the end-of-run agreement
check says so, exit 0).

Needs root (network namespaces, iptables); skipped with the reason otherwise.
"""

from __future__ import annotations

import pytest

from testbed.hosts import unavailable_reason

REASON = unavailable_reason(partitions=True)
pytestmark = [pytest.mark.slow, pytest.mark.host_network,
              pytest.mark.skipif(REASON is not None, reason=REASON or "")]

MERGE_BOUND_S = 20.0  # the re-merge backoff (8 s here), a dial, a heartbeat and a read
CFG = {
    "run_id": "remerge-test", "seed": 4, "total_steps": 160, "eval_every": 5,
    "data": {"eval_batches": 1},
    "diloco": {"sync_every": 12,
               # A fixed clock: rounds stalled by the cut would otherwise slow it (retune)
               # and stretch the run past what the test needs.
               "step_seconds": 0.45, "retune_clock": False},
    "network": {"matchmaking_window": 3.0, "matchmaking_timeout": 8.0,
                "allreduce_timeout": 8.0, "max_attempts": 3, "peer_ttl": 6.0,
                "bandwidth_mbps": 100.0},
    "supervise": {"check_interval": 1.0, "check_timeout": 3.0, "remerge_backoff_max": 8.0},
}


@pytest.mark.timeout(420)
def test_two_halves_find_each_other_again_after_a_partition_heals(tmp_path):
    pytest.importorskip("hivemind")
    from testbed.chaos import Fault, run_chaos
    from testbed.hosts import Testbed
    from tests.support.config import nano_config
    from tests.support.swarm import assert_one_model

    cut = Fault(0, "partition", "stop", at_step=40, seconds=15.0,
                sides=(("bootstrap", "node-0", "node-1"), ("node-2", "node-3")))
    names = ["bootstrap", *(f"node-{i}" for i in range(4))]
    with Testbed(names, rate_mbit=100, rates={"bootstrap": None}) as bed:
        res = run_chaos(nano_config(**CFG), 4, [cut], tmp_path, bed=bed,
                        deadline_s=360)
    row = res.per_fault()[0]
    print(row)
    assert row["dht_merge_s"] is not None and row["dht_merge_s"] <= MERGE_BOUND_S, row
    assert res.violations() == []
    for name, e in res.nodes.items():
        assert e.returncode == 0 and e.summary is not None, (name, e.last_stderr_line)
    # one model again, and every node says so
    assert_one_model({name: e.summary for name, e in res.nodes.items()})
