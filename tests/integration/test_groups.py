"""Bounded groups on a real local swarm: 6 `dilonode run` processes with
`network.max_group_size = 3` average every round in two groups of 3 that change from round
to round, mix their outer states, and still end the run with identical outer weights on
every node (end-of-run mixing rounds, then the agreement check's adoption)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("hivemind")

from tests.support.config import LOOPBACK_NETWORK, nano_config  # noqa: E402
from tests.support.swarm import assert_one_model, run_swarm  # noqa: E402

pytestmark = pytest.mark.slow

NODES = 6
BASE = {
    "run_id": "groups-test", "seed": 11, "eval_every": 12, "total_steps": 24,
    "diloco": {"num_fragments": 2, "pacing": "steps"},
    "network": {**LOOPBACK_NETWORK, "max_group_size": 3, "final_mix_rounds": 2},
    "checkpoint": {"every_steps": 0, "on_exit": False},
}


@pytest.mark.timeout(420)
def test_six_nodes_in_groups_of_three_end_in_agreement(tmp_path):
    end = run_swarm(nano_config(tmp_path, **BASE), NODES)
    summaries = end.summaries
    assert end.codes == [0] * NODES
    assert sorted(summaries) == [f"node-{i}" for i in range(NODES)], summaries
    assert_one_model(summaries)
    for x in summaries.values():
        assert x["grouped"] and x["largest_group"] == 3, x
        assert x["skipped_rounds"] == 0, x["dropped_peers"]
        # Each stayed until every peer on its weights had ended its own check (the last
        # one to check once read stale records of peers that had left, and exited 3).
        assert x["agreement"]["unconfirmed"] == [], x["agreement"]
    states = [torch.load(tmp_path / f"node-{i}" / "outer.pt") for i in range(NODES)]
    for state in states[1:]:
        for name, ref in states[0].items():
            assert torch.equal(state[name], ref), name
