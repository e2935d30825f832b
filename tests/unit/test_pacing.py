"""Pacing: the pure rules for when rounds start and land, and the simulator's virtual clock
(workers of different speeds) against its lockstep run."""

from __future__ import annotations

import math

import pytest
import torch

from dilonode.algo.pacing import (
    RETUNE_MAX_FACTOR,
    ROUND_TRIPS,
    StepPacer,
    SwarmClock,
    TimePacer,
    due_starts,
    expected_round_seconds,
    final_rounds,
    link_busy_seconds,
    retune_step_seconds,
)
from dilonode.algo.schedule import SyncPlan, SyncStart, auto_merge_delay
from dilonode.sim.training import simulate
from tests.support.config import merged, nano_config


def test_due_starts_matches_the_step_schedule_exactly():
    """Paced by steps (ref = own step, no lead) it is the plan's start list, step by step."""
    for h, p, tau in [(7, 3, 1), (12, 4, 3), (30, 3, 1), (5, 1, 0)]:
        plan = SyncPlan(h, p, tau)
        nxt = [0] * p
        for step in range(1, 6 * h + 1):
            got = due_starts(plan, nxt, float(step))
            want = [a for a in plan.actions(step) if isinstance(a, SyncStart)]
            assert got == want, (h, p, step)
            for a in got:
                nxt[a.fragment] = a.round + 1


def test_due_starts_with_a_lead_starts_at_the_last_boundary_before_the_opening():
    plan = SyncPlan(30, 3, 1)  # fragment 0 opens at 10, 40, 70...
    assert due_starts(plan, [0, 0, 0], 6.9, 3.0) == []  # the next boundary is before 10
    assert due_starts(plan, [0, 0, 0], 7.1, 3.0) == [SyncStart(0, 0)]  # the next is after
    assert due_starts(plan, [1, 0, 0], 12.0, 2.0) == []  # round 0 already started


def test_a_worker_paused_past_a_round_skips_to_the_newest_one_behind_by_one_takes_part():
    plan = SyncPlan(10, 2, 1)  # fragment 0 opens at 5, 15, 25, 35; fragment 1 at 10, 20, 30
    assert due_starts(plan, [0, 0], 36.0) == [SyncStart(0, 3), SyncStart(1, 2)]
    # One round behind (its next round and the one after have started): the next round.
    assert due_starts(plan, [2, 1], 36.0) == [SyncStart(0, 2), SyncStart(1, 1)]
    assert due_starts(plan, [3, 2], 36.0) == [SyncStart(0, 3), SyncStart(1, 2)]
    assert due_starts(plan, [0, 0], -math.inf, 1.0) == []  # no clock yet: nothing starts


def test_final_rounds_cover_every_fragment_trained_since_its_last_round():
    plan = SyncPlan(6, 3, 1)  # offsets 2, 4, 6: starts 2, 8 | 4, 10 | 6, 12
    assert final_rounds(plan, [2, 2, 2], 12) == [SyncStart(0, 2), SyncStart(1, 2)]
    # Fragment 2's round 1 (step 12) never starts in a run ending at 11: its final round
    # takes that number.
    assert final_rounds(plan, [2, 2, 1], 11) == [SyncStart(0, 2), SyncStart(1, 2),
                                                 SyncStart(2, 1)]
    diloco = SyncPlan(4, 1, 0)
    assert final_rounds(diloco, [3], 12) == []  # the last regular round ended the run
    assert final_rounds(diloco, [3], 13) == [SyncStart(0, 3)]
    # A worker that missed rounds joins the final ones under the same numbers.
    assert final_rounds(plan, [1, 0, 1], 11) == final_rounds(plan, [2, 2, 1], 11)


