"""State sync's joining side: `recover`, the joiner's client.

A joiner takes state only from the peer id whose signed record gave it the address. It asks
every serving peer for its manifest, picks the state to trust (`plan.choose_target`), reuses
every chunk it already holds, fetches the rest spread over all peers that advertised it
(about a second of requests in flight at the rate seen, at most a window per peer; a peer
that fails, times out or sends a bad chunk is dropped and its chunks go to the others), and
repeats with fresh manifests until no round has landed since (rounds land every H/P steps
somewhere in the state). What each pass fetched stays, at the version it came from
(`bank.ChunkBank`): the rounds since are replayed on it from their results rather than
fetching it again. Every network operation has a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field

from dilonode import PROTOCOL_VERSION
from dilonode.config import StateSyncConfig
from dilonode.net.auth import Credentials
from dilonode.net.channel import HandshakeError, StreamOpener
from dilonode.statesync.bank import ChunkBank, Derivation
from dilonode.statesync.link import Link, own_peer_id
from dilonode.statesync.plan import (
    Assembler,
    FetchPlan,
    Replayer,
    Target,
    choose_target,
    digests_of,
    fetch_order,
    manifest_of,
)
from dilonode.statesync.protocol import (
    BUSY,
    Chunk,
    ChunkRequest,
    Error,
    Manifest,
    ManifestRequest,
    StateMessage,
)
from dilonode.statesync.rates import RATE_TRUSTED_AFTER_S, RateMeter, ResultRate, catch_up_seconds
from dilonode.train.state import WorkerState
from dilonode.wire.errors import RemoteProtocolError, one_line

__all__ = ["LinkHook", "Recovery", "RecoveryError", "recover"]


log = logging.getLogger(__name__)

def _why(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "no answer in time (statesync.request_timeout)"
    return f"{type(exc).__name__}: {exc}"


# (bytes/s chunks arrive at, round result bytes per fragment, peers counting us): `recover`.
LinkHook = Callable[[float, dict[int, int], int], None]

_MAX_FAILED_FETCHES = 3
_RETRY_S = 0.2  # pause before asking peers again (busy, or a round is landing)
_WATCH_S = 1.0  # during a fetch, re-read manifests this often (a round may land)
# The link rate a joiner reports (`recover`'s on_link): bytes that arrived from
# `_LINK_FROM_S` to `_LINK_AFTER_S` s after the first reply. Chunks land in clumps (every
# peer's replies progress together), so a 3 s reading was off by 0.7-1.5x on a 10 Mbit/s
# link; a fetch this long also has enough left for its rounds to load that link.
_LINK_FROM_S, _LINK_AFTER_S = 2.0, 12.0
MAX_SOURCES = 8  # peers asked at once; more adds connections, not bandwidth


class RecoveryError(RuntimeError):
    """Recovery could not complete (peers gone, chunks unavailable); one-line message."""


@dataclass
class Recovery:
    """What a joiner fetched and how long it took."""

    state: WorkerState
    fetched_bytes: int = 0  # payload bytes received
    reused_bytes: int = 0  # state bytes we already held (own state or checkpoint)
    seconds: float = 0.0  # first manifest request to adoption (waits after publishing too)
    fetch_seconds: float = 0.0  # time spent fetching chunks (the transfer itself)
    manifest_seconds: float = 0.0  # time spent waiting for manifests (outside fetches)
    publish_wait_seconds: float = 0.0  # time blocked on `before_final` (outside fetches)
    passes: int = 0
    sources: dict[str, int] = field(default_factory=dict)  # peer -> payload bytes from it
    agreed_by: tuple[str, ...] = ()  # peers whose manifest was exactly the adopted state
    refused: int = 0  # peers dropped for failing authentication (impostor, tampered frame)
    replayed: int = 0  # fragments (per fetch) brought forward by replaying rounds


class _Client:
    """One recovery: connections to the serving peers and the passes over them."""

    def __init__(self, peers: dict[str, str], run_id: str, digest: str,
                 cfg: StateSyncConfig, auth: Credentials | None, peer_id: str,
                 opener: StreamOpener | None = None,
                 streamed: Collection[str] = ()) -> None:
        # A random subset, so that many joiners spread over a large swarm.
        chosen = random.sample(sorted(peers), min(len(peers), MAX_SOURCES))
        self.addrs = {p: peers[p] for p in sorted(chosen)}
        self.run_id, self.digest, self.cfg = run_id, digest, cfg
        self.auth, self.peer_id = auth, peer_id
        # Peers behind a NAT are reached through `opener` (libp2p streams), not dialled.
        self.opener, self.streamed = opener, frozenset(streamed)
        self.replayer: Replayer | None = None  # replays a round on a fragment (plan.py)
        self.conns: dict[str, Link] = {}
        self.watch: dict[str, Link | None] = {}  # second connections for manifests mid-fetch
        # Every chunk held or fetched so far, at its fragment's version (bank.py).
        self.bank: ChunkBank | None = None
        self._banked: WorkerState | None = None  # the held state last put in the bank
        self.newer: dict[str, Manifest] | None = None  # the manifests that showed it
        self.busy: set[str] = set()
        self.fetched_once = False
        # Called once when a fetch is expected to end within `lead` s (then cleared).
        self.near_end: Callable[[], None] | None = None
        self.on_link: LinkHook | None = None  # see `recover`; cleared once called
        self._link_mark: tuple[float, int] | None = None  # (when, meter.received) then
        self.lead = 0.0
        self.results_seen = ResultRate()  # how fast the served state moves on
        self.planned = 0  # chunks the last fetch set out to get
        self.meter = RateMeter()  # how fast chunks arrive, over all peers
        self.result = Recovery(state=WorkerState(0, (), ()))

    def _opener(self, peer: str) -> StreamOpener | None:
        return self.opener if peer in self.streamed else None

    def _drop(self, peer: str, why: str, refused: bool = False) -> None:
        self.result.refused += refused
        log.warning("state sync: dropping peer %s: %s", peer, one_line(why, 200))
        self.addrs.pop(peer, None)
        for links in (self.conns, self.watch):
            if (conn := links.pop(peer, None)) is not None:
                conn.close()

    async def _manifest(self, peer: str) -> Manifest | None:
        try:
            if peer not in self.conns:
                # `peer` is the id its signed record names: the handshake refuses anyone else.
                self.conns[peer] = await Link.connect(self.addrs[peer], self.auth, self.run_id,
                                                      self.peer_id, peer,
                                                      self.cfg.request_timeout,
                                                      self._opener(peer))
            conn = self.conns[peer]
            conn.send(ManifestRequest(run_id=self.run_id))
            msg = await conn.recv()
        except (OSError, TimeoutError, asyncio.IncompleteReadError, RemoteProtocolError) as exc:
            self._drop(peer, _why(exc), isinstance(exc, HandshakeError))
            return None
        if isinstance(msg, Error):
            log.info("state sync: peer %s has no manifest: %s", peer, msg.reason)
            if msg.reason.startswith(BUSY):
                self.busy.add(peer)
            return None
        if not self._ours(msg):
            self._drop(peer, "answered with a manifest of another run, protocol or config"
                       if isinstance(msg, Manifest) else f"answered {msg.type} to manifest?")
            return None
        assert isinstance(msg, Manifest)
        return msg

    def _ours(self, msg: StateMessage) -> bool:
        return isinstance(msg, Manifest) and msg.run_id == self.run_id and \
            msg.version == PROTOCOL_VERSION and msg.config_digest == self.digest

    async def _poll(self, peer: str) -> Manifest | None:
        """A fresh manifest over a second connection (the first carries chunks); a peer that
        fails here is left alone by the watch (its chunk connection decides its fate)."""
        try:
            link, addr = self.watch.get(peer, False), self.addrs.get(peer)
            if link is None or addr is None:  # not watched, or dropped meanwhile
                return None
            if link is False:
                link = self.watch[peer] = await Link.connect(
                    addr, self.auth, self.run_id, self.peer_id, peer, self.cfg.request_timeout,
                    self._opener(peer))
            assert isinstance(link, Link)
            link.send(ManifestRequest(run_id=self.run_id))
            msg = await link.recv()
        except (OSError, TimeoutError, asyncio.IncompleteReadError, RemoteProtocolError) as exc:
            log.info("state sync: not watching peer %s: %s", peer, _why(exc))
            if (link := self.watch.get(peer)) is not None:
                link.close()
            self.watch[peer] = None
            return None
        return msg if isinstance(msg, Manifest) and self._ours(msg) else None

    async def _watch_newer(self, target: Target, latest: dict[str, Manifest],
                           stop: asyncio.Event, changed: asyncio.Event) -> None:
        """Re-read manifests every `_WATCH_S` during a fetch; once the peers agree on a state
        with more rounds, stop the fetch, so that the chunks of the fragment a round changed
        come from the new state (chunks fetched so far carry over to it)."""
        while True:
            await asyncio.sleep(_WATCH_S)
            peers = [p for p in self.addrs if self.watch.get(p, False) is not None]
            got = await asyncio.gather(*(self._poll(p) for p in peers))
            latest.update({p: m for p, m in zip(peers, got, strict=True) if m is not None})
            self.results_seen.note(latest.values())
            newer = choose_target({p: m for p, m in latest.items() if p in self.addrs})
            if newer is not None and sum(newer.manifest.rounds) > sum(target.manifest.rounds):
                self.newer = {p: m for p, m in latest.items() if p in self.addrs}
                stop.set()
                changed.set()
                return

    async def manifests(self) -> dict[str, Manifest]:
        """One manifest per peer that has one now; `busy` names those to ask again."""
        peers, self.busy = list(self.addrs), set()
        got = await asyncio.gather(*(self._manifest(p) for p in peers))
        out = {p: m for p, m in zip(peers, got, strict=True) if m is not None}
        self.results_seen.note(out.values())
        return out

    async def fetch(self, target: Target, manifests: dict[str, Manifest],
                    held: WorkerState | None, known: dict[str, list[bytes]]
                    ) -> WorkerState | None:
        """The target state, or None when the peers moved on to a newer state mid-fetch
        (then `newer` holds their manifests; what was fetched stays in `bank`).

        Chunks held (`held`, the state we hold, whose chunk digests `known` caches) or
        fetched in earlier passes at an older version of their fragment are brought forward
        by replaying the rounds since, when the results cost fewer bytes than the chunks
        (`bank.py`); a chunk so derived is kept only if it hashes to the target's digest,
        and what is not derived is fetched."""
        asm = Assembler(target.manifest)
        if self.bank is None or self.bank.cb != asm.cb:
            self.bank, self._banked = ChunkBank(asm.cb), None
        bank = self.bank
        if held is not None and not known:  # hash our own state once, not on every pass
            known.update({name: digests_of(t, asm.cb) for name, t in held.tensors.items()})
        if held is not None and held is not self._banked:
            bank.record_state(held, known)
            self._banked = held
        reused = asm.reuse(held, known)
        if not self.fetched_once:  # later passes reuse what we fetched, not what we had
            self.result.reused_bytes, self.fetched_once = reused, True
        bank.fill(asm)
        jobs = bank.plan(asm, self.cfg.replay_rounds, self.meter.rate(),
                         self.results_seen.rounds_per_second() / len(target.manifest.rounds)) \
            if self.replayer else []
        derived = {asm.digest_at(name, i) for job in jobs for name, i in job.used}
        needed = [d for d in fetch_order(target.manifest, asm.needed()) if d not in derived]
        # Results first: servers drop the oldest as rounds land, the chunks stay.
        results = list(dict.fromkeys(d for job in jobs for d in job.wants(bank)))
        wanted = frozenset(results)
        self.planned = len(needed) + len(results)
        log.info("state sync: fetching %d chunk(s) of the state at step %d and %d chunk(s) "
                 "of round results, %d chunk(s) to derive by replaying rounds", len(needed),
                 target.step, len(results), len(derived))

        def put(digest: bytes, payload: bytes | memoryview) -> None:
            if asm.positions(digest):
                asm.put(digest, payload)
                bank.record_fetched(asm, digest, payload)

        arrived = asyncio.Event()

        def sink(digest: bytes, payload: bytes | memoryview) -> None:
            if digest in wanted:
                bank.put_result(digest, payload)
                arrived.set()
            put(digest, payload)

        sources = {p: m.tensor_digests() | {d for r in m.replays for d in r.chunks}
                   for p, m in manifests.items()}
        replaying = _ReplayAhead(jobs, bank, asm, self.replayer, arrived)
        try:
            if await self._transfer(target, manifests,
                                    FetchPlan(results + needed, sources, asm.cb), sink):
                return None
        finally:
            await replaying.stop()
        for job in jobs:  # the rounds left, and hashing: off the network loop
            assert self.replayer is not None  # no jobs are planned without one
            filled, why = await asyncio.to_thread(job.run, bank, asm, self.replayer)
            self.result.replayed += bool(filled)
            log.info("state sync: fragment %d: replayed rounds %d-%d (%d bytes of results; "
                     "%d after the transfer) on %d chunk(s) held: %d bytes not fetched%s",
                     job.fragment, job.start, job.rounds[-1].round, job.result_bytes,
                     job.late, len(job.used), filled,
                     f"; fetching the rest: {why}" if why else "")
        if asm.needed():  # what the plan could not fetch, or a replay that failed
            sources = {p: m.tensor_digests() for p, m in manifests.items() if p in self.addrs}
            plan = FetchPlan(fetch_order(target.manifest, asm.needed()), sources, asm.cb)
            if await self._transfer(target, manifests, plan, put):
                return None
            if not plan.complete:
                raise RecoveryError(f"state sync: {plan.missing} chunks of the state at step "
                                    f"{target.step} could not be fetched from any live peer")
        return asm.state()

    async def _transfer(self, target: Target, manifests: dict[str, Manifest],
                        plan: FetchPlan,
                        sink: Callable[[bytes, bytes | memoryview], None]) -> bool:
        """Run `plan` over the peers, handing each verified chunk to `sink`; True when the
        peers moved on to a newer state meanwhile (the fetch was cut short)."""
        changed, stop = asyncio.Event(), asyncio.Event()
        watches = [asyncio.create_task(self._watch_end(plan, target.manifest.chunk_bytes)),
                   asyncio.create_task(self._watch_link()),
                   asyncio.create_task(self._watch_newer(target, dict(manifests), stop,
                                                         changed))]
        try:
            await asyncio.gather(*(self._pull(p, plan, sink, changed, stop)
                                   for p in list(plan.sources)))
        finally:
            for task in watches:
                task.cancel()
            await asyncio.gather(*watches, return_exceptions=True)
            self._close_watch()  # a poll cut short leaves its reply on the wire: reconnect
        for peer, n in plan.fetched_from.items():
            self.result.sources[peer] = self.result.sources.get(peer, 0) + n
            self.result.fetched_bytes += n
        return not plan.complete and stop.is_set()

    async def _watch_link(self) -> None:
        """Report the rate chunks arrived at (`on_link`) from `_LINK_FROM_S` after the first
        reply (before: the request window's ramp) to `_LINK_AFTER_S`, over every transfer
        of this recovery (a slow joiner's passes end every few seconds as rounds land)."""
        meter = self.meter
        while self.on_link is not None:
            await asyncio.sleep(0.25)
            now = time.perf_counter()
            if meter.first is None or now - meter.first < _LINK_FROM_S:
                continue
            if self._link_mark is None:
                self._link_mark = (now, meter.received)
            elif now - meter.first >= _LINK_AFTER_S and self.results_seen.sizes:
                t0, got0 = self._link_mark
                hook, self.on_link = self.on_link, None
                hook((meter.received - got0) / (now - t0), dict(self.results_seen.sizes),
                     len(self.addrs) + 1)

    async def _watch_end(self, plan: FetchPlan, chunk_bytes: int) -> None:
        """Call `near_end` once the chunks still missing should arrive within `lead` s at
        the rate seen so far, less the rate at which the rounds' results appear: a joiner
        whose link is not much faster than that has more passes to go after this one."""
        t0 = time.perf_counter()
        while self.near_end is not None:
            await asyncio.sleep(0.1)
            done, elapsed = sum(plan.fetched_from.values()), time.perf_counter() - t0
            if done and elapsed >= RATE_TRUSTED_AFTER_S and \
                    catch_up_seconds(plan.missing * chunk_bytes, done / elapsed,
                                     self.results_seen.rate()) <= self.lead:
                hook, self.near_end = self.near_end, None
                hook()

    async def _pull(self, peer: str, plan: FetchPlan,
                    sink: Callable[[bytes, bytes | memoryview], None],
                    changed: asyncio.Event, stop: asyncio.Event) -> None:
        """Fetch chunks from `peer` until none is left for it, or until `stop` (then the
        requests in flight are still answered and kept)."""
        conn, outstanding = self.conns.get(peer), deque[bytes]()
        if conn is None:
            plan.drop(peer)
            return
        while not plan.complete:
            while not stop.is_set() and len(outstanding) < self.meter.window(
                    plan.chunk_bytes, len(plan.sources), self.cfg.window) and \
                    (d := plan.next_for(peer)):
                conn.send(ChunkRequest(digest=d))
                outstanding.append(d)
            if not outstanding:
                if plan.stuck() or stop.is_set():
                    return
                changed.clear()  # nothing for us now; wake when a dropped peer's work returns
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), self.cfg.request_timeout)
                continue
            try:
                msg = await conn.recv()
                d = outstanding.popleft()
                self.meter.add(len(msg.payload) if isinstance(msg, Chunk) else 0)
                if isinstance(msg, Error):
                    plan.failed(peer, d)
                elif isinstance(msg, Chunk) and msg.digest == d:
                    plan.delivered(peer, d, msg.payload)
                    sink(d, msg.payload)
                else:
                    raise RemoteProtocolError(f"state sync: answered {msg.type} for chunk?")
            except (OSError, TimeoutError, asyncio.IncompleteReadError,
                    RemoteProtocolError) as exc:
                plan.drop(peer)
                self._drop(peer, _why(exc), isinstance(exc, HandshakeError))
                changed.set()
                return
            changed.set()

    def _close_watch(self) -> None:
        for link in self.watch.values():
            if link is not None:
                link.close()
        self.watch.clear()

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()
        self._close_watch()


