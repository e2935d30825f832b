"""The fragment sync plan, checked exhaustively over a few periods against hand-made tables."""

import pytest

from dilonode.algo.schedule import SyncLand, SyncPlan, SyncStart


def test_plain_diloco_syncs_every_h_and_merges_at_once():
    plan = SyncPlan(sync_every=5, num_fragments=1, delay=0)
    acts = {s: plan.actions(s) for s in range(1, 21)}
    assert {s for s, a in acts.items() if a} == {5, 10, 15, 20}
    assert acts[10] == [SyncStart(0, 1), SyncLand(0, 1)]  # start before land when tau = 0


def test_streaming_offsets_and_delay_hand_computed():
    plan = SyncPlan(sync_every=30, num_fragments=3, delay=2)
    assert [plan.offset(p) for p in range(3)] == [10, 20, 30]
    expected = {
        10: [SyncStart(0, 0)], 12: [SyncLand(0, 0)],
        20: [SyncStart(1, 0)], 22: [SyncLand(1, 0)],
        30: [SyncStart(2, 0)], 32: [SyncLand(2, 0)],
        40: [SyncStart(0, 1)], 42: [SyncLand(0, 1)],
        50: [SyncStart(1, 1)], 52: [SyncLand(1, 1)],
        60: [SyncStart(2, 1)], 62: [SyncLand(2, 1)],
    }
    got = {s: plan.actions(s) for s in range(1, 64) if plan.actions(s)}
    assert got == expected


@pytest.mark.parametrize("h,p,tau", [(1, 1, 0), (7, 3, 0), (12, 4, 3), (100, 7, 5), (9, 9, 8)])
def test_every_round_starts_once_then_lands_tau_later_and_fragments_alternate(h, p, tau):
    plan = SyncPlan(h, p, tau)
    starts, lands, in_flight = {}, {}, set()
    for step in range(1, 5 * h + 1):
        for a in plan.actions(step):
            if isinstance(a, SyncStart):
                assert a.fragment not in in_flight, "a fragment restarted before landing"
                in_flight.add(a.fragment)
                starts[(a.fragment, a.round)] = step
            else:
                in_flight.discard(a.fragment)
                lands[(a.fragment, a.round)] = step
    for key, s in starts.items():
        if s + tau <= 5 * h:
            assert lands[key] == s + tau
        assert s == plan.start_step(*key)
    for frag in range(p):
        rounds = sorted(r for f, r in starts if f == frag)
        assert rounds == list(range(len(rounds)))
        steps = [starts[(frag, r)] for r in rounds]
        assert all(b - a == h for a, b in zip(steps, steps[1:], strict=False))
        assert plan.rounds_started(frag, 5 * h) == len(rounds)
    # staggered: no two fragments start on the same step
    assert len(set(starts.values())) == len(starts)


@pytest.mark.parametrize("h,p,tau", [(0, 1, 0), (5, 6, 0), (5, 0, 0), (5, 1, 5), (5, 1, -1)])
def test_bad_plans_are_refused_with_the_field_named(h, p, tau):
    with pytest.raises(ValueError, match="diloco"):
        SyncPlan(h, p, tau)
