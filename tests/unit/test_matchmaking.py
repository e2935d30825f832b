"""Matchmaking over an in-memory board: one leader closes each group, so every member runs the
same group even when peers register at different times, and a joiner appearing mid-window
does not split the round into mismatching views.

Peers run `form_group` in threads with staggered starts; what is asserted holds for any
interleaving (the property the protocol guarantees), so the staggering only makes the old
failure likely, never the assertions timing-dependent.
"""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from dilonode.collective import GroupRequest
from dilonode.net.auth import Credentials, Identity
from dilonode.swarm.matchmaking import (
    Group,
    MatchmakingError,
    _roster_for,
    _standing_rosters,
    form_group,
    latency_budgets,
    settings_difference,
)
from dilonode.swarm.records import GroupEntry, PeerRecord, RosterMember, group_key
from tests.boards import Board, View
from tests.support.waiting import wait_until

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


def _run_all(calls: dict[Identity, dict[str, object]],
             latency: float = 0.0) -> dict[str, Group | BaseException]:
    board = Board(latency)
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


def _one_group(got: dict[str, Group | BaseException], expected: frozenset[str]) -> None:
    """Every peer that is in a group is in the same one (same members, addresses, weights,
    digest); the expected peers are all in it; any other peer is in it or alone."""
    groups = [g for g in got.values() if isinstance(g, Group)]
    assert len(groups) == len(got), got
    shared = {(g.members, g.data_addrs, g.weights, g.digest()) for g in groups if g.size > 1}
    assert len(shared) == 1, shared
    members = next(iter(shared))[0]
    assert expected <= set(members)
    for pid, g in got.items():
        assert isinstance(g, Group)
        assert g.members == members or g.members == (pid,), (pid, g.members)
        assert g.members[g.my_index] == pid


def _staggered(joiner_at: float) -> tuple[dict[Identity, dict[str, object]], frozenset[str]]:
    """4 known peers arriving 0.1 s apart and an unexpected joiner with the smallest id (the
    hardest case: it would lead any group it reads) arriving at `joiner_at`."""
    known, joiner = IDS[1:5], IDS[0]
    expected = frozenset(i.peer_id for i in known)
    calls: dict[Identity, dict[str, object]] = {
        ident: {"delay": 0.1 * k, "expected": expected} for k, ident in enumerate(known)}
    calls[joiner] = {"delay": joiner_at, "expected": expected}
    return calls, expected


def test_staggered_peers_and_a_joiner_all_get_one_group() -> None:
    """The joiner arrives just after the known peers are all in (when each of them would
    stop waiting)."""
    calls, expected = _staggered(0.32)
    for _ in range(3):
        _one_group(_run_all(calls), expected)


@pytest.mark.parametrize("joiner_at", [0.32, 0.36, 0.40, 0.44])
def test_a_joiner_racing_the_roster_over_a_slow_dht_makes_no_second_group(joiner_at) -> None:
    """Every DHT call takes 50 ms, so what a peer reads is that stale. The smallest known
    peer closes once all known peers are in; the joiner (smaller still) reads the key before
    that roster lands and writes a roster of its own. Both rosters are out: every peer,
    leader included, must derive the same group from them."""
    calls, expected = _staggered(joiner_at)
    _one_group(_run_all(calls, latency=0.05), expected)


