"""The figures a churn run is judged by (testbed/churn.py), on hand-made event timelines."""

import pytest

from testbed.churn import ChurnPlan, ChurnResult, NodeTrack
from testbed.hosts import tbf_args


def _track(name, events, killed_at=None):
    t = NodeTrack(name, name, started_at=0.0, killed_at=killed_at)
    t.progress = [(at, step, rounds) for at, step, rounds in events]
    return t


def _result():
    a = _track("node-0", [(10, 2, {"0": 1}), (12, 4, {"0": 1, "1": 1}), (30, 6, {"0": 2, "1": 1})],
               killed_at=31)
    b = _track("node-1", [(11, 2, {"0": 1}), (13, 4, {"0": 1, "1": 1}), (15, 6, {"0": 2, "1": 1}),
                          (40, 8, {"0": 2, "1": 2})])
    j = _track("node-2", [(35, 6, {}), (41, 8, {"0": 1, "1": 1})])
    return ChurnResult({t.name: t for t in (a, b, j)}, kills=[(31.0, "node-0", "node-2")],
                       training_at=10.0, ended_at=50.0, timeout_s=8.0)


def test_step_gap_is_the_longest_time_a_node_stood_still():
    assert _result().max_step_gap_s() == 25.0  # node-1: 15 -> 40


def test_fragment_gap_counts_advances_on_any_node():
    # fragment 0 advanced at 10, 11, 15, 30, 41; fragment 1 at 12, 13, 40, 41
    assert _result().fragment_gaps_s() == {"0": 15.0, "1": 27.0}


def test_advances_are_counted_per_period_between_kills():
    assert _result().advances_per_period() == [{"0": 4, "1": 2}, {"0": 1, "1": 2}]


def test_round_advances_ignore_repeated_counts():
    t = _track("n", [(1, 1, {"0": 1}), (2, 2, {"0": 1}), (3, 3, {"0": 3})])
    assert t.round_advances() == {"0": [1, 3]}


def test_bad_plans_and_rates_are_refused_with_the_field_named():
    with pytest.raises(ValueError, match="nodes=1"):
        ChurnPlan(nodes=1)
    with pytest.raises(ValueError, match="rate_mbit = 0"):
        tbf_args(0)


def test_tbf_burst_covers_ten_milliseconds_and_a_gso_burst():
    assert tbf_args(100)[:5] == ["tbf", "rate", "100000kbit", "burst", "125000"]
    assert tbf_args(1)[4] == str(32 * 1024)