def test_a_state_fetched_after_the_peers_final_rounds_gets_no_round_of_its_own():
    # A node paused until its peers ended fetches their final state: fragments 0 and 1
    # already hold their final round (numbered 2), fragment 2 was fresh at the end. One
    # more round would step its outer weights alone (the swarm ended as two models: n2 in
    # test_resync once took [17, 17, 15] rounds where its peers held [16, 16, 15]).
    plan = SyncPlan(6, 3, 1)  # starts 2, 8 | 4, 10 | 6, 12
    assert final_rounds(plan, [3, 3, 2], 12) == []
    # Fetched while the peers had landed fragment 0's final round only: 1 still to do.
    assert final_rounds(plan, [3, 2, 2], 12) == [SyncStart(1, 2)]


def test_time_pacer_reads_the_clock_and_measures_its_own_step():
    now = [100.0]
    pacer = TimePacer(lambda: now[0], SwarmClock(t0=90.0, step_seconds=0.5))
    assert pacer.at_step(1) == (20.0, 0.0)  # no step time known yet: no lead
    now[0] = 101.0
    ref, lead = pacer.at_step(2)
    assert ref == 22.0 and lead == pytest.approx(2.0)  # a 1 s step = 2 reference steps
    assert TimePacer(lambda: 5.0).at_step(1) == (-math.inf, 0.0)  # clock not agreed yet
    assert StepPacer().at_step(7) == (7.0, 0.0)
    with pytest.raises(ValueError, match="step_seconds"):
        SwarmClock(0.0, 0.0)


BASE = {"seed": 1, "eval_every": 20, "total_steps": 40, "codec": {"name": "int4"},
        "diloco": {"sync_every": 10, "num_fragments": 2}}


def _cfg(**over):
    return nano_config(**merged(BASE, over))


def _outer(report_holder):
    return report_holder["w"][0].outer_flat()


@pytest.mark.parametrize("pacing", ["time", "steps"])
def test_virtual_clock_with_equal_speeds_is_the_lockstep_run_bit_for_bit(pacing):
    cfg = _cfg(sim={"workers": 3}, diloco={"pacing": pacing})
    got = {}
    lock = simulate(cfg, on_step=lambda s, ws: got.update(w=ws) if s == 40 else None)
    lock_outer = _outer(got)
    virt = simulate(cfg, virtual=True, on_step=lambda s, ws: got.update(w=ws))
    assert torch.equal(lock_outer, _outer(got))
    assert lock.outer_digest == virt.outer_digest and virt.workers_agree
    assert lock.rounds_per_fragment == virt.rounds_per_fragment == {0: 5, 1: 4}
    assert all(s["utilization"] == 1.0 for s in virt.worker_stats)


def test_mixed_speeds_every_worker_contributes_to_every_round_and_all_agree():
    cfg = _cfg(sim={"workers": 4, "speeds": [1.0, 1.0, 0.5, 0.25], "latency": 0.5})
    got = {}
    report = simulate(cfg, on_step=lambda s, ws: got.update(w=ws))
    workers = got["w"]
    assert report.workers_agree
    rounds = [w.stats.rounds for w in workers]
    assert all(r == rounds[0] for r in rounds) and rounds[0] == {0: 5, 1: 4}
    assert all(w.stats.alone == 0 and w.stats.missed == 0 for w in workers)
    steps = [w.step for w in workers]
    assert steps[0] == steps[1] > steps[2] > steps[3] >= steps[0] // 4 - 1
    # Fast workers never waited for a result in the run (tau = 1 step, latency half a
    # step); only the end-of-run round waits for the slowest worker's last boundary.
    assert all(w.stats.late == 0 for w in workers)
    assert report.worker_stats[0]["utilization"] > 0.95
    assert report.virtual_s == pytest.approx(40.0, abs=4.0)