def test_of_overlapping_rosters_the_smaller_writers_stands_and_the_rest_fall() -> None:
    """Rosters are taken from the smallest writer up; one naming a peer an earlier standing
    roster names does not stand (its members, writer included, read no group from it)."""
    a, b, c, d, e = (i.peer_id for i in IDS[:5])

    def closing(writer: str, members: list[str]) -> GroupEntry:
        ident = next(i for i in IDS if i.peer_id == writer)
        return _entry(ident, roster=[RosterMember(peer_id=m, data_addr="127.0.0.1:1",
                                                  bandwidth_mbps=1.0) for m in members])

    entries = {a: closing(a, [a, b, c]), b: closing(b, [b, c, d, e]), d: closing(d, [d, e])}
    assert [x.peer_id for x in _standing_rosters(entries)] == [a, d]
    assert _roster_for(entries, b)[0].peer_id == a
    assert _roster_for(entries, e)[0].peer_id == d
    lone = {b: closing(b, [b, c, d, e]), d: _entry(IDS[3])}  # d registered, did not close
    assert [x.peer_id for x in _standing_rosters(lone)] == [b]


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
    window after they first saw its entry (its own wait was over by then), not one window
    after their own wait, and blame it, so the retry leaves it out."""
    board = Board()
    dead = IDS[0]
    _view(board, dead).store_raw(group_key(RUN, 1, 5, 0), dead.peer_id,
                                 _encode(_entry(dead), dead), ttl=30)
    window = 2.0
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(_form, board, i, 0.0, window=window, timeout=8.0)
                for i in IDS[1:3]]
        for fut in futs:
            with pytest.raises(MatchmakingError, match="no roster from leader") as err:
                fut.result(timeout=30)
            assert err.value.blame == dead.peer_id
    # window + 1 s slack + a poll; waiting a second window after our own (5 s) would fail.
    assert time.monotonic() - t0 < 2 * window


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


class _Peers(View):
    """A `View` that also lists peer records, as `SwarmDHT.fetch_peers` does."""

    def __init__(self, board: Board, identity: Identity, alive: list[Identity],
                 joins: dict[str, float] | None = None) -> None:
        super().__init__(board, Credentials(identity, RUN))
        self.alive = alive
        self.joins = joins or {}  # peer id -> the first round its record names

    def fetch_peers(self, timeout: float | None = None) -> list[PeerRecord]:
        return [PeerRecord(peer_id=i.peer_id, run_id=RUN, data_addr="127.0.0.1:7000",
                           bandwidth_mbps=10.0, step=0, joins_from=self.joins.get(i.peer_id))
                for i in self.alive]


def _ask(fragment: int, round_no: int, attempt: int = 0, exclude: set[str] | None = None,
         timed: bool = False) -> GroupRequest:
    """One attempt's request; `timed`: the round starts on the swarm clock at
    10 * round + fragment (reference steps, as `SyncPlan.start_step` gives)."""
    return GroupRequest(fragment, round_no, attempt, frozenset(exclude or ()),
                        start=10.0 * round_no + fragment if timed else None)


@pytest.mark.parametrize("known_by", ["retry", "hang-up"])
def test_a_dead_peer_is_not_waited_for_in_the_next_rounds(known_by: str) -> None:
    """A SIGKILLed peer's record outlives it by up to a record ttl. Once a retry has left it
    out, or it hung up on our data plane (`DataPlane.gone`), the next rounds (any fragment)
    do not wait their whole window for it: they close as soon as the others are in. Without
    that, every round in that time cost a window."""
    from dilonode.config import NetworkConfig
    from dilonode.swarm.membership import Membership

    board, dead, live = Board(), IDS[0], IDS[1:4]
    net = NetworkConfig(matchmaking_window=3.0, matchmaking_timeout=6.0, peer_ttl=30.0)
    hung_up = {dead.peer_id: time.monotonic()} if known_by == "hang-up" else {}
    members = [Membership(_Peers(board, i, [dead, *live]), RUN, net,  # type: ignore[arg-type]
                          f"127.0.0.1:{7001 + k}", gone=hung_up.copy)
               for k, i in enumerate(live)]

    def form_all(fragment: int, attempt: int, exclude: set[str]) -> tuple[float, set[tuple]]:
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(len(members)) as pool:
            futs = [pool.submit(m.form_blocking, _ask(fragment, 5, attempt, exclude))
                    for m in members]
            groups = {tuple(f.result(timeout=30).members) for f in futs}
        return time.monotonic() - t0, groups

    if known_by == "retry":  # attempt 1 of a round whose attempt 0 blamed the dead peer
        _, groups = form_all(0, 1, {dead.peer_id})
        assert groups == {tuple(i.peer_id for i in live)}
    # The next round of another fragment, nothing excluded: closes at once.
    took, groups = form_all(1, 0, set())
    assert groups == {tuple(i.peer_id for i in live)}
    assert took < net.matchmaking_window, took
    # What a joiner's floor asks (`Membership.counts`): a round counts its members only.
    m = members[0]
    assert m.counts(1, 5, live[2].peer_id) and not m.counts(1, 5, dead.peer_id)
    assert not m.counts(1, 6, live[2].peer_id) and not m.counts(2, 5, live[2].peer_id)


def test_a_node_whose_link_measured_slower_weighs_that_in_the_groups_it_forms() -> None:
    """A joiner's state fetch measured its link below network.bandwidth_mbps: the groups
    it forms from then on size its part by the measured rate (a small share of the round's
    traffic goes through its link). A measured rate above the configured one is not taken:
    the configured figure is the most a node claims."""
    from dilonode.config import NetworkConfig
    from dilonode.swarm.membership import Membership

    board, live = Board(), IDS[1:3]
    net = NetworkConfig(matchmaking_window=0.5, matchmaking_timeout=6.0, peer_ttl=30.0,
                        bandwidth_mbps=100.0)
    slow, fast = (Membership(_Peers(board, i, live), RUN, net,  # type: ignore[arg-type]
                             f"127.0.0.1:{7001 + k}") for k, i in enumerate(live))
    assert slow.advertise_bandwidth(8.4) and slow.bandwidth_mbps == 8.4
    assert not fast.advertise_bandwidth(400.0) and fast.bandwidth_mbps == 100.0
    assert not fast.advertise_bandwidth(0.0) and not slow.advertise_bandwidth(9.0)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(m.form_blocking, _ask(0, 5)) for m in (slow, fast)]
        groups = [f.result(timeout=30) for f in futs]
    weight = {g.members: dict(zip(g.members, g.weights, strict=True)) for g in groups}
    assert len(weight) == 1 and next(iter(weight.values())) == {
        live[0].peer_id: 8.4, live[1].peer_id: 100.0}


def test_a_lone_peer_stops_waiting_for_an_expected_peer_found_dead() -> None:
    """Alone past its window, a peer waits for the expected ones, asking again at every poll:
    once the one it waits for is found dead (it hung up on the data plane), it closes alone
    at once instead of waiting out the timeout."""
    board, dead = Board(), IDS[5]
    found_dead_at = time.monotonic() + 1.0

    def expected() -> frozenset[str]:
        return frozenset() if time.monotonic() > found_dead_at else frozenset({dead.peer_id})

    t0 = time.monotonic()
    group = form_group(_view(board, IDS[0]), RUN, 1, 5, 0, _entry(IDS[0]), 0.3, 8.0,
                       poll_interval=0.02, expected=expected)
    assert group.members == (IDS[0].peer_id,)
    assert time.monotonic() - t0 < 3.0  # a static expected set waits the whole 8 s


def test_a_peer_that_knows_no_live_peer_but_itself_closes_alone_at_once() -> None:
    """No live record but ours (`nobody_else`): the first read finds no other entry, so
    the group of one closes then, not a window later, and its roster is on the board for a
    late peer to find the round closed."""
    board = Board()
    t0 = time.monotonic()
    group = form_group(_view(board, IDS[0]), RUN, 1, 5, 0, _entry(IDS[0]), 5.0, 8.0,
                       poll_interval=0.02, nobody_else=True)
    assert group.members == (IDS[0].peer_id,)
    assert time.monotonic() - t0 < 2.5  # the window alone is 5 s
    late = form_group(_view(board, IDS[1]), RUN, 1, 5, 0, _entry(IDS[1]), 5.0, 8.0,
                      poll_interval=0.02)
    assert late.members == (IDS[1].peer_id,)  # the round closed without it


def test_a_peer_that_knows_nobody_else_still_groups_with_an_entry_it_finds() -> None:
    """`nobody_else` but another peer did register (its record not read yet): the usual
    window applies and both run the same group."""
    board, other = Board(), IDS[1]
    key = group_key(RUN, 1, 5, 0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(form_group, _view(board, other), RUN, 1, 5, 0, _entry(other), 1.0,
                          8.0, poll_interval=0.02)
        wait_until(lambda: other.peer_id in _view(board, IDS[0]).get_raw(key), 5.0,
                   interval=0.01, what="the other peer's entry")
        mine = form_group(_view(board, IDS[0]), RUN, 1, 5, 0, _entry(IDS[0]), 1.0, 8.0,
                          poll_interval=0.02, nobody_else=True)
        theirs = fut.result(timeout=10)
    assert mine.members == theirs.members == (IDS[0].peer_id, other.peer_id)
    assert mine.digest() == theirs.digest()


def test_a_follower_blames_a_leader_that_hung_up_at_once() -> None:
    """The leader registered, then its process died (its data-plane connections closed):
    its followers blame it as soon as they know, not a window after first reading it."""
    board, dead = Board(), IDS[0]
    _view(board, dead).store_raw(group_key(RUN, 1, 5, 0), dead.peer_id,
                                 _encode(_entry(dead), dead), ttl=30)
    hung_up_at = time.monotonic() + 0.5

    def gone() -> frozenset[str]:
        return frozenset({dead.peer_id}) if time.monotonic() > hung_up_at else frozenset()

    t0 = time.monotonic()
    with pytest.raises(MatchmakingError, match="it hung up") as err:
        form_group(_view(board, IDS[1]), RUN, 1, 5, 0, _entry(IDS[1]), 0.3, 8.0,
                   poll_interval=0.02, gone=gone)
    assert err.value.blame == dead.peer_id
    assert time.monotonic() - t0 < 1.2  # window + slack would be 1.3 s, the timeout 8 s


def test_a_round_names_the_expected_peers_that_are_not_in_its_group(caplog) -> None:
    """A peer with a live record that never registers is waited for a window; the group
    goes on without it, and every member logs whom it expected and did not get (peers
    that read a joiner's record at different moments expect different peers)."""
    from dilonode.config import NetworkConfig
    from dilonode.swarm.membership import Membership

    caplog.set_level("INFO", logger="dilonode.swarm.membership")
    board, absent, live = Board(), IDS[0], IDS[1:3]
    net = NetworkConfig(matchmaking_window=0.5, matchmaking_timeout=3.0, peer_ttl=30.0)
    members = [Membership(_Peers(board, i, [absent, *live]), RUN, net,  # type: ignore[arg-type]
                          f"127.0.0.1:{7001 + k}") for k, i in enumerate(live)]
    with concurrent.futures.ThreadPoolExecutor(len(members)) as pool:
        formed = [f.result(timeout=30) for f in [pool.submit(m.form_blocking, _ask(0, 3))
                                                 for m in members]]
    assert {tuple(f.members) for f in formed} == {tuple(i.peer_id for i in live)}
    assert all(f.missing == (absent.peer_id,) for f in formed)
    line = f"round 3 attempt 0: 1 peer(s) expected when the round started are not in its " \
        f"group: {absent.peer_id}"
    assert caplog.text.count(line) == len(members), caplog.text




def test_a_round_before_a_joiners_first_round_does_not_wait_for_it() -> None:
    """A joiner's record names reference step 50 as its first round. A round starting at
    40 does not count it, though its record is read when that round starts: the round
    closes as soon as the members are in, not a window later, and tells a joiner asking
    that it must land first."""
    from dilonode.config import NetworkConfig
    from dilonode.swarm.membership import Membership

    board, joiner, live = Board(), IDS[0], IDS[1:3]
    net = NetworkConfig(matchmaking_window=3.0, matchmaking_timeout=6.0, peer_ttl=30.0)
    joins = {joiner.peer_id: 50.0}
    members = [Membership(_Peers(board, i, [joiner, *live], joins), RUN,  # type: ignore[arg-type]
                          net, f"127.0.0.1:{7001 + k}")
               for k, i in enumerate(live)]
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(len(members)) as pool:
        futs = [pool.submit(m.form_blocking, _ask(0, 4, timed=True)) for m in members]
        groups = {tuple(f.result(timeout=30).members) for f in futs}
    assert groups == {tuple(i.peer_id for i in live)}
    assert time.monotonic() - t0 < 2.5  # the window is 3 s
    assert not any(m.counts(0, 4, joiner.peer_id) for m in members)


def test_peers_that_read_a_joiners_record_at_different_moments_agree_it_takes_part() -> None:
    """The mutual wait this prevents: a round starts while a joiner's record is becoming
    visible; its leader has read the record and waits for the joiner, another member had
    not and told the joiner the round does not count it, so the joiner waited for that
    round to land. With the first round named in the record (reference step 50, the round
    starts at 50), the member that reads the record only after its round started counts
    the joiner too, and the joiner takes part: one group of three."""
    from dilonode.config import NetworkConfig
    from dilonode.swarm.membership import Membership

    board, joiner, (a, b) = Board(), IDS[0], IDS[1:3]
    net = NetworkConfig(matchmaking_window=4.0, matchmaking_timeout=8.0, peer_ttl=30.0)
    joins = {joiner.peer_id: 50.0}
    late = _Peers(board, b, [a, b], joins)  # b has not read the joiner's record yet

    def member(view: _Peers, port: int) -> Membership:
        return Membership(view, RUN, net, f"127.0.0.1:{port}")  # type: ignore[arg-type]

    ma, mb = member(_Peers(board, a, [joiner, a, b], joins), 7001), member(late, 7002)
    mj = member(_Peers(board, joiner, [joiner, a, b], joins), 7000)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futs = [pool.submit(m.form_blocking, _ask(0, 5, timed=True)) for m in (ma, mb)]
        wait_until(lambda: ma.counts(0, 5, joiner.peer_id), 3.0, interval=0.01,
                   what="a counting the joiner")
        assert not mb.counts(0, 5, joiner.peer_id)  # b knows nothing of it yet
        late.alive.append(joiner)  # b reads the record now, after its round started
        wait_until(lambda: mb.counts(0, 5, joiner.peer_id), 3.0, interval=0.01,
                   what="b counting the joiner")
        futs.append(pool.submit(mj.form_blocking, _ask(0, 5, timed=True)))
        groups = {tuple(f.result(timeout=30).members) for f in futs}
    assert groups == {(joiner.peer_id, a.peer_id, b.peer_id)}


def test_a_failed_read_of_peer_records_does_not_stall_a_poll() -> None:
    """Matchmaking polls and a joiner's floor read peer records (`soft`): a failed read
    gives the last read's records and is not retried for `max_age`, where a plain read
    raises (a DHT that is restarting would otherwise hold every poll)."""
    from dilonode.config import NetworkConfig
    from dilonode.swarm.membership import Membership

    class _Failing(_Peers):
        calls = 0
        failing = False

        def fetch_peers(self, timeout: float | None = None) -> list[PeerRecord]:
            self.calls += 1
            if self.failing:
                raise TimeoutError("DHT restarting")
            return super().fetch_peers(timeout)

    view = _Failing(Board(), IDS[1], IDS[:3])
    m = Membership(view, RUN, NetworkConfig(), "127.0.0.1:7001")  # type: ignore[arg-type]
    first = m.live_peers()
    view.failing = True
    with pytest.raises(TimeoutError):
        m.live_peers()
    assert m.live_peers(max_age=0.0, soft=True) == first
    assert m.live_peers(max_age=60.0, soft=True) == first and view.calls == 3


def test_the_latency_budgets_grow_with_the_slowest_dht_call() -> None:
    """On loopback the fixed budgets hold; at a 300 ms call (150 ms one-way to the DHT peer
    and back twice) the leader keeps three calls for its fresh read and its roster's store,
    and the follower waits as long for that roster; never more than the timeout allows."""
    assert latency_budgets(0.01, timeout=10.0, window=2.0) == (0.5, 1.0)
    reserve, slack = latency_budgets(0.3, timeout=10.0, window=2.0)
    assert (reserve, slack) == (pytest.approx(0.9), 1.0)
    reserve, slack = latency_budgets(1.0, timeout=10.0, window=2.0)
    assert (reserve, slack) == (3.0, 3.0)
    assert latency_budgets(5.0, timeout=10.0, window=2.0) == (8.0, 15.0)
