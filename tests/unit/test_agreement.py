"""One model through faults, the pure parts: matchmaking groups only equal outer states (the
odd ones out are told whose state stands), the swarm clock every node picks, the
end-of-run verdict, and the swarm view's agreement line."""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from dilonode.algo.chain import chain_next, chain_start
from dilonode.algo.pacing import TimePacer
from dilonode.net.auth import Credentials, Identity
from dilonode.status.swarm import swarm_agreement
from dilonode.swarm.agreement import FinalBoard, standing_digest, verdict
from dilonode.swarm.clock import ClockKeeper, standing_clock
from dilonode.swarm.matchmaking import form_group, standing_chain
from dilonode.swarm.records import (
    MAX_CLOCK_EPOCHS,
    ClockRecord,
    FinalRecord,
    GroupEntry,
    LinkRecord,
)
from tests.boards import Board, View

RUN = "agree-unit"
IDS = sorted((Identity.generate() for _ in range(5)), key=lambda i: i.peer_id)
CHAIN_A = chain_next(chain_start("c" * 64, 1), 4, "d" * 64, True)
CHAIN_B = chain_next(chain_start("c" * 64, 1), 4, "e" * 64, True)


def _entry(i: int, chain: str, tokens: int = 100) -> GroupEntry:
    return GroupEntry(peer_id=IDS[i].peer_id, run_id=RUN, data_addr=f"127.0.0.1:{7100 + i}",
                      fragment=1, round=5, attempt=0, bandwidth_mbps=10.0, chain=chain,
                      tokens=tokens)


def test_chains_differ_when_results_differ_and_match_when_equal():
    start = chain_start("c" * 64, 1)
    assert start != chain_start("c" * 64, 2) != chain_start("f" * 64, 1)
    assert CHAIN_A == chain_next(start, 4, "d" * 64, True) != CHAIN_B
    assert chain_next(start, 4, "d" * 64, False) != CHAIN_A  # a refused result marks it


def test_the_chain_held_by_most_stands_then_most_tokens_then_smallest_id():
    three = {IDS[i].peer_id: _entry(i, CHAIN_A if i < 3 else CHAIN_B) for i in range(5)}
    assert standing_chain(three) == CHAIN_A
    tied = {IDS[i].peer_id: _entry(i, CHAIN_A if i < 2 else CHAIN_B, 100 if i < 2 else 150)
            for i in range(4)}
    assert standing_chain(tied) == CHAIN_B  # 2 against 2: the one with more tokens
    even = {IDS[i].peer_id: _entry(i, CHAIN_A if i in (1, 3) else CHAIN_B) for i in range(4)}
    assert standing_chain(even) == CHAIN_B  # all equal: the smallest id holds B


def test_matchmaking_leaves_out_the_odd_ones_and_tells_them_whose_state_stands():
    board = Board()
    chains = [CHAIN_A, CHAIN_A, CHAIN_A, CHAIN_B, CHAIN_B]

    def form(i: int):
        view = View(board, Credentials(IDS[i], RUN))
        expected = {p.peer_id for p in IDS} - {IDS[i].peer_id}
        return form_group(view, RUN, 1, 5, 0, _entry(i, chains[i]), 1.0, 8.0,
                          poll_interval=0.02, expected=expected)

    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        groups = list(pool.map(form, range(5)))
    winners = tuple(IDS[i].peer_id for i in range(3))
    for i in range(3):
        assert groups[i].members == winners and not groups[i].diverged
    assert groups[0].outvoted == (IDS[3].peer_id, IDS[4].peer_id)  # the leader says whom
    for i in (3, 4):
        assert groups[i].members == (IDS[i].peer_id,) and groups[i].diverged == winners


def _clock(i: int, t0: float, step: float = 0.5) -> ClockRecord:
    return ClockRecord(peer_id=IDS[i].peer_id, run_id=RUN, t0=t0, step_seconds=step,
                       origin=IDS[i].peer_id)


def test_the_earliest_plausible_clock_stands():
    now = 1_795_000_000.0  # Unix time, 2026
    records = {IDS[0].peer_id: _clock(0, now - 50), IDS[1].peer_id: _clock(1, now - 80),
               IDS[2].peer_id: _clock(2, now + 100),  # starts in the future: ignored
               IDS[3].peer_id: _clock(3, 5.0)}  # 1970: ignored
    assert standing_clock(records, now).origin == IDS[1].peer_id
    assert standing_clock({}, now) is None


