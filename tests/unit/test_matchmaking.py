"""Matchmaking over an in-memory board: one leader closes each group, so every member runs the
same group even when peers register at different times, and a joiner appearing mid-window
no longer splits the round into mismatching views.

Peers run `form_group` in threads with staggered starts; what is asserted holds for any
interleaving (the property the protocol guarantees), so the staggering only makes the old
failure likely, never the assertions timing-dependent.
"""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from dilonode.auth import Credentials, Identity
from dilonode.swarm.matchmaking import Group, MatchmakingError, form_group, settings_difference
from dilonode.swarm.records import GroupEntry, group_key
from tests.boards import Board, View

RUN = "mm-unit"
SETTINGS = {"codec": "int4", "block_size": 64, "aggregator": "mean", "norm_bound": 0.0}
# Sorted by peer id, so tests can pick the leader (the smallest) on purpose.
IDS = sorted((Identity.generate() for _ in range(6)), key=lambda i: i.peer_id)


def _view(board: Board, identity: Identity) -> View:
    return View(board, Credentials(identity, RUN))


def _entry(identity: Identity, attempt: int = 0, **over: object) -> GroupEntry:
    fields: dict[str, object] = dict(
        peer_id=identity.peer_id, run_id=RUN, data_addr=f"127.0.0.1:{7000 + IDS.index(identity)}",
        fragment=1, round=5, attempt=attempt, bandwidth_mbps=10.0, settings=SETTINGS)
    return GroupEntry(**{**fields, **over})  # type: ignore[arg-type]


def _form(board: Board, identity: Identity, delay: float, *, window: float = 1.0,
          timeout: float = 5.0, expected: frozenset[str] = frozenset(),
          exclude: frozenset[str] = frozenset(), **over: object) -> Group:
    time.sleep(delay)  # staggered arrival, not synchronization: any order must work
    return form_group(_view(board, identity), RUN, 1, 5, 0, _entry(identity, **over), window,
                      timeout, poll_interval=0.02, expected=expected, exclude=exclude)


def _run_all(calls: dict[Identity, dict[str, object]]) -> dict[str, Group | BaseException]:
    board = Board()
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        futs = {i.peer_id: pool.submit(_form, board, i, **kw)  # type: ignore[arg-type]
                for i, kw in calls.items()}
        out: dict[str, Group | BaseException] = {}
        for pid, fut in futs.items():
            try:
                out[pid] = fut.result(timeout=30)
            except Exception as exc:
                out[pid] = exc
    return out


def test_staggered_peers_and_a_joiner_all_get_one_group() -> None:
    """4 known peers arrive over 0.3 s; an unexpected joiner arrives just after the known
    peers are all in (when each of them would stop waiting). Every peer that is in a group
    is in the same one (same members, addresses, weights, digest); the known peers are all in
    it; the joiner is either in it or alone, never in a different group."""
    known, joiner = IDS[1:5], IDS[0]  # the joiner has the smallest id: the hardest case
    expected = frozenset(i.peer_id for i in known)
    calls: dict[Identity, dict[str, object]] = {
        ident: {"delay": 0.1 * k, "expected": expected} for k, ident in enumerate(known)}
    calls[joiner] = {"delay": 0.32, "expected": expected}
    for _ in range(3):
        got = _run_all(calls)
        groups = [g for g in got.values() if isinstance(g, Group)]
        assert len(groups) == len(calls), got
        shared = {(g.members, g.data_addrs, g.weights, g.digest()) for g in groups
                  if g.size > 1}
        assert len(shared) == 1, shared
        members = next(iter(shared))[0]
        assert expected <= set(members)
        for pid, g in got.items():
            assert isinstance(g, Group)
            assert g.members == members or g.members == (pid,), (pid, g.members)
            assert g.members[g.my_index] == pid


def test_a_lone_peer_waits_past_its_window_for_expected_peers() -> None:
    """The first peer's window ends before the others arrive (they lag by more than a
    window): it does not close a group of one, it waits for them and they all average."""
    expected = frozenset(i.peer_id for i in IDS[:3])
    calls: dict[Identity, dict[str, object]] = {
        IDS[0]: {"delay": 0.0, "window": 0.3, "expected": expected},
        IDS[1]: {"delay": 0.8, "window": 0.3, "expected": expected},
        IDS[2]: {"delay": 1.0, "window": 0.3, "expected": expected}}
    got = _run_all(calls)
    assert {g.members for g in got.values() if isinstance(g, Group)} == {
        tuple(sorted(expected))}, got