def test_auto_merge_delay_is_half_the_gap_to_the_next_fragments_start():
    # H = 30, P = 3: starts at 10, 20, 30 -> merge 5 steps after each.
    assert auto_merge_delay(30, 3) == 5
    assert auto_merge_delay(10, 2) == 3  # gaps of 5: rounded up
    assert auto_merge_delay(31, 3) == 5  # starts 10, 20, 31: the narrowest gap decides
    assert auto_merge_delay(30, 1) == 15
    assert auto_merge_delay(3, 3) == 1  # gaps of one step: never 0 (that would block)
    for h, p in [(30, 3), (31, 3), (12, 5), (100, 7), (3, 3)]:
        plan = SyncPlan(h, p, auto_merge_delay(h, p))
        # Every round lands no later than the next round of any fragment starts.
        starts = sorted(plan.start_step(f, r) for f in range(p) for r in range(3))
        assert all(a + plan.delay <= b for a, b in zip(starts, starts[1:], strict=False))


def test_auto_merges_at_the_steps_of_the_same_hand_set_tau_when_results_come_in_time():
    """Paced by the clock at equal speeds, with results back 1.5 reference steps after a
    round starts, "auto" (half of H/P = 5 here, rounded up: 3) merges each result exactly
    where step-paced tau = 3 does: the same weights, bit for bit."""
    auto = simulate(_cfg(sim={"workers": 3, "latency": 1.5},
                         diloco={"pacing": "time", "fragment_sync_delay": "auto",
                                 "step_seconds": 1.0}))
    hand = simulate(_cfg(sim={"workers": 3},
                         diloco={"pacing": "steps", "fragment_sync_delay": 3}))
    assert auto.fragment_sync_delay == 3
    assert auto.outer_digest == hand.outer_digest and auto.workers_agree
    # Merging as soon as the result is there (tau 1) is another run.
    eager = simulate(_cfg(sim={"workers": 3, "latency": 1.5},
                          diloco={"pacing": "time", "step_seconds": 1.0}))
    assert eager.outer_digest != auto.outer_digest
    # Holding results longer cost no waiting: in the run nobody waited for a result (the
    # rounds at the end, landed at once, wait out the latency in both runs alike).
    assert all(s["late"] == 0 for s in auto.worker_stats)
    assert [s["utilization"] for s in auto.worker_stats] == [
        s["utilization"] for s in eager.worker_stats]


def test_a_result_later_than_the_delay_merges_when_it_arrives_without_waiting():
    """Latency 4.5 reference steps, past auto's 3: the result is there at the boundary 5
    steps after the start, where it merges (as step-paced tau = 5), and nobody waits."""
    late = simulate(_cfg(sim={"workers": 3, "latency": 4.5},
                         diloco={"pacing": "time", "fragment_sync_delay": "auto",
                                 "step_seconds": 1.0}))
    hand = simulate(_cfg(sim={"workers": 3},
                         diloco={"pacing": "steps", "fragment_sync_delay": 5}))
    assert late.outer_digest == hand.outer_digest and late.workers_agree
    assert all(s["late"] == 0 for s in late.worker_stats)


def test_clock_paced_delay_counts_reference_steps_whatever_a_workers_speed(monkeypatch):
    """Workers of speeds 1 and 0.5 (two reference steps per own step), H = 16, P = 2 so
    that auto's tau is 4: the fast one merges each round 4 own steps after starting it, the
    slow one 2 (4 reference steps, the same moment of the clock), and neither waited for a
    result in the run."""
    import dilonode.sim.training as sim

    built = sim._build_workers

    def traced(*args, **kwargs):
        workers, group = built(*args, **kwargs)
        for w in workers:
            w.trace = []
        return workers, group

    monkeypatch.setattr(sim, "_build_workers", traced)
    cfg = _cfg(sim={"workers": 2, "speeds": [1.0, 0.5], "latency": 0.5},
               diloco={"pacing": "time", "fragment_sync_delay": "auto", "step_seconds": 1.0,
                       "sync_every": 16})
    got = {}
    report = simulate(cfg, on_step=lambda s, ws: got.update(w=ws))
    assert report.workers_agree
    delays = []
    for w in got["w"]:
        started = {(e["fragment"], e["round"]): e["step"] for e in w.trace
                   if e["event"] == "start"}
        # Rounds landed while training (the end-of-run ones land at once, after the end).
        delays.append({e["step"] - started[e["fragment"], e["round"]] for e in w.trace
                       if e["event"] == "land" and e["step"] < w.step})
        assert w.stats.late == 0
    assert delays == [{4}, {2}]


