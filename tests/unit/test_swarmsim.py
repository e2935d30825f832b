"""The in-process swarm harness (dilonode/sim/swarm_scale.py) on a small swarm: bounded groups,
mixing that converges, per-node costs that do not grow with the swarm, and churn that
costs a round at most one timeout and a window."""

from __future__ import annotations

from dilonode.sim.swarm_scale import SwarmSimConfig, run_swarm, summarize

SMALL = SwarmSimConfig(nodes=40, max_group_size=8, rounds=5, numel=256, init_spread=1.0,
                       update_scale=0.0, timeout_s=10.0)


def test_groups_are_bounded_and_states_converge_to_the_mean() -> None:
    stats = run_swarm(SMALL)
    assert all(s.group_max <= 8 and s.groups >= 5 for s in stats)
    spreads = [s.spread_max for s in stats]
    assert spreads == sorted(spreads, reverse=True)
    assert spreads[-1] < 0.01, spreads  # 5 < log2(40) rounds
    assert all(s.failed_attempts == 0 and s.alone == 0 for s in stats)


def test_per_node_costs_do_not_grow_with_the_swarm() -> None:
    small = summarize(run_swarm(SMALL))
    large = summarize(run_swarm(SwarmSimConfig(**{**SMALL.__dict__, "nodes": 160,
                                                  "rounds": 2})))
    assert large["peers_per_node_max"] <= 7
    assert large["bytes_per_node_mean"] <= 1.2 * small["bytes_per_node_mean"]
    assert large["reads_per_node_mean"] <= 1.2 * max(small["reads_per_node_mean"], 32)


def test_churn_costs_a_round_at_most_two_timeouts() -> None:
    cfg = SwarmSimConfig(**{**SMALL.__dict__, "churn_per_min": 0.2, "rounds": 6,
                            "update_scale": 1e-3, "init_spread": 0.0, "seed": 3})
    stats = run_swarm(cfg)
    assert sum(s.left for s in stats) > 0 and sum(s.joined for s in stats) > 0
    assert max(s.latency_max for s in stats) < 2 * cfg.timeout_s
    assert all(s.group_max <= 8 for s in stats)