class _FakeDHT(View):
    def get_raw(self, key, timeout=None):
        return super().get_raw(key, timeout)


def test_clock_keepers_started_together_end_on_one_clock():
    board, wall = Board(), [1_000_000.0]
    keepers = []
    for i in range(3):
        dht = _FakeDHT(board, Credentials(IDS[i], RUN))
        pacer = TimePacer(lambda: wall[0])
        keepers.append(ClockKeeper(dht, RUN, pacer, propose=lambda i=i: 0.1 * (i + 1),
                                   frozen=lambda: False, wall=lambda: wall[0]))
    for k in keepers:  # each proposes (nobody's clock visible yet), a moment apart
        k.tick()
        wall[0] += 0.2
    for k in keepers:  # then each follows the one that stands: the earliest
        k.tick()
    assert {k.following.origin for k in keepers} == {IDS[0].peer_id}
    assert all(k.pacer.clock.step_seconds == 0.1 for k in keepers)
    assert keepers[0].switches == 0


def _final(i: int, digest: str, tokens: int = 10, end: int = 48) -> FinalRecord:
    return FinalRecord(peer_id=IDS[i].peer_id, run_id=RUN, digest=digest, rounds=[5, 4],
                       chains=[CHAIN_A, CHAIN_A], tokens=tokens, end_step=end)


def test_end_of_run_verdict_names_who_differs_and_which_weights_stand():
    mine = _final(0, "a" * 64)
    others = {IDS[1].peer_id: _final(1, "a" * 64), IDS[2].peer_id: _final(2, "b" * 64),
              IDS[3].peer_id: _final(3, "c" * 64, end=96)}  # another end step: not compared
    v = verdict(mine, others, expected={IDS[1].peer_id, IDS[2].peer_id, IDS[4].peer_id})
    assert v.agrees is False and v.same == [IDS[1].peer_id]
    assert v.differ == {IDS[2].peer_id: "b" * 64} and v.missing == [IDS[4].peer_id]
    assert IDS[2].peer_id in v.line() and "differ" in v.line()
    assert verdict(mine, {}, ()).agrees is None
    records = {IDS[0].peer_id: mine, **others}
    del records[IDS[3].peer_id]
    assert standing_digest(records) == "a" * 64
    assert standing_digest({IDS[0].peer_id: _final(0, "a" * 64, 5),
                            IDS[1].peer_id: _final(1, "b" * 64, 9)}) == "b" * 64


def _final_board(board: Board, i: int) -> FinalBoard:
    return FinalBoard(View(board, Credentials(IDS[i], RUN)), RUN)


def test_holders_of_the_standing_weights_wait_for_peers_adopting_them_and_no_longer():
    board = Board()
    holder, peer = _final_board(board, 0), _final_board(board, 1)
    mine, theirs = _final(0, "a" * 64), _final(1, "b" * 64)
    holder.publish(mine)

    def settle(patience: float) -> tuple:
        t0 = time.monotonic()
        got = holder.collect(mine, {IDS[1].peer_id}, 0.2, poll=0.02, settle=True,
                             patience=patience)
        return got, time.monotonic() - t0

    # A peer that differs and is not adopting ours (or adopts other weights): one timeout.
    for adopting in ("", "c" * 64):
        peer.publish(theirs.model_copy(update={"adopting": adopting}))
        got, took = settle(patience=30.0)
        assert got.agrees is False and took < 5.0
    # A peer adopting ours: waited for past the timeout, until it holds them.
    peer.publish(theirs.model_copy(update={"adopting": "a" * 64}))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(settle, 30.0)
        with pytest.raises(concurrent.futures.TimeoutError):
            waiting.result(timeout=1.0)  # five times the timeout and still waiting
        peer.publish(_final(1, "a" * 64))
        got, took = waiting.result(timeout=10.0)
    assert got.agrees is True and got.same == [IDS[1].peer_id] and took < 10.0
    # The wait is bounded by `patience` even if the adopter never finishes.
    peer.publish(theirs.model_copy(update={"adopting": "a" * 64}))
    got, took = settle(patience=0.5)
    assert got.agrees is False and 0.5 <= took < 5.0