def test_step_locked_pacing_makes_fast_workers_wait_for_the_slowest():
    cfg = _cfg(sim={"workers": 2, "speeds": [1.0, 0.25]}, diloco={"pacing": "steps"})
    report = simulate(cfg)
    assert report.workers_agree
    fast, slow = report.worker_stats
    assert fast["steps"] == slow["steps"] == 40
    assert fast["utilization"] < 0.4  # it waited for a worker 4x slower every round
    assert report.virtual_s == pytest.approx(160.0, abs=8.0)


# ----------------------------------------------------------------- retuning the clock

H, LO, HI = 30, 5.0, 3600.0  # sync_every, min/max round seconds


def _retune(clock: SwarmClock, latencies=(), steps=()) -> float | None:
    return retune_step_seconds(clock, list(latencies), list(steps), H, LO, HI)


def test_retune_follows_the_fastest_nodes_measured_step_when_the_clock_ran_ahead():
    # Proposed from a node's first steps (0.2 s); the nodes turned out to step at 0.24-0.5 s.
    clock = SwarmClock(0.0, 0.2)
    assert _retune(clock, latencies=[0.6], steps=[0.5, 0.24, 0.3]) == pytest.approx(0.24)
    # ... and faster again when they speed up (the start rate is no floor with step times).
    slow = clock.with_epoch(40.0, 0.3)
    assert _retune(slow, latencies=[0.6], steps=[0.2, 0.4]) == pytest.approx(0.2)


def test_retune_keeps_a_clock_within_five_percent_of_the_nodes():
    clock = SwarmClock(0.0, 0.2)
    assert _retune(clock, latencies=[0.6], steps=[0.209, 0.3]) is None
    assert _retune(clock, latencies=[0.6], steps=[0.191]) is None
    assert _retune(clock, latencies=[0.6], steps=[0.212]) == pytest.approx(0.212)


def test_retune_gives_back_the_steps_the_clock_ran_ahead_of_the_node_furthest_along():
    clock = SwarmClock(0.0, 0.24)  # at the fastest node's pace: nothing to do on pace alone

    def retune(behind, steps=(0.24, 0.3)) -> float | None:
        return retune_step_seconds(clock, [0.6], list(steps), H, LO, HI, behind=behind)

    assert retune([]) is None
    # Every node is 12+ reference steps behind the clock: it slows by 12 steps over two
    # round periods (60 reference steps), so the node furthest along catches up.
    assert retune([30.0, 12.0]) == pytest.approx(0.24 * (1 + 12 / 60))
    # A lag inside the 5% band (3 steps over 60) is left alone.
    assert retune([2.0, 40.0]) is None
    # One node at or ahead of the clock: nothing given back, and no faster than its pace.
    assert retune([-20.0, 40.0]) is None
    assert retune([0.0, 40.0]) is None
    # At most 25% slower than the pace, however far behind.
    assert retune([500.0]) == pytest.approx(0.24 * 1.25)
    # A clock set by hand (no step times) is not paced by the nodes at all.
    assert retune([30.0], steps=()) is None


def test_time_pacer_pace_counts_evaluations_and_waits_over_its_window():
    t = [0.0]
    pacer = TimePacer(lambda: t[0], SwarmClock(0.0, 0.1), pace_window=4)
    # (seconds to the next boundary, evaluation announced at this one)
    for step, (dt, pause) in enumerate([(0.1, 0.0), (0.6, 0.5), (0.1, 0.0), (0.1, 0.0),
                                        (0.1, 0.0)]):
        assert pacer.pace_s is None  # the window is not full yet
        pacer.at_step(step, pause_s=pause)
        t[0] += dt
    pacer.at_step(5)
    # 4 steps from t = 0.1 to 1.0, a 0.5 s evaluation among them: 0.225 s per step,
    # while the step time proper (pauses left out) is 0.1 s.
    assert pacer.pace_s == pytest.approx(0.225) and pacer.step_s == pytest.approx(0.1)
    pacer.restart()  # a re-sync: the pause is not the worker's pace
    assert pacer.pace_s is None


