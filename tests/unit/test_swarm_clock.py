"""The swarm clock under differing views: which node retunes it (`is_pacemaker`), which of
competing retuned records stands (`standing_clock`), what a retune may be computed from
(`retune_seconds`), and keepers on one in-memory board ending on one clock."""

from __future__ import annotations

import time
from collections import deque
from types import SimpleNamespace
from typing import Any

import pytest

from dilonode.algo.pacing import TimePacer
from dilonode.net.auth import Credentials, Identity
from dilonode.node.pacemaker import is_pacemaker, retune_seconds
from dilonode.swarm.clock import ClockKeeper, clock_of, standing_clock
from dilonode.swarm.records import ClockRecord
from tests.boards import Board, View

RUN = "clock-unit"
IDS = sorted((Identity.generate() for _ in range(3)), key=lambda i: i.peer_id)
A, B, C = (i.peer_id for i in IDS)
ALGO = SimpleNamespace(step_seconds=None, sync_every=30, min_round_seconds=5.0,
                       max_round_seconds=3600.0)


def _record(writer: str, epochs: list[list[float]], paced_by: str) -> ClockRecord:
    return ClockRecord(peer_id=writer, run_id=RUN, t0=1_795_000_000.0, step_seconds=1.0,
                       origin=A, epochs=epochs, paced_by=paced_by)


def test_of_two_pacemakers_epochs_at_once_the_smaller_ids_stands_on_every_node():
    # Both added one epoch to the same history; B's is the lexicographically smaller one.
    ours = _record(A, [[100.0, 2.0]], paced_by=A)
    theirs = _record(B, [[100.0, 1.5]], paced_by=B)
    now = 1_795_000_050.0
    assert standing_clock({A: ours, B: theirs}, now) == ours
    assert standing_clock({B: theirs, C: ours.model_copy(update={"peer_id": C})}, now) \
        .paced_by == A
    # A longer history still stands whoever paced it: it extends the one that stood.
    longer = _record(B, [[100.0, 2.0], [200.0, 1.5]], paced_by=B)
    assert standing_clock({A: ours, B: longer}, now) == longer


def test_a_node_whose_view_lacks_the_pacemaker_defers_to_it_while_it_publishes_the_clock():
    # B's view of the live peers lacks A (A's record reached it late), but A added the
    # clock's last epoch and still publishes the clock: B does not retune.
    assert is_pacemaker(B, {B, C}) and not is_pacemaker(B, {B, C}, pacers={A})
    assert is_pacemaker(A, {A, B, C}, pacers={B})
    # A node not live itself never paces, whatever the clock says.
    assert not is_pacemaker(A, {B, C}, pacers={A})


def _worker(pace: float | None, latencies: tuple[float, ...] = (), lag: int = 0) -> Any:
    return SimpleNamespace(stats=SimpleNamespace(recent_latency=deque(latencies)),
                           pacer=SimpleNamespace(pace_s=pace), swarm_step=500 + lag, step=500)


def _peer(peer_id: str, **status: Any) -> Any:
    return SimpleNamespace(peer_id=peer_id, status=status)


def test_a_pacemaker_that_went_alone_does_not_retune_from_its_own_figures():
    clock = clock_of(_record(A, [[300.0, 1.083]], paced_by=A))
    # Alone, its pace counts the waits for peers that were not there (12.47 s a step)
    # and it trails the clock: its own figures alone would slow the clock 14x, to 15.59 s.
    lone = _worker(12.47, latencies=(2.0,), lag=400)
    own_record = _peer(A, pace_s=12.47, round_p90_s=2.0, swarm_step=900, step=500)
    silent = _peer(B)  # a peer that published no figures (it is fetching the state)
    assert retune_seconds(ALGO, lone, [own_record, silent], clock, me=A) is None
    # With a second node's figures it retunes, on the fastest pace of the two.
    paced = _peer(B, pace_s=1.2, round_p90_s=3.0, swarm_step=900, step=890)
    assert retune_seconds(ALGO, lone, [own_record, paced], clock, me=A) == \
        pytest.approx(1.2 * (1 + 10 / 60))
    # A second node's latency alone gives no pace: the rate keeps it, and latencies that
    # call for no slower clock change nothing.
    latency_only = _peer(B, round_p90_s=3.0)
    assert retune_seconds(ALGO, lone, [own_record, latency_only], clock, me=A) is None
    # A joiner's link record counts as a second node.
    assert retune_seconds(ALGO, lone, [own_record], clock, link_busy=[40.0], me=A) == \
        pytest.approx(2 * 42.0 / 30)


