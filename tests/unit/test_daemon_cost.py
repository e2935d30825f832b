"""benchmarks/loopback/daemon_cost.py's arithmetic: the per-step breakdown of a node's summary,
the ratios across repeats and what (c) costs beyond (b), on hand-made summaries."""

from __future__ import annotations

import pytest

from benchmarks.loopback.daemon_cost import (
    breakdown,
    cores_for,
    cpu_per_step,
    extra_per_step,
    row_of,
    summarize,
)


def _summary(steps: int = 100, train_s: float = 12.0, step_s: float = 10.0,
             wait_s: float = 1.0, other_cpu_s: float = 0.5, tokens_per_s: float = 1000.0):
    return {"worker_id": "0", "steps": steps, "train_s": train_s, "tokens_per_s": tokens_per_s,
            "phases": {"step_s": step_s, "start_s": 0.2, "apply_s": 0.3, "wait_s": wait_s,
                       "hooks_s": 0.1, "train_cpu_s": 10.5, "other_cpu_s": other_cpu_s}}


def test_breakdown_is_per_step_and_the_rest_is_what_no_phase_holds():
    b = breakdown(_summary())
    assert b["step"] == pytest.approx(100.0) and b["wait"] == pytest.approx(10.0)
    assert b["total"] == pytest.approx(120.0)
    # 120 - (100 + 2 + 3 + 10 + 1) ms per step
    assert b["rest"] == pytest.approx(4.0)
    assert b["other_cpu"] == pytest.approx(5.0) and b["train_cpu"] == pytest.approx(105.0)
    assert cpu_per_step(b) == pytest.approx(110.0)
    # The end-of-run rounds' waiting is outside train_s and so outside the phases: the
    # rest never goes negative even when the phases' rounding overshoots.
    assert breakdown(_summary(train_s=11.0, step_s=10.5))["rest"] == 0.0


def test_a_summary_without_phases_is_refused_by_name():
    with pytest.raises(ValueError, match="summary of 7"):
        breakdown({"worker_id": "7", "steps": 3, "train_s": 1.0, "phases": {}})


def test_ratios_spread_over_repeats_and_the_extra_cost_of_two_nodes():
    plain = {"tokens_per_s": 1000.0, "step_ms": 100.0, "cpu_ms": 99.0}
    rows = [row_of(0, plain, _summary(tokens_per_s=990.0),
                   [_summary(wait_s=3.0, tokens_per_s=800.0),
                    _summary(wait_s=5.0, tokens_per_s=900.0)]),
            row_of(1, plain, _summary(tokens_per_s=950.0), [_summary(tokens_per_s=950.0)] * 2),
            row_of(2, plain, _summary(tokens_per_s=1000.0), [_summary(tokens_per_s=700.0)] * 2)]
    assert [r["b_over_a"] for r in rows] == [0.99, 0.95, 1.0]
    assert rows[0]["c_over_b"] == pytest.approx(850 / 990, abs=1e-4)
    assert rows[0]["b_over_a_cpu"] == pytest.approx(99 / 110, abs=1e-4)
    s = summarize(rows)
    assert s["b_over_a"] == {"median": 0.99, "min": 0.95, "max": 1.0} and s["met"]
    assert not summarize(rows, target=0.995)["met"]
    # (c) waited 30 and 50 ms per step in repeat 0, 10 elsewhere: 10 + 40/6 on average.
    assert s["c_extra_ms"]["wait"] == pytest.approx((30 + 50 + 4 * 10) / 6 - 10)
    assert next(iter(s["c_extra_ms"])) == "wait"  # the largest first


def test_extra_per_step_orders_the_parts_by_cost():
    base = {"step": 10.0, "start": 1.0, "apply": 1.0, "wait": 0.0, "hooks": 0.5, "rest": 0.5}
    more = base | {"step": 14.0, "wait": 1.0, "hooks": 0.0}
    assert list(extra_per_step(base, more).items())[:3] == [("step", 4.0), ("wait", 1.0),
                                                            ("start", 0.0)]


def test_each_node_and_the_bootstrap_get_a_core_by_the_names_local_swarm_uses():
    assert cores_for(2, 16) == {"node-0": 0, "node-1": 1, "bootstrap": 15}
    assert cores_for(2, 2) == {"node-0": 0, "node-1": 1, "bootstrap": 1}
    assert cores_for(1, 1) == {"node-0": 0, "bootstrap": 0}