def test_time_pacer_gives_a_first_pace_after_pace_first_steps_leaving_out_the_warm_up():
    t = [0.0]
    pacer = TimePacer(lambda: t[0], SwarmClock(0.0, 0.1), pace_window=64, pace_first=16)
    # Two slow first steps (warm-up), then 0.25 s a step.
    for step, dt in enumerate([2.0, 1.0] + [0.25] * 40):
        pacer.at_step(step)
        t[0] += dt
        if step < 18:  # 16 intervals after the first two boundaries: boundary 18
            assert pacer.pace_s is None, step
        else:
            assert pacer.pace_s == pytest.approx(0.25), step
    # Once the window is full, every step in it counts.
    for step in range(42, 80):
        pacer.at_step(step)
        t[0] += 0.5
    assert pacer.pace_s == pytest.approx((37 * 0.5 + 27 * 0.25) / 64)
    pacer.restart()
    assert pacer.pace_s is None


def test_retune_for_the_links_wins_over_throughput_when_rounds_take_longer():
    # p90 of 9 s: rounds must come every 18 s at least = 0.6 s per reference step.
    clock = SwarmClock(0.0, 0.2)
    assert _retune(clock, latencies=[1.0, 9.0], steps=[0.25]) == pytest.approx(0.6)
    # Within 25% slower of what the links need: kept (latencies jump with the traffic).
    assert _retune(clock.with_epoch(40.0, 0.55), latencies=[9.0], steps=[0.25]) is None


def test_retune_without_step_times_never_goes_faster_than_the_clock_started():
    clock = SwarmClock(0.0, 0.5)  # step_seconds set by hand: no step times are used
    assert _retune(clock, latencies=[0.1]) is None
    assert _retune(clock.with_epoch(40.0, 2.0), latencies=[0.1]) == pytest.approx(0.5)
    assert _retune(clock, latencies=[12.0]) == pytest.approx(0.8)


def test_retune_stays_within_the_round_period_bounds():
    clock = SwarmClock(0.0, 0.5)
    # The fastest node steps at 1 ms: rounds would come every 30 ms, below min_round_s.
    assert _retune(clock, latencies=[0.01], steps=[0.001]) == pytest.approx(LO / H)
    # Links so slow that rounds would come every 2 h: capped at max_round_s (reached an
    # epoch at a time, each at most RETUNE_MAX_FACTOR slower).
    rates = [clock.current_step_seconds]
    while (rate := _retune(clock, latencies=[3600.0])) is not None:
        clock = clock.with_epoch(40.0 * len(rates), rate)
        rates.append(rate)
    assert rates[-1] == pytest.approx(HI / H) and len(rates) == 5


def test_one_retune_changes_the_rate_at_most_four_times_either_way():
    clock = SwarmClock(0.0, 0.2).with_epoch(40.0, 1.083)
    # A latency of 234 s (a round that waited out a state fetch) would call for 15.6 s
    # a reference step, 14x slower: one retune goes 4x.
    assert _retune(clock, latencies=[233.8], steps=[1.0]) == \
        pytest.approx(1.083 * RETUNE_MAX_FACTOR)
    assert RETUNE_MAX_FACTOR == 4.0
    # The nodes turn out 5x faster than the clock: it speeds up 4x, then the rest at the
    # next retune.
    faster = _retune(clock, latencies=[0.6], steps=[0.2])
    assert faster == pytest.approx(1.083 / RETUNE_MAX_FACTOR)
    assert _retune(clock.with_epoch(80.0, faster), latencies=[0.6], steps=[0.2]) == \
        pytest.approx(0.2)