async def recover(peers: dict[str, str], local: WorkerState | None, run_id: str,
                  config_digest: str, cfg: StateSyncConfig, min_rounds: int = -1,
                  before_final: Callable[[], Awaitable[int | None]] | None = None, *,
                  auth: Credentials | None = None, peer_id: str | None = None,
                  final_lead: float = 0.0, own_candidate: bool = False,
                  wait_behind: float = 0.0, wait_from_step: int = 0,
                  replayer: Replayer | None = None,
                  prefer: Collection[str] = (), opener: StreamOpener | None = None,
                  streamed: Collection[str] = (),
                  floor_patience: float = math.inf,
                  on_link: LinkHook | None = None) -> Recovery | None:
    """Fetch the swarm's current outer state from `peers` (peer id -> state address).

    Each connection proves that the peer id it was looked up under answers, and proves us
    to it, under `auth` (our credentials; None: trust mode with the made-up `peer_id`).

    `local` is the state we hold (fresh or from a checkpoint): its chunks are never fetched.
    `before_final` runs once the fetched state is current (or after `cfg.max_passes` fetches
    that did not close in on it): the node publishes its record there and waits until peers
    see it. Rounds the peers start after that wait expect us; rounds started before it may
    not, so the state adopted must include all of them: we re-read manifests until its step
    is at least the `current_step` the peers report in the first manifests after the wait
    (their step, leaving out rounds in flight that count us: we take part in those, and
    waiting for them to land would make us and them wait on each other), and at least the
    step `before_final` returns, if any (a record naming our first round: every round
    before it). With `final_lead` >
    0, `before_final` starts that many seconds before a fetch is expected to end (the keeper
    passes its wait, so waiting overlaps the end of the transfer instead of following it and
    one more manifest pass); should that state turn out not to be current, the next fetch
    comes after publishing, as after `cfg.max_passes`.
    Returns None when no peer serves a state with more than `min_rounds` rounds landed
    (summed over fragments); raises `RecoveryError` when peers are ahead but the state
    could not be completed. The caller bounds the whole call (statesync.recover_timeout);
    every request has its own timeout.

    `own_candidate` (a re-sync after a lone round): `local` competes in the choice as our
    own peer's state, and if it wins nothing is fetched. Peers that diverged in the same
    round then all pick the same state, instead of each adopting another's. `wait_behind`:
    for up to that many seconds, while the state the peers hold has no more than
    `min_rounds` rounds but one of them has trained to `wait_from_step` (the start of the
    round we went through alone), read their manifests again instead of returning None:
    that peer is most likely still landing the same round. A peer that is merely slower
    has not reached that step and is not waited for.

    `replayer` (the run's outer step: `algo.replay.replay_round`): chunks that rounds
    changed after we fetched them are brought forward by replaying those rounds' results
    when that is cheaper (`_Client.fetch`, `bank.py`); None: they are fetched again.

    `prefer` (a node left out of a round for holding another state than its group's):
    only the manifests of these peers are considered while any of them answers.

    `streamed`: peers behind a NAT, reached through `opener` (peer id -> a libp2p stream to
    its state server, `dilonode.swarm.tunnel`) instead of a dial of their address.

    `floor_patience`: how long (s) the state held may stay below the peers' step before it
    is taken anyway. A round that may exclude us lands within a round's time; a peer whose
    state does not move for longer is not landing one (it may itself be blocked, adopting
    a state), and waiting on it would make two nodes wait on each other. Chains catch a
    round missed this way at the next round.

    `on_link`: called once, `_LINK_AFTER_S` after the first chunk arrived, with the rate
    chunks arrived at since `_LINK_FROM_S` (bytes/s: our link, unless the peers serve
    slower), the round results' bytes per fragment the manifests list, and the number of
    peers counting us: what the node needs to ask the swarm's clock for rounds its link
    can carry before it takes part (`pacing.link_busy_seconds`).
    """
    t0 = time.perf_counter()
    me = own_peer_id(auth, peer_id)
    client = _Client(peers, run_id, config_digest, cfg, auth, me, opener, streamed)
    client.replayer, client.on_link = replayer, on_link
    own = ({me: await asyncio.to_thread(manifest_of, local, run_id, config_digest,
                                        cfg.chunk_bytes)}  # hashes the whole state
           if own_candidate and local is not None else {})
    passes = _Passes(client, cfg, me, own, local, min_rounds, before_final, wait_behind,
                     wait_from_step, tuple(prefer), floor_patience, t0)
    if before_final is not None and final_lead > 0:
        client.near_end, client.lead = passes.start_final, final_lead
    try:
        while await passes.next():
            pass
    finally:
        passes.close()
    return passes.outcome()


