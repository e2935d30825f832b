"""Churn on the WAN test bed (testbed/churn.py): 4 nodes, one SIGKILLed and one joining every
K seconds. The run goes on, every fragment keeps advancing rounds, joiners recover the state
from peers and contribute, no node stalls longer than two all-reduce timeouts, and the final
outer weights (identical on every survivor) evaluate close to a run without churn.

Needs root (network namespaces); skipped with the reason otherwise. 400 steps of the nano
model: about 1.5 minutes on an idle 2-core box, about 5 on one shared with other work.
"""

from __future__ import annotations

import pytest

from testbed.hosts import unavailable_reason

REASON = unavailable_reason()
pytestmark = [pytest.mark.slow, pytest.mark.host_network,
              pytest.mark.skipif(REASON is not None, reason=REASON or "")]

TIMEOUT_S = 10.0
REF_STEPS = 400  # steps per worker of the fault-free reference
CFG = {
    "run_id": "churn-test", "seed": 11, "total_steps": 320, "eval_every": 2,
    "data": {"eval_batches": 1},
    "diloco": {"sync_every": 24,
               # A fixed clock (320 reference steps: about 2 minutes): rounds stalled by the
               # kills would otherwise slow it and stretch the run.
               "step_seconds": 0.4, "retune_clock": False},
    "codec": {"name": "int4"},
    # Short record lifetimes so a killed peer stops being expected at matchmaking soon. Until
    # then every attempt waits the whole window for it (up to 3 attempts a round), so the
    # window is kept well under the timeout; it must still outlast the step drift of 4
    # trainers sharing 2 cores, or a group closes without a late peer.
    "network": {"matchmaking_window": 5.0, "matchmaking_timeout": 12.0,
                "allreduce_timeout": TIMEOUT_S, "max_attempts": 3, "peer_ttl": 6.0,
                "bandwidth_mbps": 50.0},
    "status": {"enabled": False},
}


@pytest.mark.timeout(480)
def test_four_nodes_survive_kills_and_joins(tmp_path):
    pytest.importorskip("hivemind")
    from dilonode.sim.training import simulate
    from testbed.churn import ChurnPlan, run_churn
    from tests.support.config import nano_config
    from tests.support.swarm import assert_one_model

    cfg = nano_config(tmp_path, **CFG)
    # A kill every 10 s or every 50 swarm steps (0.4 s each), whichever comes first, and
    # none after swarm step 170: 150 steps (60 s) remain for the joiners to start (~10-30 s)
    # and take part.
    plan = ChurnPlan(nodes=4, period_s=10.0, period_steps=50, cycles=3, last_kill_step=170,
                     deadline_s=450)
    res = run_churn(cfg, plan, rate_mbit=50)

    assert len(res.kills) >= 2, f"only {len(res.kills)} kill/join cycles happened"
    killed = {k[1] for k in res.kills}
    survivors = res.survivors()
    alive_at_end = {n for n in res.nodes if n not in killed}
    assert set(survivors) == alive_at_end, (sorted(survivors), sorted(alive_at_end))
    for s in survivors.values():
        assert s["skipped_rounds"] == 0, s["dropped_peers"]
    # Every survivor ran to the swarm clock's end (joiners with fewer steps of their own)
    # and found its final weights identical to its peers'.
    assert_one_model(survivors)

    joiners = [res.nodes[k[2]] for k in res.kills]
    for j in joiners:
        if j.name in survivors:  # a joiner that stayed: recovered, then took part
            assert j.recovered is not None and j.recovered["step"] > 0, j.name
            assert j.recovered["bytes"] > 0, j.recovered
            assert all(n > 0 for n in survivors[j.name]["rounds_per_fragment"].values())
    assert any(j.name in survivors for j in joiners)

    # Rounds are placed by step: steps that never stand still for long, with no round skipped
    # (asserted above), mean every fragment keeps advancing; kills on an idle box come faster
    # than a fragment's cadence, so only the stretch after the last kill is checked per fragment.
    # No stall longer than two all-reduce timeouts (the bound), also when kills come
    # faster than that: a dead peer stops being waited for as soon as it hung up on the data
    # plane, a leader that died before closing costs a window and a second, and joiners take
    # part in the rounds that wait for them instead of waiting for those to land.
    # (Before these, one kill cost 11.5 s and two leaders killed back to back 22 s.)
    bound = 2 * cfg.network.allreduce_timeout
    print(f"longest step stall {res.max_step_gap_s():.1f} s (bound {bound:.0f} s)")
    assert res.max_step_gap_s() <= bound, (res.max_step_gap_s(), bound)
    after_last_kill = res.advances_per_period()[-1]
    assert sorted(after_last_kill) == ["0", "1", "2"], after_last_kill
    assert all(n > 0 for n in after_last_kill.values()), res.advances_per_period()

    # Churn must not cost the model: the survivors (paced by the swarm clock, each trained
    # thousands of own steps) end no worse than 10% above 4 workers trained without faults
    # for as many steps each, at most REF_STEPS (a reference of their full length would cost
    # minutes of CPU here; benchmarks/testbed/churn.py compares with a full run without churn).
    steps = min(REF_STEPS, *(s["steps"] for s in survivors.values()))
    ref = simulate(cfg.model_copy(update={
        "total_steps": steps, "sim": cfg.sim.model_copy(update={"workers": 4}),
        "diloco": cfg.diloco.model_copy(update={"pacing": "steps"})}))
    loss = next(iter(survivors.values()))["final_eval_loss"]
    assert loss <= 1.1 * ref.final_eval_loss, (loss, ref.final_eval_loss)