def test_a_leader_that_never_closes_is_blamed() -> None:
    """The smallest peer registers and dies before closing: the others give up about one
    window after their own wait and blame it, so the retry leaves it out."""
    board = Board()
    dead = IDS[0]
    _view(board, dead).store_raw(group_key(RUN, 1, 5, 0), dead.peer_id,
                                 _encode(_entry(dead), dead), ttl=30)
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(_form, board, i, 0.0, window=0.5, timeout=5.0) for i in IDS[1:3]]
        for fut in futs:
            with pytest.raises(MatchmakingError, match="no roster from leader") as err:
                fut.result(timeout=30)
            assert err.value.blame == dead.peer_id
    assert time.monotonic() - t0 < 4.0  # window + window + slack, well inside the timeout


def test_the_retry_without_the_dead_leader_forms() -> None:
    """Attempt 1 excludes the blamed peer: its stale entry of attempt 0 does not matter, and
    the next smallest peer leads."""
    got = _run_all({i: {"delay": 0.0, "exclude": frozenset({IDS[0].peer_id}),
                        "window": 0.3} for i in IDS[1:4]})
    members = {g.members for g in got.values() if isinstance(g, Group)}
    assert members == {tuple(i.peer_id for i in IDS[1:4])}


def test_different_round_settings_are_not_grouped() -> None:
    """A peer configured with another aggregator is not grouped with the others, and the
    reason names the setting and both values."""
    odd = IDS[2]
    calls: dict[Identity, dict[str, object]] = {i: {"delay": 0.0, "window": 0.5}
                                                for i in IDS[:4]}
    calls[odd] = {"delay": 0.0, "window": 0.5,
                  "settings": {**SETTINGS, "aggregator": "trimmed_mean"}}
    got = _run_all(calls)
    assert got[odd.peer_id].members == (odd.peer_id,)  # type: ignore[union-attr]
    rest = tuple(i.peer_id for i in IDS[:4] if i is not odd)
    for i in IDS[:4]:
        if i is not odd:
            assert got[i.peer_id].members == rest  # type: ignore[union-attr]
    assert settings_difference({**SETTINGS, "aggregator": "trimmed_mean"}, SETTINGS) == (
        "round settings differ: aggregator='trimmed_mean' (ours 'mean')")


def test_the_reason_is_recorded_for_a_different_setting() -> None:
    board = Board()
    odd_view = _view(board, IDS[1])
    odd_view.store_raw(group_key(RUN, 1, 5, 0), IDS[1].peer_id,
                       _encode(_entry(IDS[1], settings={**SETTINGS, "codec": "int8"}), IDS[1]),
                       ttl=30)
    me = _view(board, IDS[0])
    group = form_group(me, RUN, 1, 5, 0, _entry(IDS[0]), 0.2, 2.0, poll_interval=0.02)
    assert group.members == (IDS[0].peer_id,)
    assert (IDS[1].peer_id, "round settings differ: codec='int8' (ours 'int4')", False) in (
        me.rejected)
    assert len(me.rejected) == 1  # decoded once, not at every poll


def test_a_late_peer_is_alone_and_the_leader_excludes() -> None:
    """The leader closes without the peer it excludes; that peer, and one arriving after the
    roster is out, are groups of one for this attempt (they join the next round)."""
    board = Board()
    leader, follower, excluded, late = IDS[0], IDS[1], IDS[2], IDS[3]
    expected = frozenset({leader.peer_id, follower.peer_id, excluded.peer_id})
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futs = {i.peer_id: pool.submit(_form, board, i, 0.0, window=0.5, expected=expected,
                                       exclude=frozenset({excluded.peer_id}) if i is leader
                                       else frozenset())
                for i in (leader, follower, excluded)}
        groups = {pid: f.result(timeout=30) for pid, f in futs.items()}
    assert groups[leader.peer_id].members == (leader.peer_id, follower.peer_id)
    assert groups[follower.peer_id].members == (leader.peer_id, follower.peer_id)
    assert groups[excluded.peer_id].members == (excluded.peer_id,)
    started = time.monotonic()
    alone = _form(board, late, 0.0, window=2.0)
    assert alone.members == (late.peer_id,)
    assert time.monotonic() - started < 1.0  # the roster ends its wait at once


def test_a_registration_carrying_a_roster_is_refused() -> None:
    from dilonode.swarm.records import RosterMember

    roster = [RosterMember(peer_id=IDS[0].peer_id, data_addr="127.0.0.1:1", bandwidth_mbps=1.0)]
    with pytest.raises(ValueError, match="carries no roster"):
        form_group(_view(Board(), IDS[0]), RUN, 1, 5, 0, _entry(IDS[0], roster=roster), 0.1,
                   1.0)


def _encode(entry: GroupEntry, identity: Identity) -> bytes:
    from dilonode.swarm.records import encode_record

    return encode_record(entry, Credentials(identity, RUN))
