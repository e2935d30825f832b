"""A mixed swarm on loopback: one node 3x slower per step than the other two.

Rounds open on the swarm clock, so the slow node takes part in every round with the tokens
it trained, nobody waits for it in the run, and every node ends with identical outer
weights. The nodes' recorded schedules, replayed in process over the simulator's
`LocalGroup` (`sim.replay_traces`), give the same weights: the simulator and the daemon
are one algorithm at unequal speeds too.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("hivemind")

from dilonode.sim.training import replay_traces  # noqa: E402
from tests.support.config import LOOPBACK_NETWORK, nano_config  # noqa: E402
from tests.support.swarm import assert_one_model, run_swarm  # noqa: E402

pytestmark = pytest.mark.slow

SLOW = 2  # node 2 runs 3x the batch: each of its steps costs about 3x
BASE = {
    "run_id": "hetero-test", "seed": 9, "eval_every": 12, "total_steps": 48,
    "diloco": {"sync_every": 12, "num_fragments": 2, "pacing": "time",
               # A round period of 3 s: several times a loopback round (0.25-1 s here,
               # depending on the load of the shared box).
               "step_seconds": 0.25},
    "codec": {"name": "float32"},
    "network": LOOPBACK_NETWORK,
    "paths": {"trace": True},
}


@pytest.mark.timeout(420)
def test_a_3x_slower_node_takes_part_in_every_round_and_all_end_identical(tmp_path):
    cfg = nano_config(tmp_path, **BASE)
    end = run_swarm(cfg, 3, {SLOW: ["--set", "data.batch_size=12"]})
    assert end.codes == [0, 0, 0]
    summaries = end.summaries
    assert sorted(summaries) == ["node-0", "node-1", "node-2"], summaries
    s = [summaries[f"node-{i}"] for i in range(3)]
    assert_one_model(summaries)
    # 4 rounds per fragment in 48 reference steps, plus the end-of-run round of fragment 0.
    for x in s:
        assert x["rounds_per_fragment"] == {"0": 5, "1": 4}, x
        assert x["rounds_with_peers"] == 9 and x["missed_rounds"] == 0, x
    # The slow node trained fewer steps; the fast ones waited for a result only when a
    # round outlasted its period (a loaded 2-core box can stretch one), not every round.
    assert s[SLOW]["steps"] < min(s[0]["steps"], s[1]["steps"])
    assert all(s[i]["late_rounds"] <= 3 for i in (0, 1)), [x["late_rounds"] for x in s]

    traces = [[json.loads(line) for line in
               (tmp_path / f"node-{i}" / "trace.jsonl").read_text().splitlines()]
              for i in range(3)]
    assert all(e["group"] == 3 for t in traces for e in t if e["event"] == "land")
    cfgs = [cfg, cfg, nano_config(**BASE, data={"batch_size": 12})]
    workers = replay_traces(cfgs, traces, [x["steps"] for x in s],
                            peers=[x["peer_id"] for x in s])
    want = torch.load(tmp_path / "node-0" / "outer.pt")
    for w in workers:
        got = w.outer_model().state_dict()
        for name, ref in want.items():
            torch.testing.assert_close(got[name], ref, atol=1e-5, rtol=0, msg=name)