def test_the_end_check_stops_waiting_for_a_missing_peer_once_its_record_is_gone():
    # A peer killed shortly before the end is still expected (its membership record was
    # live when the check began); once the record is gone it is not waited for, and it
    # stays missing in the verdict. While its record lives, or nobody can say, the check
    # waits its timeout.
    board = Board()
    holder, peer = _final_board(board, 0), _final_board(board, 1)
    mine = _final(0, "a" * 64)
    holder.publish(mine)
    peer.publish(_final(1, "a" * 64))
    expected = {IDS[1].peer_id, IDS[2].peer_id}

    def collect(live) -> tuple:
        t0 = time.monotonic()
        got = holder.collect(mine, expected, 1.0, poll=0.02, live=live)
        return got, time.monotonic() - t0

    for live in (None, lambda: None, lambda: {IDS[0].peer_id, IDS[1].peer_id, IDS[2].peer_id}):
        got, took = collect(live)
        assert got.missing == [IDS[2].peer_id] and took >= 1.0
    reads = []

    def expired() -> set[str]:
        reads.append(1)
        return {IDS[0].peer_id, IDS[1].peer_id} if len(reads) >= 3 else \
            {IDS[0].peer_id, IDS[1].peer_id, IDS[2].peer_id}

    got, took = collect(expired)
    assert got.agrees is True and got.same == [IDS[1].peer_id]
    assert got.missing == [IDS[2].peer_id] and len(reads) == 3 and took < 0.5
    assert "1 expected peer(s) did not report" in got.line()


def test_a_node_that_agrees_stays_until_the_peers_holding_its_weights_ended_their_check():
    # The peers that adopted a holder's weights agree first, while the holder (serving them
    # the weights) still checks; their records live on their DHTs, so they must not leave
    # before the holder read them.
    board = Board()
    adopter, holder = _final_board(board, 1), _final_board(board, 0)
    mine, held = _final(1, "a" * 64), _final(0, "a" * 64)
    holder.publish(held)

    def linger(timeout: float) -> tuple[list[str], float]:
        t0 = time.monotonic()
        return adopter.linger(mine, [IDS[0].peer_id], timeout, poll=0.02), time.monotonic() - t0

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(linger, 30.0)
        with pytest.raises(concurrent.futures.TimeoutError):
            waiting.result(timeout=1.0)  # the holder has not ended its check
        # What the holder reads meanwhile: the adopter's record, marked checked.
        got = holder.collect(held, {IDS[1].peer_id}, 1.0, poll=0.02)
        assert got.agrees is True and holder.read()[IDS[1].peer_id].checked
        # A checked record of other weights or another end step does not release it...
        for other in (_final(0, "b" * 64), _final(0, "a" * 64, end=96)):
            holder.publish(other.model_copy(update={"checked": True}))
            with pytest.raises(concurrent.futures.TimeoutError):
                waiting.result(timeout=0.3)
        # ...the holder's own check ending on our weights does.
        holder.publish(held.model_copy(update={"checked": True}))
        left, took = waiting.result(timeout=10.0)
    assert left == [] and took < 10.0
    # Released, it still stays two polls: a peer that ended its check at the same moment
    # reads our record within one poll, perhaps from our own DHT node.
    t0 = time.monotonic()
    assert adopter.linger(mine, [IDS[0].peer_id], 30.0, poll=0.2) == []
    assert time.monotonic() - t0 >= 0.4
    # Bounded: a peer that never ends its check is named once the timeout passes.
    silent = _final_board(board, 2)
    silent.publish(_final(2, "a" * 64))
    t0 = time.monotonic()
    left = adopter.linger(mine, [IDS[0].peer_id, IDS[2].peer_id], 0.3, poll=0.02)
    assert left == [IDS[2].peer_id] and 0.3 <= time.monotonic() - t0 < 5.0
    # A peer that left cleanly (its membership record says so) is not waited for: its
    # checked record may have left with the DHT nodes that stored it. Read only while
    # someone is missing.
    asked = []

    def gone() -> list[str]:
        asked.append(1)
        return [IDS[2].peer_id]

    t0 = time.monotonic()
    assert adopter.linger(mine, [IDS[0].peer_id, IDS[2].peer_id], 30.0, poll=0.02,
                          gone=gone) == []
    assert time.monotonic() - t0 < 5.0 and asked
    asked.clear()
    assert adopter.linger(mine, [IDS[0].peer_id], 30.0, poll=0.02, gone=gone) == []
    assert not asked
    # With nobody to wait for it only says its check ended.
    assert adopter.linger(mine, [], 30.0) == []