class _Partial(View):
    """A node's DHT whose reads miss the records of the peers in `unseen` (a partition)."""

    unseen: frozenset[str] = frozenset()

    def get_raw(self, key: str, timeout: float | None = None) -> Any:
        got = super().get_raw(key, timeout)
        return {s: e for s, e in got.items() if s not in self.unseen}



def test_before_any_round_is_measured_paces_do_not_outrun_the_expected_round():
    # The first clock left room for 10 s rounds (0.667 s a reference step at H = 30);
    # two nodes then publish paces of 0.25 s a step and no round latency yet.
    clock = clock_of(_record(A, [], paced_by=A).model_copy(update={"step_seconds": 0.667}))
    fresh = _worker(0.25)
    peer = _peer(B, pace_s=0.25, swarm_step=500, step=500)
    # Paces alone would speed the clock 2.7x, opening rounds every 7.5 s.
    assert retune_seconds(ALGO, fresh, [peer], clock, me=A) == pytest.approx(0.25)
    # With the expected round standing in for the latencies the clock keeps its rate.
    assert retune_seconds(ALGO, fresh, [peer], clock, me=A, expected_round_s=10.0) is None
    # Once a round is measured, the measurement decides (3 s rounds: the pace wins).
    measured = _peer(B, pace_s=0.25, round_p90_s=3.0, swarm_step=500, step=500)
    assert retune_seconds(ALGO, fresh, [measured], clock, me=A, expected_round_s=10.0) == \
        pytest.approx(0.25)

def _keeper(board: Board, i: int, wall: list[float], live: set[str],
            want: float) -> ClockKeeper:
    """Keeper of node i whose view of the live peers is `live` and whose retune asks for
    `want` s a reference step (past a 5% band, as `retune_step_seconds` does)."""

    def retune(clock: Any, ref: float, links: Any) -> float | None:
        return want if abs(want / clock.current_step_seconds - 1.0) > 0.05 else None

    keeper = ClockKeeper(_Partial(board, Credentials(IDS[i], RUN)), RUN,
                         TimePacer(lambda: wall[0]), propose=lambda: 0.1,
                         frozen=lambda: True, wall=lambda: wall[0], retune=retune,
                         pacemaker=lambda: is_pacemaker(IDS[i].peer_id, live, keeper.pacers),
                         lead_steps=30)
    return keeper


def test_two_pacemakers_with_different_views_end_on_one_clock_and_stop_retuning():
    board, wall = Board(), [1_795_000_000.0]
    # A sees every node; B's view lacks A, so B takes itself for the pacemaker too. Their
    # figures differ: A's call for 0.1 s a step, B's for 0.2 s.
    keepers = [_keeper(board, 0, wall, {A, B, C}, want=0.1),
               _keeper(board, 1, wall, {B, C}, want=0.2),
               _keeper(board, 2, wall, {A, B, C}, want=0.5)]
    history = []
    for _ in range(60):  # 5 minutes of swarm time, each node reading every 5 s
        for k in keepers:
            k.tick()
        wall[0] += 5.0
        history.append(keepers[2].pacer.clock)
    records = [k.following for k in keepers]
    assert all((r.t0, r.epochs, r.paced_by) == (records[0].t0, records[0].epochs,
                                                records[0].paced_by) for r in records)
    assert records[0].paced_by == A
    assert keepers[0].pacer.clock.current_step_seconds == 0.1
    # B added one epoch before A's showed it who paces; then it deferred. The clock has
    # not changed for the last half of the run.
    assert keepers[1].retunes == 1 and keepers[0].retunes == 1 and keepers[2].retunes == 0
    assert len(set(history[30:])) == 1


