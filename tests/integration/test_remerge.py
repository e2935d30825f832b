"""After a 2|2 network partition heals, the two halves of the swarm's DHT find each other
again (`swarm/remerge.py`): on the WAN test bed, a bootstrap and four training nodes (nano
model) at 100 Mbit/s; node-2 and node-3 are cut off from the bootstrap and node-0/node-1 for
15 s, then the cut is removed, and every node must read all peers live again within a
bound. Without the re-merge they never did (issue 20; benchmarks/chaos.py runs that
control). Whether the halves then average as one group again, and end with one model,
depends on their states agreeing: the per-round state agreement and adoption (the other
half of the issue's part 2) is not on this branch, so this test checks the DHT half, and
the invariant only as far as it must hold anyway (no crash, no silent exit).

Needs root (network namespaces, iptables); skipped with the reason otherwise.
"""

from __future__ import annotations

import pytest

from deploy.testbed import unavailable_reason

REASON = unavailable_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

MERGE_BOUND_S = 20.0  # the re-merge backoff (8 s here), a dial, a heartbeat and a read
CFG = {
    "run_id": "remerge-test", "seed": 4, "total_steps": 450, "eval_every": 5, "device": "cpu",
    "model": {"preset": "nano"}, "data": {"seq_len": 32, "batch_size": 4, "eval_batches": 1},
    "diloco": {"mode": "streaming", "sync_every": 12, "num_fragments": 3,
               "fragment_sync_delay": 1, "fragment_update_alpha": 0.5},
    "network": {"matchmaking_window": 3.0, "matchmaking_timeout": 8.0,
                "allreduce_timeout": 8.0, "max_attempts": 3, "peer_ttl": 6.0,
                "bandwidth_mbps": 100.0},
    "supervise": {"check_interval": 1.0, "check_timeout": 3.0, "remerge_backoff_max": 8.0},
}


@pytest.mark.timeout(420)
def test_two_halves_find_each_other_again_after_a_partition_heals(tmp_path):
    pytest.importorskip("hivemind")
    from deploy.chaos import Fault, run_chaos
    from deploy.testbed import Testbed
    from dilonode.config import load_config

    cut = Fault(0, "partition", "stop", at_step=60, seconds=15.0,
                sides=(("bootstrap", "node-0", "node-1"), ("node-2", "node-3")))
    names = ["bootstrap", *(f"node-{i}" for i in range(4))]
    with Testbed(names, rate_mbit=100, rates={"bootstrap": None}) as bed:
        res = run_chaos(load_config(overrides=CFG), 4, [cut], tmp_path, bed=bed,
                        deadline_s=360)
    row = res.per_fault()[0]
    print(row)
    assert row["dht_merge_s"] is not None and row["dht_merge_s"] <= MERGE_BOUND_S, row
    for e in res.nodes.values():  # every node ended: a summary, or a one-line reason
        assert e.summary is not None or e.last_stderr_line.startswith("dilonode: "), e