def test_swarm_view_says_whether_nodes_hold_one_model():
    rows = [{"state_chain": f"4:{CHAIN_A[:12]};3:{CHAIN_A[:12]}"},
            {"state_chain": f"5:{CHAIN_B[:12]};3:{CHAIN_A[:12]}"},  # a round ahead: fine
            {"state_chain": f"4:{CHAIN_A[:12]};3:{CHAIN_A[:12]}"}]
    assert swarm_agreement(rows)["agrees"] is True
    rows[2]["state_chain"] = f"4:{CHAIN_B[:12]};3:{CHAIN_A[:12]}"
    got = swarm_agreement(rows)
    assert got["agrees"] is False and "fragment 0 after 4 rounds" in got["line"]
    assert swarm_agreement([{"final_digest": "a"}, {"final_digest": "b"}])["agrees"] is False
    assert swarm_agreement([{}])["agrees"] is None


def test_the_pacemaker_slows_the_clock_for_everyone_without_renumbering_rounds():
    board, wall = Board(), [1_795_000_000.0]
    keepers = []
    for i in range(2):
        dht = _FakeDHT(board, Credentials(IDS[i], RUN))
        keepers.append(ClockKeeper(
            dht, RUN, TimePacer(lambda: wall[0]), propose=lambda: 0.1, frozen=lambda: True,
            wall=lambda: wall[0],
            retune=lambda clock, ref, links: 0.4 if not clock.epochs else None,
            pacemaker=lambda i=i: i == 0, lead_steps=30))
    keepers[0].tick()  # proposes the clock, then retunes it (as the pacemaker)
    wall[0] += 1.0
    keepers[1].tick()
    for k in keepers:
        k.tick()
    clocks = [k.pacer.clock for k in keepers]
    assert clocks[0] == clocks[1] and len(clocks[0].epochs) == 1
    since, rate = clocks[0].epochs[0]
    # Ahead of the reading it was made at by 1.5 read intervals (5 s each) + 2 s at 0.1 s
    # a step: every node reads it before it applies (more than a round period here).
    assert keepers[0].read_every == 5.0
    assert rate == 0.4 and since == 95.0
    t_switch = clocks[0].time_of(since)
    assert clocks[0].ref_step(t_switch - 0.1) == pytest.approx(since - 1.0)  # 0.1 s steps
    assert clocks[0].ref_step(t_switch + 0.4) == pytest.approx(since + 1.0)  # then 0.4 s
    assert keepers[0].retunes == 1 and keepers[1].retunes == 0


def test_a_clock_with_the_most_epochs_a_record_holds_is_kept_not_made_unreadable(caplog):
    # One epoch more would be rejected by every reader: the peers would stay on the clock
    # the pacemaker left, and the pacemaker would flip back and forth between the two.
    board, wall = Board(), [1_795_000_000.0]
    full = ClockRecord(peer_id=IDS[0].peer_id, run_id=RUN, t0=wall[0] - 1000.0,
                       step_seconds=0.1, origin=IDS[0].peer_id,
                       epochs=[[float(i), 0.1] for i in range(MAX_CLOCK_EPOCHS)])
    asked = []

    def retune(clock, ref, links):
        asked.append(ref)
        return 0.4

    pacemaker = ClockKeeper(_FakeDHT(board, Credentials(IDS[0], RUN)), RUN,
                            TimePacer(lambda: wall[0]), propose=lambda: 0.1,
                            frozen=lambda: True, wall=lambda: wall[0], retune=retune,
                            pacemaker=lambda: True)
    reader = ClockKeeper(_FakeDHT(board, Credentials(IDS[1], RUN)), RUN,
                         TimePacer(lambda: wall[0]), propose=lambda: None,
                         frozen=lambda: True, wall=lambda: wall[0])
    pacemaker._follow(full)
    with caplog.at_level("WARNING", logger="dilonode.swarm.clock"):
        for _ in range(3):
            pacemaker.tick()
            wall[0] += 5.0
    assert len(asked) == 3 and pacemaker.retunes == 0
    assert len(pacemaker.following.epochs) == MAX_CLOCK_EPOCHS
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "the most a clock record holds" in caplog.records[0].message
    reader.tick()  # the published record is still one every node reads
    assert reader.pacer.clock == pacemaker.pacer.clock
    # One below the limit, a pacemaker adds its epoch.
    fresh = ClockKeeper(_FakeDHT(Board(), Credentials(IDS[0], RUN)), RUN,
                        TimePacer(lambda: wall[0]), propose=lambda: 0.1, frozen=lambda: True,
                        wall=lambda: wall[0], retune=retune, pacemaker=lambda: True)
    fresh._follow(full.model_copy(update={"epochs": full.epochs[:-1]}))
    fresh.tick()
    assert fresh.retunes == 1 and len(fresh.following.epochs) == MAX_CLOCK_EPOCHS


