"""A node's membership in a run: its published peer record (with heartbeat and withdrawal),
the live peer list, and group forming for one (fragment, round, attempt).

Shared by the training node (`dilonode.node.daemon`) and the soak harness, which exercises the
network layer without a trainer.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from dilonode.algo.groups import grouped, key_index, num_keys
from dilonode.collective import FormedGroup, GroupRequest
from dilonode.config import NetworkConfig
from dilonode.swarm.dht import SwarmDHT
from dilonode.swarm.matchmaking import form_group
from dilonode.swarm.records import GroupEntry, PeerRecord

__all__ = ["Membership"]

log = logging.getLogger(__name__)

# The longest a read of peer records may hold a matchmaking poll or a joiner's floor.
_POLL_READ_S = 1.0


class _Round(NamedTuple):
    """A fragment's latest round on this node."""

    round: int
    start: float | None  # on the swarm clock (`GroupRequest.start`)
    expected: frozenset[str]  # peers it waited for when it started
    members: frozenset[str] | None  # once grouped


def _counted_from(record: PeerRecord, start: float | None) -> bool | None:
    """Whether a round starting at `start` counts the node of `record` by the first round
    it names (`joins_from`); None when the record names none or the start is unknown."""
    if start is None or record.joins_from is None:
        return None
    return record.joins_from <= start


