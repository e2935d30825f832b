"""Matchmaking: which peers average one fragment round together, agreed through the DHT.

`form_group` is blocking (run it in a thread or executor). Protocol for one attempt:

1. Register: store our `GroupEntry` under `group_key(run_id, fragment, round, attempt)` with
   subkey = our peer id, expiring `timeout + window` seconds later (long enough for every
   peer whose window overlaps ours to read it, short enough that the key dies soon after).
   The entry carries our round settings (codec, chunking, aggregator); an entry whose
   settings differ from ours is ignored with a one-line reason naming the difference.
2. Wait up to `window` after our own registration, polling the key every `poll_interval`
   seconds (re-storing our entry if it is not visible: a refused or lost store). The wait
   ends early once every `expected` peer (those the caller believes alive, from the peer
   records) has registered, or as soon as a leader has closed the group (step 3).
3. Close: entries carry the chain of the fragment's outer state before this round
   (`algo/chain.py`). The chain that stands is the one most entries carry (then the most
   tokens trained, then the smallest peer id among its holders): nodes whose outer state
   differs from it (a lone round, a partition) are left out, go through the round alone and
   adopt the state that stands from its members before they contribute again. The group's
   leader is the smallest peer id among the valid entries with the standing chain that it
   reads at the end of its wait (minus the peers it excludes). It re-stores its own entry
   with a `roster` (members, data addresses, weights, sorted by peer id) and uses that
   roster.
   Every other peer waits for a roster until about one window after it first read the
   leader's entry (the leader registered before that, so its own wait is over by then), and
   blames the leader (`MatchmakingError.blame`) if none comes, so the retry leaves the
   leader out. Which roster a peer's group comes from is settled as the paragraph "One
   writer per group" below says (a roster counts only when its writer is its smallest
   member).
   A peer that reads only rosters without itself registered too late (or was excluded by
   the leader): it is a group of one for this attempt, and joins the next round. A peer
   alone at the end of its window while others are expected (they lag) is not waited on
   by anyone yet, so it waits on, up to the timeout, for the first of them and then one
   more window for the rest, rather than close a group of one and leave them all alone.

Bounded groups (`algo/groups.py`). In a swarm larger than `max_group_size` each node
registers under the key its rule gives (`key_index`, part of the DHT key) and marks its
entry `grouped`. A key is grouped when any entry says so or it holds more than
`max_group_size` entries: its leader is then simply the smallest peer id (replicas of a
grouped swarm differ by design, so nobody is left out for its chain: mixing brings their
states together), its roster lists every entry it read (up to `MAX_ROSTER`), and every
member takes its own group from it (`algo.groups.group_of`: at most `max_group_size`,
the same split on every member). Such groups are `mixing`: their members also average
their outer states (`algo/mixing.py`). With at most `max_group_size` peers nothing changes.

One writer per group makes every member's view the same, where reading the key at the end of
each peer's own window did not: peers that register at different times read different sets.
Two peers can still each believe they lead: a smaller peer id (a joiner) reads the key while
the other's roster is on its way, and writes a roster of its own. So no peer takes a group
from the first roster it sees: once a roster is out (its own written, or one read) it waits
until any competing roster must have landed (twice its slowest DHT call of the attempt, plus
a poll: the competitor read before the first roster landed, and its roster lands within two
of its calls after that), reads again, and takes its group from the rosters that stand:
taken from the smallest writer up, a roster stands unless a standing roster before it names
one of its peers already. Every member derives the same groups from the same rosters, the
writer of a roster that does not stand included. A roster later still (a peer stalled past
that margin) is caught by the all-reduce layer: its first message carries `Group.digest()`,
a mismatch fails the attempt, and the caller retries with `attempt + 1`, a fresh key.

An entry is valid only if it is signed by the peer it names and that peer is admitted (swarm
secret, allowlist: `board.credentials`), so no one can register another peer, slip in, or
forge a roster.
Everything is bounded by `timeout`; failure to register or to read raises `MatchmakingError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Protocol

from dilonode.algo.groups import group_of
from dilonode.collective import GroupNotFormed
from dilonode.net.auth import Credentials
from dilonode.swarm.dht import RawEntry, decode_entries
from dilonode.swarm.records import (
    MAX_ROSTER,
    GroupEntry,
    RosterMember,
    encode_record,
    group_key,
)

__all__ = ["Group", "GroupBoard", "MatchmakingError", "form_group", "settings_difference",
           "standing_chain"]

log = logging.getLogger(__name__)

# Final read budget kept out of the window when `timeout` is tight.
_READ_RESERVE_S = 0.5
# Beyond one window, how long a follower allows its leader to make the roster visible
# (DHT latency, a loaded leader).
_ROSTER_SLACK_S = 1.0
# Both budgets cover a few DHT calls; on a long round trip one call takes several RTTs,
# so each is at least this many of the slowest call the attempt has seen.
_CALLS_IN_BUDGET = 3


def latency_budgets(slowest_call: float, timeout: float, window: float) -> tuple[float, float]:
    """The read reserve kept before the deadline (a fresh read, then the roster's store)
    and the follower's slack for its leader's roster, scaled to the slowest DHT call seen
    so that a 300 ms round trip does not leave the leader's store a fraction of a call."""
    measured = _CALLS_IN_BUDGET * slowest_call
    reserve = min(max(_READ_RESERVE_S, measured), timeout - window)
    return reserve, max(_ROSTER_SLACK_S, measured)


class MatchmakingError(GroupNotFormed):
    """The attempt could not register, read its group or get a roster within the timeout.

    `blame` names the peer that should have closed the group and did not, if any.
    """


class GroupBoard(Protocol):
    """The part of `SwarmDHT` that matchmaking uses (lets tests substitute a fake)."""

    @property
    def peer_id(self) -> str: ...

    @property
    def credentials(self) -> Credentials: ...

    def store_raw(self, key: str, subkey: str, value: bytes, ttl: float,
                  timeout: float | None = None) -> bool: ...

    def get_raw(self, key: str, timeout: float | None = None) -> dict[str, RawEntry]: ...

    def note_rejected(self, key: str, subkey: str, reason: str, *,
                      unauthorized: bool = False, once_per: str | None = None) -> None: ...


@dataclass(frozen=True)
class Group:
    """The outcome of one matchmaking attempt as seen by this node.

    `diverged`: this node was left out because its outer state differs from the one that
    stands; the members of the group that stands (adopt their state). `outvoted`: peers
    left out of our group for holding a state that differs from ours (ours stands).
    `mixing`: a group of a grouped swarm (its members also average their outer states).
    """

    members: tuple[str, ...]
    data_addrs: tuple[str, ...]
    weights: tuple[float, ...]
    my_index: int
    run_id: str
    fragment: int
    round: int
    attempt: int
    diverged: tuple[str, ...] = ()
    outvoted: tuple[str, ...] = ()
    mixing: bool = False

    def digest(self) -> str:
        """sha256 hex of run id, fragment, round, attempt and the sorted members, '\\n'-joined.

        Run ids (`[A-Za-z0-9._-]`) and base58 peer ids contain no newline, so the joined
        text is unambiguous.
        """
        parts = [self.run_id, str(self.fragment), str(self.round), str(self.attempt),
                 *self.members]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()

    @property
    def size(self) -> int:
        return len(self.members)


def _check_args(board: GroupBoard, run_id: str, fragment: int, round: int, attempt: int,
                me: GroupEntry, window: float, timeout: float) -> None:
    if (me.run_id, me.fragment, me.round, me.attempt) != (run_id, fragment, round, attempt):
        raise ValueError(f"entry is for {me.run_id}/{me.fragment}/{me.round}/{me.attempt}, "
                         f"not {run_id}/{fragment}/{round}/{attempt}")
    if me.peer_id != board.peer_id:
        raise ValueError(f"entry names peer {me.peer_id}, this node is {board.peer_id}")
    if me.roster is not None:
        raise ValueError("a registration carries no roster (the leader adds it)")
    if not 0.0 <= window < timeout:
        raise ValueError(f"need 0 <= window < timeout, got window={window}, timeout={timeout}")


def settings_difference(theirs: Mapping[str, object], ours: Mapping[str, object]) -> str:
    """'' when equal, else one line naming every setting that differs."""
    diff = [f"{k}={theirs.get(k, '-')!r} (ours {ours.get(k, '-')!r})"
            for k in sorted(set(theirs) | set(ours)) if theirs.get(k) != ours.get(k)]
    return "round settings differ: " + ", ".join(diff) if diff else ""


class _Board:
    """One attempt's view of its key: polls, decodes each distinct stored value once (so a
    bad entry is verified and counted once, not at every poll), and keeps our entry in."""

    def __init__(self, board: GroupBoard, key: str, me: GroupEntry, ttl: float,
                 poll_interval: float) -> None:
        self.board, self.key, self.me, self.ttl = board, key, me, ttl
        self.poll_interval = poll_interval
        self._decoded: dict[tuple[str, bytes], GroupEntry | None] = {}
        self.entries: dict[str, GroupEntry] = {}  # valid entries of the last read
        # When each peer's entry was first read: it registered before then, so its window
        # (and its roster, if it leads) ends at most one window later.
        self.first_seen: dict[str, float] = {}
        self.own_visible = False
        # The slowest store or read of this attempt so far: how stale what we read can be,
        # and how late a roster written by a peer that read before ours landed can appear.
        self.slowest_call = 0.0

    def store(self, entry: GroupEntry, until: float) -> bool:
        t0 = time.monotonic()
        try:
            return self.board.store_raw(self.key, entry.peer_id,
                                        encode_record(entry, self.board.credentials), self.ttl,
                                        timeout=max(until - time.monotonic(), 0.0))
        finally:
            self.slowest_call = max(self.slowest_call, time.monotonic() - t0)

    def read(self, until: float) -> dict[str, GroupEntry]:
        """Read the key (TimeoutError past `until`) and return its valid entries."""
        t0 = time.monotonic()
        try:
            raw = self.board.get_raw(self.key, timeout=max(until - time.monotonic(), 0.0))
        finally:
            self.slowest_call = max(self.slowest_call, time.monotonic() - t0)
        self.own_visible = self.me.peer_id in raw
        fresh = {k: v for k, v in raw.items() if (k, v.value) not in self._decoded}
        good = decode_entries(self.board, self.key, fresh, GroupEntry, self.board.credentials)
        for subkey, got in fresh.items():
            entry = good.get(subkey)
            if entry is not None and (reason := self._mismatch(entry)):
                self.board.note_rejected(self.key, subkey, reason)
                entry = None
            self._decoded[(subkey, got.value)] = entry
        self.entries = {k: e for k, v in raw.items()
                        if (e := self._decoded[(k, v.value)]) is not None}
        now = time.monotonic()
        for peer in self.entries:
            self.first_seen.setdefault(peer, now)
        return self.entries

    def _mismatch(self, got: GroupEntry) -> str:
        me = self.me
        if (got.fragment, got.round, got.attempt) != (me.fragment, me.round, me.attempt):
            return "entry for another fragment/round/attempt"
        return settings_difference(got.settings, me.settings)

    def watch(self, until: float, done: Callable[[dict[str, GroupEntry]], bool]) -> bool:
        """Poll until `done(entries)` (True) or `until` (False); re-store our entry while
        it is not visible. A slow or failed poll is not an error: the caller decides."""
        while until - time.monotonic() > 0:
            try:
                if done(self.read(until)):
                    return True
                if not self.own_visible:
                    self.store(self.me, until)
            except TimeoutError:
                pass
            time.sleep(max(min(self.poll_interval, until - time.monotonic()), 0.0))
        return False


def _register(view: _Board, deadline: float) -> None:
    try:
        ok = view.store(view.me, deadline)
    except TimeoutError as exc:
        raise MatchmakingError(f"could not register under {view.key}: {exc}") from None
    if not ok:
        # Refused: an entry with a later expiration is already there (ours from a retry).
        log.debug("store under %s refused; relying on the existing entry", view.key)


def _closing(entries: Mapping[str, GroupEntry]) -> list[GroupEntry]:
    """The closing entries among `entries`, by writer: a roster counts only when its
    writer is its smallest member."""
    return [e for p, e in sorted(entries.items())
            if e.roster and e.roster[0].peer_id == p]


def _standing_rosters(entries: Mapping[str, GroupEntry]) -> list[GroupEntry]:
    """The rosters that stand, by writer: taking them from the smallest writer up, a roster
    stands unless it names a peer that a roster standing before it names already. Two
    peers that each believed they led (one registered while the other's roster was on its
    way) wrote overlapping rosters; every member that reads both derives the same groups
    from them, so the round is not split."""
    claimed: set[str] = set()
    standing = []
    for entry in _closing(entries):
        names = {m.peer_id for m in entry.roster or ()}
        if not names & claimed:
            claimed |= names
            standing.append(entry)
    return standing


def _roster_for(entries: dict[str, GroupEntry], me: str) -> tuple[GroupEntry | None, bool]:
    """(the standing roster that names `me`, whether any roster exists)."""
    for entry in _standing_rosters(entries):
        if any(m.peer_id == me for m in entry.roster or ()):
            return entry, True
    return None, bool(_closing(entries))


def _standing_roster(entries: dict[str, GroupEntry]) -> tuple[tuple[str, ...], str] | None:
    """(members, chain) of the standing roster with the most members (then the smallest
    writer), or None: the group that stands when we were left out of it."""
    closed = _standing_rosters(entries)
    if not closed:
        return None
    best = max(closed, key=lambda e: len(e.roster or ()))
    return tuple(m.peer_id for m in best.roster or ()), best.chain


def _group(members: list[RosterMember], me: GroupEntry) -> Group:
    ids = tuple(m.peer_id for m in members)
    return Group(members=ids, data_addrs=tuple(m.data_addr for m in members),
                 weights=tuple(m.bandwidth_mbps for m in members),
                 my_index=ids.index(me.peer_id), run_id=me.run_id, fragment=me.fragment,
                 round=me.round, attempt=me.attempt)


def _member_group(closing: GroupEntry, me: GroupEntry, max_group_size: int | None) -> Group:
    """Our group from a leader's closing entry: its whole roster, or in a grouped key the
    part of the roster's split that holds us."""
    assert closing.roster is not None
    if not closing.grouped:
        return _group(closing.roster, me)
    ids = [m.peer_id for m in closing.roster]
    mine = group_of(me.peer_id, ids, max_group_size or len(ids), me.run_id, me.fragment,
                    me.round)
    return dataclasses.replace(_group([m for m in closing.roster if m.peer_id in mine], me),
                               mixing=True)


def _is_grouped(entries: Mapping[str, GroupEntry], me: GroupEntry,
                max_group_size: int | None) -> bool:
    """Whether a key is split into bounded groups (module docstring)."""
    if max_group_size is None:
        return False
    return (me.grouped or any(e.grouped for e in entries.values())
            or len(set(entries) | {me.peer_id}) > max_group_size)


def _alone(me: GroupEntry, diverged: tuple[str, ...] = ()) -> Group:
    alone = _group([RosterMember(peer_id=me.peer_id, data_addr=me.data_addr,
                                 bandwidth_mbps=me.bandwidth_mbps)], me)
    return dataclasses.replace(alone, diverged=diverged)


def standing_chain(entries: Mapping[str, GroupEntry]) -> str:
    """The chain that stands among `entries`: held by most, then most tokens in all, then
    by the smallest peer id (every member derives the same from the same entries)."""
    holders: dict[str, list[str]] = {}
    for peer, entry in sorted(entries.items()):
        holders.setdefault(entry.chain, []).append(peer)

    def rank(chain: str) -> tuple[int, int, str]:
        peers = holders[chain]
        # min() below: most holders, most tokens, then the smallest first holder.
        return (-len(peers), -sum(entries[p].tokens for p in peers), peers[0])

    return min(holders, key=rank)


def _close(view: _Board, exclude: frozenset[str], deadline: float, grouped: bool = False,
           max_group_size: int | None = None) -> Group:
    """As leader: publish the roster of what we read (our own entry, now with the roster),
    leaving out the entries whose chain is not ours (ours stands: we lead), unless the
    key is grouped: then everyone we read (up to MAX_ROSTER), split into groups."""
    entries = {p: e for p, e in view.entries.items() if p not in exclude}
    entries[view.me.peer_id] = view.me
    outvoted: tuple[str, ...] = ()
    if grouped:
        entries = dict(sorted(entries.items())[:MAX_ROSTER])
    else:
        outvoted = tuple(sorted(p for p, e in entries.items() if e.chain != view.me.chain))
        entries = {p: e for p, e in entries.items() if e.chain == view.me.chain}
    roster = [RosterMember(peer_id=p, data_addr=e.data_addr, bandwidth_mbps=e.bandwidth_mbps)
              for p, e in sorted(entries.items())]
    closing = view.me.model_copy(update={"roster": roster, "grouped": grouped})
    try:
        view.store(closing, deadline)  # a later expiration than the registration: replaces it
    except TimeoutError as exc:
        raise MatchmakingError(f"could not publish the roster under {view.key}: {exc}") from None
    view.entries[view.me.peer_id] = closing  # stored: what we read next holds it too
    if outvoted:
        log.warning("group %s: left out %d peer(s) whose outer state differs from ours "
                    "(they adopt the state that stands): %s", view.key, len(outvoted),
                    ", ".join(outvoted))
    return dataclasses.replace(_member_group(closing, view.me, max_group_size),
                               outvoted=outvoted)


def form_group(board: GroupBoard, run_id: str, fragment: int, round: int, attempt: int,
               me: GroupEntry, window: float, timeout: float, *,
               poll_interval: float = 0.5,
               expected: Collection[str] | Callable[[], Collection[str]] = (),
               exclude: Collection[str] = (),
               gone: Callable[[], Collection[str]] | None = None,
               key_index: int = 0, max_group_size: int | None = None,
               nobody_else: bool = False) -> Group:
    """Register `me` for this attempt and return the group its leader closed.

    `expected` (peer ids believed alive, e.g. from the peer records) ends the wait early once
    all of them have registered; peers registering later join the next round. A callable
    is asked again at every poll (a peer found dead meanwhile is not waited for). `exclude`
    (peers this node will not group with) is honoured when this node leads; a follower
    takes its leader's roster as it is, so that every member runs the same group. `gone`
    (asked at every poll) names peers known dead now (they hung up on our data plane): a
    follower whose leader is among them blames it at once instead of waiting for its roster.
    `key_index` is our key in a grouped swarm (`algo.groups.key_index`) and
    `max_group_size` bounds every group (None: one group of everyone).
    `nobody_else` (the caller's peer records hold no live peer but us) closes a group of one
    at the first read that finds no other entry, instead of waiting a window for a peer that
    is not there (a joiner whose record appears later waits for this round to land anyway);
    an entry that is there gets the usual window.

    `board` is a started `SwarmDHT`. Returns within `timeout` seconds or raises
    `MatchmakingError`; see the module docstring for the protocol.
    """
    _check_args(board, run_id, fragment, round, attempt, me, window, timeout)
    start = time.monotonic()
    deadline = start + timeout
    view = _Board(board, group_key(run_id, fragment, round, attempt, key_index), me,
                  timeout + window, poll_interval)
    _register(view, deadline)
    steps = _Attempt(view, window, start, deadline,
                     latency_budgets(view.slowest_call, timeout, window)[0],
                     frozenset(exclude) - {me.peer_id}, expected, gone, max_group_size,
                     nobody_else)
    steps.gather()
    roster, any_roster = _roster_for(view.entries, me.peer_id)
    grouped = _is_grouped(view.entries, me, max_group_size)
    led: Group | None = None
    if roster is None and not any_roster:
        leader = steps.leader(grouped)
        if leader == me.peer_id:
            led = _close(view, steps.skip, deadline, grouped, max_group_size)
            if nobody_else and led.size == 1:
                return led  # no other live peer: no other roster to wait for
        else:
            steps.follow(leader)
    roster = steps.settle()
    if led is not None and roster is not None and roster.peer_id == me.peer_id:
        log.info("group %s: closed with %d member(s), digest %s", view.key, led.size,
                 led.digest()[:12])
        return led
    if led is not None:
        log.info("group %s: a roster by %s names us first; ours does not stand", view.key,
                 roster.peer_id if roster is not None else "a smaller peer")
    return steps.joined(roster, grouped)


@dataclass
class _Attempt:
    """The steps of one `form_group` call after registering: gather entries for the
    window (`gather`), pick the leader among them (`leader`), as a follower wait for its
    roster (`follow`), and read our group off the roster, or go alone (`joined`)."""

    view: _Board
    window: float
    start: float
    deadline: float
    reserve: float  # kept after the window for the leader's fresh read
    skip: frozenset[str]  # peers we will not group with (honoured when we lead)
    expected: Collection[str] | Callable[[], Collection[str]]
    gone: Callable[[], Collection[str]] | None
    max_group_size: int | None
    nobody_else: bool  # no live peer record but ours: a lone read closes at once

    def dead(self) -> frozenset[str]:
        return frozenset(self.gone() if self.gone is not None else ()) - {self.view.me.peer_id}

    def wanted(self) -> frozenset[str]:
        got = self.expected() if callable(self.expected) else self.expected
        return frozenset(got) - {self.view.me.peer_id}

    def _closed_or_complete(self, entries: dict[str, GroupEntry]) -> bool:
        if _roster_for(entries, self.view.me.peer_id)[1]:
            return True
        want = self.wanted()
        return bool(want) and want <= entries.keys()

    def _lonely(self, entries: dict[str, GroupEntry]) -> bool:
        return not entries.keys() - self.skip - {self.view.me.peer_id}

    def gather(self) -> None:
        """Watch the key for one window (less if every expected peer registered or a
        roster appeared), then read it afresh: the leader decides on that read."""
        view, me, last = self.view, self.view.me.peer_id, self.deadline - self.reserve
        until = min(time.monotonic() + self.window, last)
        if self.nobody_else and view.watch(until, lambda _: True) and self._lonely(view.entries):
            return
        if view.watch(until, self._closed_or_complete):
            return
        try:
            view.read(self.deadline)
        except TimeoutError as exc:
            raise MatchmakingError(f"could not read the group under {view.key}: {exc}") from None
        if self.wanted() and self._lonely(view.entries) and not _roster_for(view.entries, me)[1]:
            # Alone while others are expected (they lag, e.g. on a loaded host): nobody
            # waits on us yet, so wait on for the first of them, then a window for the rest.
            # Closing alone would leave every late peer alone too.
            if view.watch(last, lambda got: _roster_for(got, me)[1] or not self._lonely(got)
                          or not self.wanted()):
                view.watch(min(time.monotonic() + self.window, last), self._closed_or_complete)
            with contextlib.suppress(TimeoutError):
                view.read(self.deadline)

    def leader(self, grouped: bool) -> str:
        """The smallest peer id among those we group with (in an ungrouped key, among the
        holders of the chain that stands). Not `dead()` here: peers that do not know yet
        would pick another leader."""
        me = self.view.me
        valid = {p: e for p, e in self.view.entries.items() if p not in self.skip}
        valid[me.peer_id] = me
        if grouped:  # replicas differ by design: nobody is left out for its chain
            return min(valid)
        chain = standing_chain(valid)
        return min(p for p, e in valid.items() if e.chain == chain)

    def follow(self, leader: str) -> GroupEntry | None:
        """Wait for `leader`'s roster; the roster naming us, None if one closed without
        us; MatchmakingError blaming the leader if none came."""
        view = self.view
        # The leader registered before we first read its entry, so it closes by one window
        # after that (plus DHT latency and its poll), not one window after our own wait:
        # a leader that died costs the others a window and the slack, not two windows.
        closes_by = view.first_seen.get(leader, time.monotonic()) + self.window
        slack = latency_budgets(view.slowest_call, self.deadline - self.start, self.window)[1]
        wait_end = min(self.deadline, max(closes_by, time.monotonic()) + slack
                       + view.poll_interval)
        view.watch(wait_end, lambda got: _roster_for(got, view.me.peer_id)[1]
                   or leader in self.dead())
        roster, any_roster = _roster_for(view.entries, view.me.peer_id)
        if roster is None and not any_roster:
            why = " (it hung up)" if leader in self.dead() else ""
            raise MatchmakingError(f"no roster from leader {leader} under {view.key} within "
                                   f"{time.monotonic() - self.start:.1f}s{why}", blame=leader)
        return roster

    def settle(self) -> GroupEntry | None:
        """Once a roster is out (ours written, or one read): wait until every competing
        roster must be visible, read the key again, and return the standing roster that
        names us (None: none does). A competing roster comes from a peer whose last read
        was sent before the first roster landed; its roster lands within two of its calls
        after that, so twice the slowest call seen here plus a poll covers it."""
        view = self.view
        until = min(time.monotonic() + 2 * view.slowest_call + view.poll_interval,
                    self.deadline - self.reserve)
        view.watch(until, lambda _: False)
        with contextlib.suppress(TimeoutError):
            view.read(self.deadline)
        return _roster_for(view.entries, view.me.peer_id)[0]

    def joined(self, roster: GroupEntry | None, grouped: bool) -> Group:
        """Our group from the roster that names us; alone when the group closed without
        us (and, if our state is not the one that stands, told whose is)."""
        view, me = self.view, self.view.me
        if roster is None:
            stood = None if grouped else _standing_roster(view.entries)
            if stood is not None and stood[1] != me.chain:
                log.warning("group %s: our outer state differs from the one that stands "
                            "(held by %s); alone this round, then adopting theirs", view.key,
                            ", ".join(stood[0]))
                return _alone(me, diverged=stood[0])
            log.info("group %s: closed without us (late or excluded); alone this round",
                     view.key)
            return _alone(me)
        group = _member_group(roster, me, self.max_group_size)
        log.info("group %s: %d member(s), I am #%d, digest %s", view.key, group.size,
                 group.my_index, group.digest()[:12])
        return group