def test_a_joiners_link_record_reaches_the_pacemakers_retune_until_its_rounds_measure_it():
    board, wall = Board(), [1_795_000_000.0]
    asked: list[list[float]] = []
    measured = [False]

    def retune(clock, ref, links):
        asked.append(sorted(links))
        return None

    pacemaker = ClockKeeper(_FakeDHT(board, Credentials(IDS[0], RUN)), RUN,
                            TimePacer(lambda: wall[0]), propose=lambda: 0.3,
                            frozen=lambda: True, wall=lambda: wall[0], retune=retune,
                            pacemaker=lambda: True)
    joiner = ClockKeeper(_FakeDHT(board, Credentials(IDS[1], RUN)), RUN,
                         TimePacer(lambda: wall[0]), propose=lambda: None, frozen=lambda: False,
                         wall=lambda: wall[0], link_unmeasured=lambda: not measured[0])
    pacemaker.tick()
    assert asked == [[]]  # no link records yet
    joiner.announce_link(4.6, 1.35e6)
    joiner.tick()  # follows the clock, publishes its link's need
    pacemaker.tick()
    assert asked[-1] == [4.6]
    # Once the joiner's own rounds measure its link it withdraws the need (its latencies,
    # which the pacemaker reads too, carry it now).
    measured[0] = True
    joiner.tick()
    pacemaker.tick()
    assert joiner.link is None and asked[-1] == []
    # A negative time is no record.
    with pytest.raises(ValueError):
        LinkRecord(peer_id=IDS[2].peer_id, run_id=RUN, busy_s=-1.0, rate_Bps=1.0)


def test_only_a_live_node_paces_the_clock_not_a_joiner_still_fetching():
    from dilonode.node.pacemaker import is_pacemaker

    peers = [i.peer_id for i in IDS[1:4]]

    def paces(me: str, live: list[str]) -> bool:
        return is_pacemaker(me, set(live))

    # The smallest id has not published its record yet (it is fetching the state): the
    # smallest live one paces, and it does not.
    assert not paces(IDS[0].peer_id, peers) and paces(peers[0], peers)
    # Once its record is live, it takes over.
    assert paces(IDS[0].peer_id, [IDS[0].peer_id, *peers]) and \
        not paces(peers[0], [IDS[0].peer_id, *peers])


def test_the_pacemaker_reads_how_far_behind_the_clock_each_live_node_is():
    from collections import deque
    from types import SimpleNamespace

    from dilonode.algo.pacing import SwarmClock
    from dilonode.node.pacemaker import retune_seconds

    algo = SimpleNamespace(step_seconds=None, sync_every=30, min_round_seconds=5.0,
                           max_round_seconds=3600.0)
    worker = SimpleNamespace(stats=SimpleNamespace(recent_latency=deque([0.6])),
                             pacer=SimpleNamespace(pace_s=0.24), swarm_step=200, step=190)

    def retune(*statuses: dict) -> float | None:
        peers = [SimpleNamespace(peer_id=f"peer{i}", status=s) for i, s in enumerate(statuses)]
        return retune_seconds(algo, worker, peers, SwarmClock(0.0, 0.24), me="us")

    # We are 10 steps behind, a peer 15: the node furthest along sets the catch-up.
    assert retune({"pace_s": 0.3, "swarm_step": 200, "step": 185}) == \
        pytest.approx(0.24 * (1 + 10 / 60))
    # A peer at the clock: nothing to give back. Malformed or missing fields count as no
    # reading (peers' data).
    assert retune({"pace_s": 0.3, "swarm_step": 200, "step": 200}) is None
    for bad in ({"pace_s": 0.3, "swarm_step": "200", "step": 0},
                {"pace_s": 0.3, "swarm_step": True, "step": 0},
                {"pace_s": 0.3, "step": 0}):
        assert retune(bad) == pytest.approx(0.24 * (1 + 10 / 60))
    # A peer without a pace or a latency yet gives no figure: ours alone retune nothing.
    assert retune({"swarm_step": 200, "step": 0}) is None