def test_two_halves_that_retuned_apart_end_on_one_clock_once_they_read_each_other():
    board, wall = Board(), [1_795_000_000.0]
    keepers = [_keeper(board, 0, wall, {A, B, C}, want=0.1),
               _keeper(board, 1, wall, {B, C}, want=0.2),
               _keeper(board, 2, wall, {A, B, C}, want=0.5)]
    for k in keepers:  # A proposes the clock, the others follow it; then the DHT parts
        k.tick()       # A from B and C
    keepers[0].dht.unseen = frozenset({B, C})
    for k in keepers[1:]:
        k.dht.unseen = frozenset({A})
    for _ in range(20):
        for k in keepers:
            k.tick()
        wall[0] += 5.0
    # B retuned the clock for its half; A, which reads no epoch, keeps it.
    assert keepers[1].pacer.clock != keepers[0].pacer.clock
    assert keepers[1].pacer.clock.t0 == keepers[0].pacer.clock.t0
    for k in keepers:
        k.dht.unseen = frozenset()
    for _ in range(40):
        for k in keepers:
            k.tick()
        wall[0] += 5.0
    records = [k.following for k in keepers]
    assert all((r.epochs, r.paced_by) == (records[0].epochs, records[0].paced_by)
               for r in records)
    assert records[0].paced_by == A and keepers[0].pacer.clock.current_step_seconds == 0.1
    assert keepers[1].retunes == 1


class _Flaky(View):
    """A node's DHT whose reads time out while `down` is set."""

    down = False

    def get_raw(self, key: str, timeout: float | None = None) -> Any:
        if self.down:
            raise TimeoutError(f"DHT get got no answer within {timeout:.1f}s")
        return super().get_raw(key, timeout)


def test_a_node_that_cannot_read_the_clock_past_an_epochs_notice_says_so_once(caplog):
    board, wall = Board(), [1_795_000_000.0]
    dht = _Flaky(board, Credentials(IDS[0], RUN))
    keeper = ClockKeeper(dht, RUN, TimePacer(lambda: wall[0]), propose=lambda: 0.1,
                         frozen=lambda: True, wall=lambda: wall[0])
    keeper.run_pass()  # proposes the clock
    dht.down = True
    with caplog.at_level("INFO", logger="dilonode.swarm.clock"):
        for _ in range(6):  # 5 s apart: past 1.5 read intervals + 2 s from the second on
            wall[0] += 5.0
            keeper.run_pass()
        dht.down = False
        keeper.run_pass()
    lines = [r.getMessage() for r in caplog.records]
    assert keeper.epoch_notice_s == 9.5
    warned = [m for m in lines if "not read for" in m]
    assert warned == ["swarm clock: not read for 10 s (DHT get got no answer within 5.0s); "
                      "following the clock read before, which the swarm may have retuned"]
    assert lines[-1] == "swarm clock: read again after 30 s"


class _Slow(View):
    """A DHT whose reads take `delay` s."""

    delay = 0.02

    def get_raw(self, key: str, timeout: float | None = None) -> Any:
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.delay:
            pass
        return super().get_raw(key, timeout)


def test_the_keeper_knows_what_its_dht_reads_take():
    # The first clock leaves room for rounds that take a multiple of a DHT call
    # (`pacing.first_step_seconds`): the keeper times its reads of the clock.
    board, wall = Board(), [1_795_000_000.0]
    keeper = ClockKeeper(_Slow(board, Credentials(IDS[0], RUN)), RUN,
                         TimePacer(lambda: wall[0]), propose=lambda: None,
                         frozen=lambda: False, wall=lambda: wall[0])
    assert keeper.dht_call_s == 0.0
    for _ in range(3):
        keeper.read()
    assert keeper.dht_call_s >= _Slow.delay
