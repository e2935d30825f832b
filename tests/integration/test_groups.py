"""Bounded groups on a real local swarm: 6 `dilonode run` processes with
`network.max_group_size = 3` average every round in two groups of 3 that change from round
to round, mix their outer states, and still end the run with identical outer weights on
every node (end-of-run mixing rounds, then the agreement check's adoption)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("hivemind")

from dilonode.cli.local_swarm import LocalSwarm  # noqa: E402
from dilonode.config import load_config  # noqa: E402

pytestmark = pytest.mark.slow

NODES = 6
BASE = {
    "run_id": "groups-test", "seed": 11, "eval_every": 12, "device": "cpu",
    "total_steps": 24, "model": {"preset": "nano"},
    "data": {"seq_len": 32, "batch_size": 4, "eval_batches": 2},
    "inner": {"lr": 3e-3, "warmup_steps": 0},
    "diloco": {"mode": "streaming", "sync_every": 6, "num_fragments": 2,
               "fragment_sync_delay": 1, "fragment_update_alpha": 0.5, "pacing": "steps"},
    "network": {"matchmaking_window": 20.0, "matchmaking_timeout": 40.0,
                "allreduce_timeout": 20.0, "max_attempts": 2, "max_group_size": 3,
                "final_mix_rounds": 2},
    "checkpoint": {"every_steps": 0, "on_exit": False},
}


@pytest.mark.timeout(420)
def test_six_nodes_in_groups_of_three_end_in_agreement(tmp_path):
    cfg = load_config(overrides={**BASE, "paths": {"out_dir": str(tmp_path)}})
    swarm = LocalSwarm(cfg, NODES)
    try:
        swarm.start()
        summaries = swarm.follow()
    finally:
        swarm.stop()
    assert [p.returncode for p in swarm.procs] == [0] * NODES
    assert sorted(summaries) == [f"node-{i}" for i in range(NODES)], summaries
    s = list(summaries.values())
    for x in s:
        assert x["grouped"] and x["largest_group"] == 3, x
        assert x["skipped_rounds"] == 0, x["dropped_peers"]
        assert x["agreement"]["agrees"] is True, x["agreement"]
        # Each stayed until every peer on its weights had ended its own check (the last
        # one to check once read stale records of peers that had left, and exited 3).
        assert x["agreement"]["unconfirmed"] == [], x["agreement"]
    assert len({x["outer_digest"] for x in s}) == 1, "nodes disagree"
    states = [torch.load(tmp_path / f"node-{i}" / "outer.pt") for i in range(NODES)]
    for state in states[1:]:
        for name, ref in states[0].items():
            assert torch.equal(state[name], ref), name