class _ReplayAhead:
    """Replays each planned round as soon as its result is held, while the transfer goes on
    (`Derivation.advance`, one round at a time in a worker thread), so that the fetch ends
    with only the last rounds to replay: peers wait for a joiner from the moment it
    publishes its record, which is before its transfer ends."""

    def __init__(self, jobs: list[Derivation], bank: ChunkBank, asm: Assembler,
                 replayer: Replayer | None, arrived: asyncio.Event) -> None:
        self.jobs, self.bank, self.asm, self.replayer = jobs, bank, asm, replayer
        self.arrived, self.done = arrived, False
        self.task = asyncio.ensure_future(self._run()) if jobs and replayer else None

    async def _run(self) -> None:
        assert self.replayer is not None
        while not self.done:
            ready = [job for job in self.jobs if job.ready(self.bank)]
            if not ready:
                self.arrived.clear()
                await self.arrived.wait()
                continue
            for job in ready:
                await asyncio.to_thread(job.advance, self.bank, self.asm, self.replayer)

    async def stop(self) -> None:
        """Let the round being replayed finish (its thread cannot be stopped: what it
        writes must not race the replay that follows), then end."""
        if self.task is None:
            return
        self.done = True
        self.arrived.set()
        try:
            await asyncio.shield(self.task)
        except asyncio.CancelledError:
            self.task.cancel()
            raise