def test_time_pacer_lead_is_in_reference_steps_at_the_current_rate():
    t = [10.0]
    clock = SwarmClock(0.0, 0.1).with_epoch(50.0, 0.4)  # 4x slower from reference step 50
    pacer = TimePacer(lambda: t[0], clock)
    for step in range(3):
        ref, lead = pacer.at_step(step)
        t[0] += 0.2  # the worker's own step: 0.2 s
    assert ref == pytest.approx(50.0 + (10.4 - 5.0) / 0.4)
    assert lead == pytest.approx(0.2 / 0.4, abs=1e-5)  # half a reference step, not two
    assert clock.rate_at(49.0) == 0.1 and clock.rate_at(50.0) == 0.4


def test_link_busy_seconds_is_a_butterfly_round_of_every_fragment_on_the_link():
    # 5 nodes, 3 fragments of 1 MB results, 1 MB/s each way: a round moves 2 x 4/5 MB.
    assert link_busy_seconds([1e6] * 3, 5, 1e6) == pytest.approx(3 * 1.6)
    assert link_busy_seconds([1e6, 2e6], 2, 1e6) == pytest.approx(1.0 + 2.0)
    # Nothing to say: alone, no results known, no rate.
    assert link_busy_seconds([1e6], 1, 1e6) == 0.0
    assert link_busy_seconds([], 4, 1e6) == 0.0
    assert link_busy_seconds([1e6], 4, 0.0) == link_busy_seconds([1e6], 4, math.nan) == 0.0


def test_retune_slows_the_clock_for_a_joiners_link_before_its_rounds_measure_it():
    clock = SwarmClock(0.0, 0.3)  # 9 s periods; the swarm's own rounds take 0.6 s
    assert _retune(clock, latencies=[0.6], steps=[0.3]) is None

    def retune(busy: float, now: SwarmClock = clock) -> float | None:
        return retune_step_seconds(now, [0.6], [0.3], H, LO, HI, link_busy=[busy])

    # A joiner's link takes 4.6 s for a round of every fragment: all three through it at
    # once, a round takes 0.6 + 4.6 s, and must land within half a period of 10.4 s.
    assert retune(4.6) == pytest.approx(10.4 / H)
    # One estimate, not a jittery latency: past 5% it retunes (not only past 25%).
    assert retune(4.6, clock.with_epoch(40.0, 9.8 / H)) == pytest.approx(10.4 / H)
    assert retune(4.6, clock.with_epoch(40.0, 10.0 / H)) is None
    # A clock already slower is not sped up for it (the usual 2x rule still holds).
    assert retune(4.6, clock.with_epoch(40.0, 0.5)) is None
    # Measured latencies that need more win.
    assert retune_step_seconds(clock, [12.0], [0.3], H, LO, HI, link_busy=[1.0]) == \
        pytest.approx(26.0 / H)


def test_a_round_before_any_is_measured_is_expected_to_take_round_trips_and_its_transfer():
    # 4 nodes, 20 Mbit/s, int4 fragments of 0.2, 0.3 and 0.2 MB.
    rate, sizes = 20e6 / 8, [2e5, 3e5, 2e5]
    transfer = link_busy_seconds([3e5], 4, rate)  # the largest fragment's round
    assert expected_round_seconds(0.35, sizes, 4, rate) == pytest.approx(
        ROUND_TRIPS * 0.35 + transfer)
    # On loopback (30 ms DHT calls) such a round fits in half the 5 s floor of a round
    # period (`min_round_seconds`) at any H: nodes there propose the clock from their steps.
    assert 2 * expected_round_seconds(0.03, sizes, 4, rate) < 5.0
    # Alone, or before any DHT call: nothing to move, only what calls take.
    assert expected_round_seconds(0.35, sizes, 1, rate) == pytest.approx(ROUND_TRIPS * 0.35)
    assert expected_round_seconds(0.0, [], 4, rate) == 0.0