class Membership:
    """Peer record, heartbeat and matchmaking for one node on a started `SwarmDHT`.

    `data_addr` is our data plane's address as peers dial it and `gone` its peers that hung
    up (`DataPlane.gone`); a node that builds its membership before its data plane (the
    group former needs one, the plane's collective needs the former) attaches them with
    `attach_data_plane`, and its state server with `attach_state_server`, before the
    first record is published. `status()` is the status our record carries; `settings`
    the round settings every group member must share (`RoundPolicy.settings()`);
    `reachable=False`: we are behind a NAT, peers dial us by libp2p stream (swarm/reach).
    """

    def __init__(self, dht: SwarmDHT, run_id: str, net: NetworkConfig, data_addr: str = "",
                 status: Callable[[], dict[str, Any]] | None = None, *,
                 settings: Mapping[str, str | int | float] | None = None,
                 gone: Callable[[], Mapping[str, float]] | None = None,
                 reachable: bool = True) -> None:
        self.dht, self.run_id, self.net, self.data_addr = dht, run_id, net, data_addr
        self.gone = gone or dict
        self.status = status or (lambda: {})
        self.settings = dict(settings or {})
        # Ours, when we join a running swarm (`PeerRecord.joins_from`), kept in every
        # record we publish.
        self.joins_from: float | None = None
        self.state_addr: str | None = None  # advertised state-sync listener, if any
        self.reachable = reachable
        # Our weight in a round's split (butterfly part sizes): the configured bandwidth,
        # lowered to what our link measured (`advertise_bandwidth`).
        self.bandwidth_mbps = net.bandwidth_mbps
        # Peer records can be briefly missing from a DHT read: peers that were in our groups
        # within one record ttl are expected too (a dead one costs a window, as its record does).
        self._seen: dict[str, float] = {}
        # Peers a retry left out (blamed, dropped, banned), and when: like peers that hung up
        # (`gone`), not expected for one record ttl, since a killed peer's record outlives it
        # and would cost every round in that time a whole window. They can still register
        # and be grouped.
        self._suspect: dict[str, float] = {}
        self._live: tuple[float, list[PeerRecord]] = (float("-inf"), [])
        # Per fragment, its latest round here.
        self._rounds: dict[int, _Round] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def attach_data_plane(self, data_addr: str,
                          gone: Callable[[], Mapping[str, float]]) -> None:
        """Our data plane, once it listens: the address our records and group entries
        advertise, and its peers that hung up."""
        self.data_addr, self.gone = data_addr, gone

    def attach_state_server(self, state_addr: str | None) -> None:
        """The state-sync listener our records advertise (None: we serve no state)."""
        self.state_addr = state_addr

    def join_from(self, joins_from: float) -> None:
        """Name our first round (`PeerRecord.joins_from`) in every record from now on."""
        self.joins_from = joins_from

    def start(self) -> None:
        """Publish our record now and keep it fresh in a background thread."""
        self.publish()
        self._thread = threading.Thread(target=self._beat, name="dilonode-heartbeat",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the heartbeat and withdraw the record (a newer one marked leaving)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.dht.started:
            try:
                self.publish(leaving=True)
            except Exception as exc:  # leaving must not fail because the DHT is unwell
                log.warning("could not withdraw peer record: %s", exc)

    def advertise_bandwidth(self, measured_mbps: float) -> bool:
        """Take a measured link rate as our weight in rounds from now on, if it is below the
        configured one (`network.bandwidth_mbps` is the most we claim); True if it was."""
        if not 0.0 < measured_mbps < self.bandwidth_mbps:
            return False
        self.bandwidth_mbps = measured_mbps
        return True

    def publish(self, leaving: bool = False) -> None:
        status = {"leaving": True} if leaving else self.status()
        record = PeerRecord(peer_id=self.dht.peer_id, run_id=self.run_id,
                            data_addr=self.data_addr, bandwidth_mbps=self.bandwidth_mbps,
                            step=int(status.get("step", 0)), status=status,
                            state_addr=self.state_addr, reachable=self.reachable,
                            joins_from=self.joins_from)
        # hivemind keeps the value expiring last: the leaving record must outlive the last one.
        self.dht.publish(record, ttl=self.net.peer_ttl + (1.0 if leaving else 0.0))

    def _beat(self) -> None:
        while not self._stop.wait(self.net.peer_ttl / 3):
            try:
                self.publish()
            except Exception as exc:  # a missed heartbeat is retried at the next one
                log.warning("heartbeat failed: %s", exc)

    def live_peers(self, max_age: float = 0.0, *, soft: bool = False) -> list[PeerRecord]:
        """Peers with a fresh record that are not leaving; reuses a read up to `max_age` s.
        `soft`, for calls that must not stall (matchmaking polls, a joiner's floor): the
        read takes at most `_POLL_READ_S`, and when it fails the last read's records stand
        for another `max_age` (a DHT that is restarting would otherwise hold every poll
        for its whole operation timeout)."""
        fetched_at, peers = self._live
        if time.monotonic() - fetched_at <= max_age:
            return peers
        try:
            got = self.dht.fetch_peers(timeout=_POLL_READ_S) if soft else self.dht.fetch_peers()
        except Exception as exc:
            if not soft:
                raise
            log.debug("reading peer records while polling failed: %s", exc)
            self._live = (time.monotonic(), peers)
            return peers
        peers = [r for r in got if not (r.status or {}).get("leaving")]
        self._live = (time.monotonic(), peers)
        return peers

    def wait_for_peers(self, need: int, timeout: float,
                       stop: threading.Event | None = None, *,
                       refreshed: bool = False) -> list[PeerRecord]:
        """The live peers once `need` of them are visible; TimeoutError after `timeout` s.
        Returns early, with fewer, once `stop` is set: a node asked to stop while it waits
        for its peers stops then, not when its start timeout runs out. `refreshed` (a node
        resuming after a crash) counts only peers that published a record while it waited:
        its killed peers' records outlive them by up to a ttl, and counting those would let
        it train alone from its own, possibly older, checkpoint."""
        deadline = time.monotonic() + timeout
        stop = stop or threading.Event()
        first: dict[str, float] | None = None  # expiry of each peer's record at the first read
        logged = False
        while True:
            peers = self.live_peers()
            if refreshed:
                first = first if first is not None else {r.peer_id: r.expires_at for r in peers}
                peers = _republished(peers, first, self.dht.peer_id)
            if len(peers) >= need or stop.is_set():
                return peers
            if time.monotonic() > deadline:
                raise TimeoutError(f"network.min_peers = {need}: only {len(peers)} peer(s) "
                                   f"visible after {timeout} s")
            if not logged:
                log.info("waiting for network.min_peers = %d peers (%d visible), at most "
                         "%g s", need, len(peers), timeout)
                logged = True
            stop.wait(0.2)

    def private_peers(self) -> frozenset[str]:
        """Peers whose last read record says they cannot be dialled (behind a NAT); no DHT
        call."""
        return frozenset(r.peer_id for r in self.live_peers(max_age=math.inf)
                         if not r.reachable)

    def is_live(self, peer_id: str) -> bool:
        """Whether `peer_id` has a live record in the last read (no DHT call)."""
        return any(r.peer_id == peer_id for r in self.live_peers(max_age=math.inf))

    async def form(self, request: GroupRequest) -> FormedGroup:
        """`FormGroup` for the all-reduce driver; the DHT calls run in a worker thread."""
        return await asyncio.to_thread(self.form_blocking, request)

    def form_blocking(self, request: GroupRequest) -> FormedGroup:
        """A group for one attempt: registered with what `request` says of our state (its
        chain and tokens), waiting for the peers a round starting at `request.start` on
        the swarm clock counts."""
        fragment, round_no, attempt = request.fragment, request.round, request.attempt
        exclude = set(request.exclude)
        with self._lock:
            now = time.monotonic()
            self._suspect.update({p: now for p in exclude})

        # Who this round waits for is fixed when it starts (a joiner whose record appears
        # later joins the next round: it waits for this one to land, see `counts`), except
        # joiners that name their first round (`joins_from`): each round that starts at or
        # after it waits for them, whenever their record is read, and no round before it
        # does. A peer found dead meanwhile stops being waited for at the next poll.
        start = request.start
        waits_for = frozenset(self._expected(exclude, start))
        nobody_else = self._nobody_else(waits_for)
        everyone = len(waits_for | {self.dht.peer_id})
        index, is_grouped, waits_for = self._key_of(fragment, round_no, attempt, waits_for,
                                                    exclude)
        with self._lock:
            self._rounds[fragment] = _Round(round_no, start, waits_for, None)

        def expected() -> frozenset[str]:
            # A retry waits only for its last group's members (`_key_of`).
            joining = self._joining(start, exclude) - waits_for if attempt == 0 else set()
            if joining and is_grouped:  # under our key, as the round started with
                keys = num_keys(everyone, self.net.max_group_size)
                joining = {p for p in joining
                           if key_index(self.run_id, fragment, round_no, p, keys) == index}
            return (waits_for | joining) - self._suspects()

        me = GroupEntry(peer_id=self.dht.peer_id, run_id=self.run_id, data_addr=self.data_addr,
                        fragment=fragment, round=round_no, attempt=attempt,
                        bandwidth_mbps=self.bandwidth_mbps, settings=self.settings,
                        chain=request.chain, tokens=request.tokens, grouped=is_grouped)
        group = form_group(self.dht, self.run_id, fragment, round_no, attempt, me,
                           self.net.matchmaking_window, self.net.matchmaking_timeout,
                           poll_interval=0.05, expected=expected, exclude=exclude,
                           gone=self._hung_up, key_index=index,
                           max_group_size=self.net.max_group_size, nobody_else=nobody_else)
        now = time.monotonic()
        with self._lock:
            self._seen.update({m: now for m in group.members})
            self._rounds[fragment] = _Round(round_no, start, frozenset(),
                                            frozenset(group.members))
        missing = tuple(sorted(waits_for - set(group.members) - {self.dht.peer_id}))
        if missing:  # who each node waited for differs when a record was just appearing
            log.info("fragment %d round %d attempt %d: %d peer(s) expected when the round "
                     "started are not in its group: %s", fragment, round_no, attempt,
                     len(missing), ", ".join(missing))
        return FormedGroup(group.members, group.data_addrs, group.weights, group.my_index,
                           group.digest(), group.diverged, group.outvoted, group.mixing,
                           missing, stream_only=self.private_peers())

    def _nobody_else(self, waits_for: frozenset[str]) -> bool:
        """Whether this round can only be ours alone: nobody expected, and the record read
        it came from holds our own record (a failed or partial read is no evidence that
        the others are gone, and closing alone then would split a round they wait in)."""
        me = self.dht.peer_id
        if waits_for - {me}:
            return False
        return any(r.peer_id == me for r in self.live_peers(max_age=1.0))

    def _key_of(self, fragment: int, round_no: int, attempt: int, waits_for: frozenset[str],
                exclude: set[str]) -> tuple[int, bool, frozenset[str]]:
        """(our key, whether the swarm is grouped, whom to wait for there) for this attempt
        (algo/groups.py): the keys follow the live count; we wait only for the peers our
        view puts under our key, and on a retry only for our last group's members (the
        other groups of our key succeeded and do not come back)."""
        m = self.net.max_group_size
        n = len(waits_for | {self.dht.peer_id})
        if not grouped(n, m):
            return 0, False, waits_for
        keys = num_keys(n, m)
        index = key_index(self.run_id, fragment, round_no, self.dht.peer_id, keys)
        mine = frozenset(p for p in waits_for
                         if key_index(self.run_id, fragment, round_no, p, keys) == index)
        with self._lock:
            last = self._rounds.get(fragment)
        if (attempt > 0 and last is not None and last.round == round_no
                and last.members is not None):
            mine = mine & last.members - exclude
        return index, True, mine

    def counts(self, fragment: int, round_no: int, peer_id: str) -> bool:
        """Whether our `round_no` of `fragment` counts `peer_id`: it is in the group, or, while
        the group is forming, the round starts at or after the first round its record names
        (`joins_from`; we wait for it to register), or, with no such record read, it was
        expected when the round started (a peer found dead since is not, but then it is no
        joiner asking). For joiners' floors (`SnapshotSource.attach`): a joiner takes part
        in such a round instead of waiting for it to land. Reads live records at most 1 s
        old (a DHT read at most once a second, `_POLL_READ_S` long): call it off any event
        loop."""
        with self._lock:
            got = self._rounds.get(fragment)
        if got is None or got.round != round_no:
            return False
        if got.members is not None:
            return peer_id in got.members
        record = next((r for r in self.live_peers(max_age=1.0, soft=True)
                       if r.peer_id == peer_id), None)
        named = None if record is None else _counted_from(record, got.start)
        return peer_id in got.expected if named is None else named

    def _hung_up(self) -> set[str]:
        """Peers that hung up on our data plane within one record ttl (and did not connect
        again): dead, as far as we can tell."""
        now, ttl = time.monotonic(), self.net.peer_ttl
        return {p for p, t in self.gone().items() if now - t < ttl}

    def _suspects(self) -> set[str]:
        """Peers not expected now: hung up, or left out by a retry, within one record ttl."""
        now, ttl = time.monotonic(), self.net.peer_ttl
        with self._lock:
            left_out = {p for p, t in self._suspect.items() if now - t < ttl}
        return left_out | self._hung_up()

    def _expected(self, exclude: set[str], start: float | None = None) -> set[str]:
        """Peers a round starting at `start` (swarm clock; None: unknown) waits for: live
        and recent ones, less joiners whose first round comes later."""
        now, ttl = time.monotonic(), self.net.peer_ttl
        with self._lock:
            recent = {p for p, t in self._seen.items() if now - t < ttl}
        # Every round asks; one DHT read a second is plenty (records live peer_ttl seconds).
        live = {r.peer_id for r in self.live_peers(max_age=1.0)
                if _counted_from(r, start) is not False}
        return (live | recent) - exclude - self._suspects()

    def _joining(self, start: float | None, exclude: set[str]) -> frozenset[str]:
        """Joiners whose first round (`joins_from`) is at or before a round starting at
        `start`: that round waits for them even if their record was read after it started
        (every peer then agrees it counts them, whenever it read their record)."""
        if start is None:
            return frozenset()
        me = self.dht.peer_id
        return frozenset(r.peer_id for r in self.live_peers(max_age=1.0, soft=True)
                         if _counted_from(r, start) and r.peer_id != me) - exclude


def _republished(peers: list[PeerRecord], first: Mapping[str, float],
                 me: str) -> list[PeerRecord]:
    """Of `peers`, ours and those whose record is not the one the first read held: a live
    peer re-publishes every third of its ttl, a dead one's record never changes. Nothing
    here depends on the peers' ttl, which need not be ours."""
    return [r for r in peers
            if r.peer_id == me or first.get(r.peer_id) != r.expires_at]