@dataclass
class _Passes:
    """One `recover` call's passes and what they carry from one to the next. Each pass
    reads the manifests and picks the state to take (`_read`); stops when there is none
    newer than ours (`_nothing_newer`); when the state held is current, publishes our
    record once and keeps it unless a round that may exclude us is landing (`_settle`);
    otherwise fetches what changed (`_fetch`)."""

    client: _Client
    cfg: StateSyncConfig
    me: str
    own: dict[str, Manifest]  # our own state's manifest when it competes (own_candidate)
    held: WorkerState | None  # the state we hold: `local`, then each fetched one
    min_rounds: int
    before_final: Callable[[], Awaitable[int | None]] | None  # None once it has run
    wait_behind: float
    wait_from_step: int
    prefer: tuple[str, ...]
    floor_patience: float
    t0: float = field(default_factory=time.perf_counter)
    known: dict[str, list[bytes]] = field(default_factory=dict)  # chunk digests of `held`
    held_target: Target | None = None  # the state `held` is, with its freshest step
    floor: int | None = None  # after publishing: rounds started by then may exclude us
    fetches: int = 0  # fetches that made no headway (see `_fetch`)
    last_planned: float = math.inf  # chunks the last fetch planned
    failures: int = 0
    published: bool = False
    below_floor_since: float | None = None  # when the held state was first below `floor`
    final: asyncio.Future[int | None] | None = None  # before_final, started during a fetch
    first_floor: int | None = None  # what before_final returned: the step our first round needs

    async def next(self) -> bool:
        """One pass; False when the state held is the one to keep (or none is newer)."""
        manifests = await self._read()
        if not manifests and self.client.busy:
            await asyncio.sleep(_RETRY_S)  # a trainer is mid-step; ask again
            return True
        target = choose_target({**manifests, **self.own} if self.held_target is None
                               else manifests)
        if target is None or (self.held_target is None and
                              sum(target.manifest.rounds) <= self.min_rounds):
            return await self._nothing_newer(target, manifests)
        if self.me in target.supporters and self.held_target is None:
            return False  # our own state is the one the others pick too: keep it
        if self.floor is None and self.published and self.before_final is None:
            self.floor = max([m.current_step for m in manifests.values()]
                             + ([] if self.first_floor is None else [self.first_floor]))
        current = self.held_target is not None and \
            target.manifest.content_key() == self.held_target.manifest.content_key()
        if current or (self.before_final is not None and self.fetches >= self.cfg.max_passes):
            return await self._settle(target, current)
        return await self._fetch(target, manifests)

    async def _read(self) -> dict[str, Manifest]:
        client = self.client
        client.result.passes += 1
        t_pass = time.perf_counter()
        watched = client.newer is not None
        manifests, client.newer = client.newer or await client.manifests(), None
        if self.prefer and (chosen := {p: m for p, m in manifests.items()
                                       if p in self.prefer}):
            manifests = chosen
        client.result.manifest_seconds += time.perf_counter() - t_pass
        log.info("state sync: pass %d: %d manifest(s)%s in %.2f s, %.2f s since start",
                 client.result.passes, len(manifests), " (read while fetching)"
                 if watched else "", time.perf_counter() - t_pass,
                 time.perf_counter() - self.t0)
        return manifests

    async def _nothing_newer(self, target: Target | None,
                             manifests: dict[str, Manifest]) -> bool:
        """No state to take: stop, unless a peer has trained to the round we went through
        alone (`wait_from_step`) and is most likely still landing it."""
        if (target is not None and time.perf_counter() - self.t0 < self.wait_behind
                and any(m.current_step >= self.wait_from_step for m in manifests.values())):
            await asyncio.sleep(_RETRY_S)  # their round is still landing
            return True
        return False

    async def _settle(self, target: Target, current: bool) -> bool:
        """The state held is current (or `max_passes` fetches made no headway): publish
        our record and wait once; then keep the state unless it is below the peers' step
        (`floor`), where a round that may exclude us is landing, for no longer than
        `floor_patience`."""
        if current:
            self.held_target = target  # same content, fresher step
        if self.before_final is not None:
            await self._published(self.final if self.final is not None
                                  else self.before_final())
            return True
        if self.floor is None or target.step >= self.floor:
            return False
        now = time.perf_counter()
        self.below_floor_since = self.below_floor_since or now
        if now - self.below_floor_since >= self.floor_patience:
            log.info("state sync: the peers' state stayed at step %d, below their step %d, "
                     "for %.1f s: no round is landing; taking it",
                     target.step, self.floor, now - self.below_floor_since)
            return False
        await asyncio.sleep(_RETRY_S)  # a round that may exclude us is landing
        return True

    async def _fetch(self, target: Target, manifests: dict[str, Manifest]) -> bool:
        t_fetch = time.perf_counter()
        try:
            got = await self.client.fetch(target, manifests, self.held, self.known)
        except RecoveryError as exc:  # e.g. every peer holding a chunk moved on: re-read
            self.failures += 1
            if self.failures >= _MAX_FAILED_FETCHES or not self.client.addrs:
                raise
            log.warning("%s; asking for manifests again", exc)
            return True
        finally:
            self.client.result.fetch_seconds += time.perf_counter() - t_fetch
        # A fetch counts toward max_passes when it did not close in on the state: it
        # planned no fewer chunks than the one before (what each fetched stays in the
        # bank, so a fetch cut short by a round still counts as headway).
        self.fetches += self.client.planned >= self.last_planned
        self.last_planned = self.client.planned
        if got is None:  # a round landed mid-fetch: go on with the newer state
            return True
        self.held, self.held_target, self.below_floor_since = got, target, None
        self.known = {t.name: list(t.chunks) for t in target.manifest.tensors}
        if self.final is not None and self.before_final is not None:
            await self._published(self.final)  # published near the end of this fetch
        return True

    def start_final(self) -> None:
        """Publish our record while the last fetch ends (the client's near-end hook)."""
        if self.final is None and self.before_final is not None:
            self.final = asyncio.ensure_future(self._publish_and_wait(self.before_final))

    @staticmethod
    async def _publish_and_wait(before_final: Callable[[], Awaitable[int | None]]
                                ) -> int | None:
        t_pub = time.perf_counter()
        got = await before_final()
        log.info("state sync: published our record and waited %.2f s",
                 time.perf_counter() - t_pub)
        return got

    async def _published(self, waiting: Awaitable[int | None]) -> None:
        t_wait = time.perf_counter()
        self.first_floor = await waiting
        self.client.result.publish_wait_seconds += time.perf_counter() - t_wait
        self.before_final, self.published, self.client.near_end = None, True, None

    def close(self) -> None:
        if self.final is not None and not self.final.done():
            self.final.cancel()
        self.client.close()

    def outcome(self) -> Recovery | None:
        if self.held_target is None or self.held is None:
            return None
        result = self.client.result
        self.held.step = self.held_target.step
        result.state, result.agreed_by = self.held, self.held_target.supporters
        result.seconds = time.perf_counter() - self.t0
        return result
