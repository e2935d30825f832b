"""Drives sans-IO all-reduce rounds over a `DataPlane`, retries failed rounds, and offers the
result to the trainer as a `dilonode.collective.Collective`.

Three layers, each usable alone:

* `run_round(plane, spec, my_index, local, peers, timeout)` runs one `AllReduceRound`:
  it starts the round, feeds it what the plane delivers, ticks it at least every
  `TICK_SECONDS`, performs its `Send`s and returns a `RoundOutcome` as soon as the round
  ends, by its deadline whatever the peers do. Round calls (encode, decode, reduce,
  digests) run in a worker thread by default (`offload=True`): they release the GIL in
  numpy/torch/hashlib, so the event loop keeps reading and writing sockets meanwhile.
  Measured with benchmarks/allreduce.py (4 processes, 10M values, 2 shared cores): round
  time is the same within noise either way (the box is CPU-bound), but the worst
  event-loop stall drops from 125-210 ms inline to 20-46 ms offloaded, so heartbeats, DHT
  traffic and other rounds keep running. Keep the process's torch threads at 1 (or few):
  oversubscribed intra-op threads on shared cores made small tensor ops up to 50x slower.
* `SwarmRounds.reduce(fragment, round, local)` is the retry policy: it asks the injected
  `form_group(fragment, round, attempt, exclude)` for a group, runs the round, and on
  failure retries with attempt+1, excluding every peer the failures blamed, up to
  `max_attempts`. If no attempt succeeds it returns the node's own quantized value
  (`decode(encode(local))`) as a group of one, flagged `skipped`; never a partial average.
  In a grouped swarm (the group is `mixing`, `algo/groups.py`) a round that
  `algo.groups.mixes` picks is followed, in the same group, by a *state round*: the
  members' packed outer states (`algo/mixing.py`) averaged in float32 under wire fragment
  `STATE_WIRE | fragment`. A state round that fails leaves the pseudo-gradient round as it
  is (the node steps its own state); `reduce(mix_only=True)` runs state rounds alone.
* `NetworkCollective` runs a plane and `SwarmRounds` on an event loop in a background thread
  (uvloop when installed) and implements `Collective.begin(key, flat)`; the training thread
  blocks only in `PendingReduce.wait()`.

All protocol decisions stay in `AllReduceRound`; this module moves events and actions
between it and the plane and keeps time with the injectable `clock`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import torch

from dilonode.algo.butterfly import CHUNKING, round_chunk_numel
from dilonode.algo.groups import mixes
from dilonode.algo.replay import EncodedResult
from dilonode.algo.robust import AggregatorSpec, BanTracker
from dilonode.algo.spliced import SplicedEncoding
from dilonode.allreduce.round import (
    Action,
    AllReduceRound,
    Failed,
    GroupSpec,
    RoundFailure,
    RoundState,
    Send,
    group_digest,
)
from dilonode.allreduce.transport import DataPlane, Inbox, PeerEvent
from dilonode.collective import ReduceResult, StateSource, SyncKey
from dilonode.config import DEFAULT_CHUNK_NUMEL
from dilonode.wire.errors import one_line
from dilonode.wire.messages import Abort

__all__ = [
    "GRAD_FRAGMENT",
    "STATE_WIRE",
    "TICK_SECONDS",
    "FormGroup",
    "FormedGroup",
    "LoopThread",
    "NetworkCollective",
    "RoundOutcome",
    "RoundPolicy",
    "SwarmOutcome",
    "SwarmRounds",
    "run_round",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

TICK_SECONDS = 0.1
GRAD_FRAGMENT = 2**32 - 1  # wire fragment index used for SyncKey(kind="grad", ...)
STATE_WIRE = 1 << 31  # wire fragment of a fragment's state round: STATE_WIRE | fragment


@dataclass(frozen=True)
class RoundOutcome:
    """How one round ended for this node; `result`/`digest` only when DONE."""

    state: RoundState
    result: torch.Tensor | None
    digest: str | None
    failure: RoundFailure | None
    bytes_sent: int
    bytes_received: int
    payload_bytes_sent: int
    payload_bytes_received: int
    duration: float
    members: tuple[str, ...] = ()
    attempt: int = 0
    skipped: bool = False
    rejected: tuple[str, ...] = ()  # peers an owner left out of some chunk (robust checks)
    convicted: tuple[str, ...] = ()  # peers a majority of owners left out: counts to bans
    encoded: EncodedResult | None = None  # the result as carried (`keep_encoded` rounds)

    @property
    def excluded_peers(self) -> tuple[str, ...]:
        """Peer ids of `failure.exclude` (empty unless FAILED)."""
        if self.failure is None:
            return ()
        return tuple(self.members[i] for i in self.failure.exclude)


async def run_round(plane: DataPlane, spec: GroupSpec, my_index: int, local: torch.Tensor,
                    peers: Mapping[int, str], timeout: float,
                    clock: Callable[[], float] = time.monotonic, *,
                    offload: bool = True,
                    aggregator: AggregatorSpec | None = None,
                    out: torch.Tensor | None = None,
                    keep_encoded: bool = False, weight: float = 1.0,
                    encoded: SplicedEncoding | None = None) -> RoundOutcome:
    """Run this node's side of one round; `peers` maps member index -> "host:port".

    Returns as soon as the round is DONE or FAILED, by `clock() >= start + timeout` (plus
    one batch of round work) at the latest; frames still queued then are written by the
    plane in the background (`DataPlane.aclose` flushes them). `local` must not be
    modified in place, ever: float32 contributions are sent as views of it, and after a
    failed round a frame may still be on its way out (`NetworkCollective` hands every
    round a tensor of its own). `out` and `keep_encoded` are handed to `AllReduceRound`
    (the result buffer; keep the encoded result for `RoundOutcome.encoded`), and so is
    `weight` (the tokens `local` was trained on, which weight it in the mean), and
    `encoded` (`local` as a node's ranks encoded it, slice by slice).
    """
    missing = [i for i in range(spec.size) if i != my_index and i not in peers]
    if missing:
        raise ValueError(f"run_round: no address for member(s) {missing}")
    rnd = AllReduceRound(spec, my_index, local, timeout=timeout, aggregator=aggregator,
                         out=out, keep_encoded=keep_encoded, weight=weight,
                         encoded=encoded)
    key = (spec.fragment, spec.round, spec.attempt)
    inbox = plane.register(key, spec.members)
    try:
        return await _RoundDriver(plane, rnd, peers, inbox, clock, offload).run()
    finally:
        plane.unregister(key)


class _RoundDriver:
    """The loop of `run_round`: one round, its inbox and the futures of its sends."""

    def __init__(self, plane: DataPlane, rnd: AllReduceRound, peers: Mapping[int, str],
                 inbox: Inbox, clock: Callable[[], float], offload: bool) -> None:
        self.plane = plane
        self.rnd = rnd
        self.peers = peers
        self.inbox = inbox
        self.clock = clock
        self.offload = offload
        self.index = {pid: i for i, pid in enumerate(rnd.spec.members)}
        self.sends: list[tuple[asyncio.Future[None], bool]] = []  # (future, is_abort)

    async def run(self) -> RoundOutcome:
        t0 = self.clock()
        self._apply(await self._call(self.rnd.start, t0))
        while self.rnd.state is RoundState.RUNNING:
            wait = min(TICK_SECONDS, max(0.0, self._deadline() - self.clock()))
            events = await self.inbox.get_batch(wait)
            self._apply(await self._call(self._feed, events))
        self._settle()
        return self._outcome(t0)

    def _deadline(self) -> float:
        assert self.rnd.deadline is not None
        return self.rnd.deadline

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        if not self.offload:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    def _feed(self, events: list[PeerEvent]) -> list[Action]:
        """Hand events to the round (in a worker thread when offloading)."""
        rnd, actions = self.rnd, []
        for ev in events:
            if rnd.state is not RoundState.RUNNING:
                break
            member, now = self.index[ev.peer_id], self.clock()
            if ev.kind == "message":
                assert ev.msg is not None
                actions += rnd.receive(member, ev.msg, now, frame_bytes=ev.frame_bytes)
            elif ev.kind == "error":
                actions += rnd.peer_error(member, ev.reason, now)
            else:
                actions += rnd.peer_gone(member, ev.reason, now)
        return actions + rnd.tick(self.clock())

    def _apply(self, actions: list[Action]) -> None:
        for action in actions:
            if not isinstance(action, Send):
                continue
            peer_id = self.rnd.spec.members[action.to]
            fut = self.plane.send(peer_id, self.peers[action.to], action.frame)
            fut.add_done_callback(functools.partial(self._sent, peer_id))
            self.sends.append((fut, isinstance(action.msg, Abort)))

    def _sent(self, peer_id: str, fut: asyncio.Future[None]) -> None:
        if fut.cancelled() or fut.exception() is None:
            return
        if self.rnd.state is RoundState.RUNNING:
            self.inbox.put(PeerEvent(peer_id, "gone", reason=f"send failed: {fut.exception()}"))

    def _settle(self) -> None:
        """Frames still queued keep going out after we return (the plane owns them), except
        a failed round's contributions and results: useless now, and skipping them lets its
        aborts go out first."""
        if self.rnd.state is RoundState.FAILED:
            for fut, is_abort in self.sends:
                if not is_abort:
                    fut.cancel()

    def _outcome(self, t0: float) -> RoundOutcome:
        rnd = self.rnd
        done = rnd.state is RoundState.DONE
        return RoundOutcome(
            state=rnd.state, result=rnd.result if done else None,
            digest=rnd.digest if done else None, failure=None if done else rnd.failure,
            bytes_sent=rnd.bytes_sent, bytes_received=rnd.bytes_received,
            payload_bytes_sent=rnd.payload_bytes_sent,
            payload_bytes_received=rnd.payload_bytes_received,
            duration=self.clock() - t0, members=rnd.spec.members, attempt=rnd.spec.attempt,
            rejected=tuple(rnd.spec.members[i] for i in rnd.rejected),
            convicted=tuple(rnd.spec.members[i] for i in rnd.convicted),
            encoded=rnd.encoded if done else None)


# ---------------------------------------------------------------------- retry policy


class FormedGroup(NamedTuple):
    """A group agreed for one attempt: what `form_group` returns.

    `addrs` maps peer id -> "host:port" (a sequence aligned with `members` also works);
    `digest` is `group_digest(members)` or whatever the matchmaker agreed on.
    """

    members: Sequence[str]
    addrs: Mapping[str, str] | Sequence[str]
    weights: Sequence[float]
    my_index: int
    digest: str
    # Left out for an outer state that differs from the one that stands: its holders.
    diverged: tuple[str, ...] = ()
    # Peers we left out for an outer state that differs from ours (ours stands).
    outvoted: tuple[str, ...] = ()
    # A group of a grouped swarm: mixing rounds also average the members' outer states.
    mixing: bool = False
    # Peers expected when the round started that are not in the group (dead, or late past
    # the window): forming it waited on them, so its time says nothing of the links.
    missing: tuple[str, ...] = ()


FormGroup = Callable[[int, int, int, set[str]], FormedGroup | Awaitable[FormedGroup]]


@dataclass(frozen=True)
class RoundPolicy:
    """How rounds are run: codec, chunking, per-attempt timeout, the number of attempts and
    how owners check and combine contributions (the same for every member of a run)."""

    codec: str = "int4"
    block_size: int = 64
    # Values per frame, as `NetworkConfig.chunk_numel` (its description has the figures).
    chunk_numel: int = DEFAULT_CHUNK_NUMEL
    timeout: float = 30.0
    max_attempts: int = 3
    aggregator: AggregatorSpec = AggregatorSpec()
    # Bounded groups: the most peers per group, and which rounds mix states (every n-th).
    max_group_size: int = 16
    mix_every: int = 1

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or not self.timeout > 0:
            raise ValueError(f"RoundPolicy: max_attempts={self.max_attempts}, "
                             f"timeout={self.timeout}: need >= 1 and > 0")

    def round_chunk(self, numel: int, members: int) -> int:
        """The chunk size of a round (`butterfly.round_chunk_numel`, capped by ours)."""
        return round_chunk_numel(numel, members, self.chunk_numel, self.block_size)

    def settings(self) -> dict[str, str | int | float]:
        """What every member of a group must share, as matchmaking compares it: the codec
        and chunking (the wire layout) and how owners check and combine contributions."""
        agg = self.aggregator
        return {"codec": self.codec, "block_size": self.block_size,
                "chunk_numel": self.chunk_numel, "chunking": CHUNKING,
                "aggregator": agg.name,
                "norm_bound": agg.norm_bound, "trim": agg.trim, "clip_tau": agg.clip_tau,
                "clip_iters": agg.clip_iters, "max_weight_ratio": agg.max_weight_ratio,
                "max_group_size": self.max_group_size, "mix_state_every": self.mix_every}


@dataclass(frozen=True)
class SwarmOutcome:
    """The final outcome (DONE, or a skipped group of one) and how we got there."""

    outcome: RoundOutcome
    attempts: tuple[RoundOutcome, ...]
    excluded: Mapping[str, str] = field(default_factory=dict)  # peer id -> reason
    errors: tuple[str, ...] = ()  # one line per failed attempt
    diverged: tuple[str, ...] = ()  # see FormedGroup (the last group formed)
    outvoted: tuple[str, ...] = ()
    grouped: bool = False  # the group was one of a grouped swarm (FormedGroup.mixing)
    state: RoundOutcome | None = None  # the state round that followed, when DONE
    # What the swarm's clock may pace rounds by (ReduceResult.pace_s); None: nothing.
    pace_s: float | None = None

    @property
    def skipped(self) -> bool:
        return self.outcome.skipped


class SwarmRounds:
    """Runs (fragment, round) reductions with retries; see the module docstring."""

    def __init__(self, plane: DataPlane, form_group: FormGroup,
                 policy: RoundPolicy | None = None, *,
                 clock: Callable[[], float] = time.monotonic, offload: bool = True,
                 bans: BanTracker | None = None, keep_encoded: bool = False) -> None:
        self.plane = plane
        self.keep_encoded = keep_encoded  # see RoundOutcome.encoded
        self.form_group = form_group
        self.policy = policy or RoundPolicy()
        self.clock = clock
        self.offload = offload
        # Peers rejected in too many rounds are left out of matchmaking (the `exclude` set
        # every FormGroup honours) until their ban ends.
        self.bans = bans

    async def reduce(self, fragment: int, round_no: int, local: torch.Tensor,
                     out: torch.Tensor | None = None, weight: float = 1.0,
                     encoded: SplicedEncoding | None = None,
                     state: StateSource | None = None,
                     mix_only: bool = False) -> SwarmOutcome:
        """Average `local` (1-D float32, trained on `weight` tokens) with a group, retrying
        without the culprits. `out` (optional) receives a completed round's result (every
        attempt writes there). `state` (called on a worker thread, only when a grouped
        round mixes) gives our packed outer state for the state round; `mix_only`: `local`
        is such a state and the round averages it alone (float32, plain mean)."""
        excluded: dict[str, str] = {}
        attempts: list[RoundOutcome] = []
        errors: list[str] = []
        for attempt in range(self.policy.max_attempts):
            t_attempt = self.clock()
            try:
                spec, my_index, peers, formed = await self._prepare(fragment, round_no,
                                                                    attempt, set(excluded),
                                                                    local, mix_only)
            except Exception as exc:  # a matchmaking failure must not kill the daemon
                errors.append(one_line(f"attempt {attempt}: no group: {exc}"))
                log.warning("fragment %d round %d: %s", fragment, round_no, errors[-1])
                # A leader that never closed its group is left out of the next attempt.
                blame = getattr(exc, "blame", None)
                if isinstance(blame, str) and blame != self.plane.peer_id:
                    excluded.setdefault(blame, one_line(str(exc)))
                continue
            got = await run_round(self.plane, spec, my_index, local, peers,
                                  self.policy.timeout, self.clock, offload=self.offload,
                                  aggregator=None if mix_only else self.policy.aggregator,
                                  out=out, keep_encoded=self.keep_encoded and not mix_only,
                                  weight=1.0 if mix_only else weight,
                                  encoded=None if mix_only else encoded)
            attempts.append(got)
            if got.state is RoundState.DONE:
                self._note_rejected(fragment, round_no, got.rejected, got.convicted)
                mixed = None
                if (formed.mixing and state is not None and not mix_only and spec.size > 1
                        and mixes(round_no, self.policy.mix_every)):
                    mixed = await self._state_round(spec, my_index, peers, state)
                # Only a whole group's attempt paces the clock (`SwarmOutcome.pace_s`).
                pace = None if formed.missing else self.clock() - t_attempt
                return SwarmOutcome(got, tuple(attempts), excluded, tuple(errors),
                                    tuple(formed.diverged), tuple(formed.outvoted),
                                    grouped=formed.mixing, state=mixed, pace_s=pace)
            assert got.failure is not None
            errors.append(one_line(f"attempt {attempt}: {got.failure.reason}"))
            log.warning("fragment %d round %d: %s", fragment, round_no, errors[-1])
            for peer_id in got.excluded_peers:
                if peer_id != self.plane.peer_id:
                    excluded.setdefault(peer_id, got.failure.reason)
        alone = self._alone(fragment, round_no, self.policy.max_attempts, local, mix_only)
        return SwarmOutcome(alone, tuple(attempts), excluded, tuple(errors))

    async def _state_round(self, spec: GroupSpec, my_index: int, peers: dict[int, str],
                           state: StateSource) -> RoundOutcome | None:
        """The state round after a grouped pseudo-gradient round, in the same group; None
        (no mixing for us this round) if it fails."""
        flat = await asyncio.to_thread(state)  # a copy: [2 * numel] float32
        sspec = dataclasses.replace(spec, fragment=STATE_WIRE | spec.fragment,
                                    numel=flat.numel(), codec="float32")
        got = await run_round(self.plane, sspec, my_index, flat, peers, self.policy.timeout,
                              self.clock, offload=self.offload)
        if got.state is RoundState.DONE:
            return got
        reason = got.failure.reason if got.failure else "?"
        log.warning("fragment %d round %d: state round failed (%s); stepping our own state",
                    spec.fragment, spec.round, one_line(reason))
        return None

    def _note_rejected(self, fragment: int, round_no: int, rejected: Sequence[str],
                       convicted: Sequence[str]) -> None:
        others = [p for p in rejected if p != self.plane.peer_id]
        if not others:
            return
        log.warning("fragment %d round %d: contributions rejected from %s (by a majority of "
                    "owners: %s)", fragment, round_no, ", ".join(others),
                    ", ".join(convicted) or "none")
        if self.bans is None:
            return
        now = self.clock()
        for peer in convicted:
            if peer == self.plane.peer_id:
                continue
            if self.bans.record(peer, now):
                log.warning("peer %s banned for %gs: rejected in %d rounds within %gs", peer,
                            self.bans.ban_seconds, self.bans.max_rejections,
                            self.bans.window)

    async def _prepare(self, fragment: int, round_no: int, attempt: int, exclude: set[str],
                       local: torch.Tensor, mix_only: bool = False
                       ) -> tuple[GroupSpec, int, dict[int, str], FormedGroup]:
        if self.bans is not None:
            exclude = exclude | (self.bans.banned(self.clock()) - {self.plane.peer_id})
        formed = self.form_group(fragment, round_no, attempt, exclude)
        group = await formed if inspect.isawaitable(formed) else formed
        members = tuple(group.members)
        p = self.policy
        spec = GroupSpec(run_id=self.plane.run_id,
                         fragment=STATE_WIRE | fragment if mix_only else fragment,
                         round=round_no, members=members, weights=tuple(group.weights),
                         numel=local.numel(), codec="float32" if mix_only else p.codec,
                         block_size=p.block_size,
                         chunk_numel=p.round_chunk(local.numel(), len(members)),
                         attempt=attempt, group_digest=group.digest)
        me = group.my_index
        if not 0 <= me < len(members) or members[me] != self.plane.peer_id:
            raise ValueError(f"group {list(members)} does not hold us "
                             f"({self.plane.peer_id!r}) at index {group.my_index}")
        addrs = group.addrs
        if not isinstance(addrs, Mapping):
            addrs = dict(zip(members, addrs, strict=True))
        peers = {i: addrs[pid] for i, pid in enumerate(members) if i != group.my_index}
        if not isinstance(group, FormedGroup):  # a bare tuple from a test's matchmaker
            group = FormedGroup(*group)
        return spec, group.my_index, peers, group

    def _alone(self, fragment: int, round_no: int, attempt: int,
               local: torch.Tensor, mix_only: bool = False) -> RoundOutcome:
        """Group of one: the node's own value, quantized like every contribution (a state
        of `mix_only` rounds travels in float32: it comes back exactly)."""
        me = (self.plane.peer_id,)
        p = self.policy
        spec = GroupSpec(run_id=self.plane.run_id, fragment=fragment, round=round_no,
                         members=me, weights=(1.0,), numel=local.numel(),
                         codec="float32" if mix_only else p.codec,
                         block_size=p.block_size, chunk_numel=p.round_chunk(local.numel(), 1),
                         attempt=min(attempt, 2**32 - 1), group_digest=group_digest(me))
        t0 = self.clock()
        rnd = AllReduceRound(spec, 0, local, timeout=p.timeout)
        actions = rnd.start(t0)
        assert not any(isinstance(a, Failed) for a in actions)
        return RoundOutcome(state=rnd.state, result=rnd.result, digest=rnd.digest,
                            failure=None, bytes_sent=0, bytes_received=0,
                            payload_bytes_sent=0, payload_bytes_received=0,
                            duration=self.clock() - t0, members=me, attempt=spec.attempt,
                            skipped=True)


# ---------------------------------------------------------------------- collective


class LoopThread:
    """An asyncio event loop (uvloop when installed and wanted) in a daemon thread."""

    def __init__(self, name: str = "dilonode-net", *, use_uvloop: bool = True) -> None:
        self.name = name
        self.use_uvloop = use_uvloop
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("LoopThread.start: already started")
        self.loop = _new_loop(self.use_uvloop)
        self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        assert self.loop is not None
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule `coro` on the loop from any other thread."""
        if self.loop is None:
            coro.close()
            raise RuntimeError("LoopThread.submit: not started")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and block the calling thread for its result."""
        return self.submit(coro).result(timeout)

    def stop(self, timeout: float = 2.0) -> None:
        """Cancel what still runs on the loop (rounds abandoned at shutdown), let it unwind
        for up to `timeout` s, then stop the loop: a task destroyed while pending would
        otherwise be logged, after the node's last words, at interpreter exit."""
        if self.loop is None or self._thread is None:
            return
        with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
            self.run(_cancel_all(), timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()
        self.loop, self._thread = None, None


async def _cancel_all() -> None:
    """Cancel every other task of the running loop and wait for them to finish."""
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _new_loop(use_uvloop: bool) -> asyncio.AbstractEventLoop:
    if use_uvloop:
        with contextlib.suppress(ImportError):
            import uvloop

            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


class _NetPending:
    """`PendingReduce` backed by a concurrent.futures.Future from the network thread."""

    def __init__(self, fut: concurrent.futures.Future[ReduceResult]) -> None:
        self._fut = fut

    def done(self) -> bool:
        return self._fut.done()

    def wait(self, timeout: float | None = None) -> ReduceResult:
        """Block until the reduction ends; TimeoutError after `timeout` seconds."""
        return self._fut.result(timeout)


class NetworkCollective:
    """`Collective` over the network: a `DataPlane` and `SwarmRounds` in a loop thread.

    `start()` brings up the thread and the plane and returns the plane's address; `close()`
    tears both down. `begin(key, flat)` copies `flat`, so the caller may reuse its buffer.
    SyncKey kind "fragment" uses its fragment index on the wire, kind "grad" the reserved
    index `GRAD_FRAGMENT`.

    `reuse_results=True`: the rounds of one fragment write their results into one buffer,
    so a result is valid only until the next `begin` of the same fragment (the trainer
    lands each round before it starts that fragment's next one). A fresh 40 MB result per
    round costs ~10,000 page faults; reusing it cut a 10M-value round's CPU by ~10%
    (docs/benchmarks.md). `keep_encoded=True`: results also carry the encoded values
    (`ReduceResult.encoded`), which the node serves to joiners.
    """

    def __init__(self, peer_id: str, run_id: str, form_group: FormGroup,
                 policy: RoundPolicy | None = None, *, host: str = "127.0.0.1", port: int = 0,
                 use_uvloop: bool = True, offload: bool = True,
                 clock: Callable[[], float] = time.monotonic,
                 plane_options: Mapping[str, Any] | None = None,
                 bans: BanTracker | None = None, reuse_results: bool = False,
                 keep_encoded: bool = False) -> None:
        self.plane = DataPlane(peer_id, run_id, host, port, **dict(plane_options or {}))
        self.reuse_results = reuse_results
        self._results: dict[int, torch.Tensor] = {}  # fragment -> its result buffer
        self._in_flight: dict[int, concurrent.futures.Future[ReduceResult]] = {}
        self.rounds = SwarmRounds(self.plane, form_group, policy, clock=clock, offload=offload,
                                  bans=bans, keep_encoded=keep_encoded)
        self.thread = LoopThread(f"dilonode-net-{peer_id}", use_uvloop=use_uvloop)

    @property
    def address(self) -> str:
        return self.plane.address

    @property
    def unauthorized_attempts(self) -> int:
        """Data-plane connections refused for failing authentication or authorization
        (credentials go in through `plane_options={"auth": Credentials(...)}`)."""
        return self.plane.unauthorized_attempts

    def start(self, timeout: float = 10.0) -> str:
        self.thread.start()
        self.thread.run(self.plane.start(), timeout)
        return self.plane.address

    def close(self, timeout: float = 5.0) -> None:
        if self.thread.loop is not None:
            with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
                self.thread.run(self.plane.aclose(), timeout)
        self.thread.stop()

    def __enter__(self) -> NetworkCollective:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    takes_encoded = True  # begin() accepts a pre-encoded contribution (a node's ranks)

    def begin(self, key: SyncKey, flat: torch.Tensor, weight: float = 1.0,
              encoded: SplicedEncoding | None = None,
              state: StateSource | None = None) -> _NetPending:
        """Average `flat` with the swarm in the background; `encoded`: `flat` as a node's
        ranks already encoded it with the round's codec, slice by slice; `state`: our packed
        outer state, for the state round of a grouped swarm."""
        fragment = GRAD_FRAGMENT if key.kind == "grad" else key.fragment
        mix_only = key.kind == "mix"
        t0 = self.rounds.clock()
        # A copy on flat's own device: on a GPU the round quantizes and reduces there
        # (AllReduceRound's torch data path) and only encoded bytes cross to the host.
        local = flat.detach().to(torch.float32).flatten().clone()
        out = None
        if self.reuse_results and not mix_only:
            out = self._results.get(fragment)
            busy = self._in_flight.get(fragment)
            if busy is not None and not busy.done():  # an abandoned round may still write
                out = None
            elif out is None or out.numel() != local.numel():
                out = self._results[fragment] = torch.empty_like(local)
        fut = self.thread.submit(self._reduce(fragment, key.round, local, t0, out, weight,
                                              encoded, state, mix_only))
        if not mix_only:
            self._in_flight[fragment] = fut
        return _NetPending(fut)

    async def _reduce(self, fragment: int, round_no: int, local: torch.Tensor,
                      t0: float, out_buf: torch.Tensor | None = None,
                      weight: float = 1.0, encoded: SplicedEncoding | None = None,
                      state: StateSource | None = None,
                      mix_only: bool = False) -> ReduceResult:
        swarm = await self.rounds.reduce(fragment, round_no, local, out_buf, weight,
                                         encoded, state=state, mix_only=mix_only)
        out = swarm.outcome
        assert out.result is not None
        mixed = out if mix_only else swarm.state
        rounds = [*swarm.attempts, *([swarm.state] if swarm.state is not None else [])]
        return ReduceResult(
            mean=out.result, group_size=len(out.members),
            payload_bytes_sent=sum(a.payload_bytes_sent for a in rounds),
            payload_bytes_received=sum(a.payload_bytes_received for a in rounds),
            grouped=swarm.grouped, state_mean=mixed.result if mixed is not None else None,
            state_digest=(mixed.digest or "") if mixed is not None else "",
            dropped=tuple(f"{peer}: {reason}" for peer, reason in swarm.excluded.items()),
            skipped=out.skipped, members=tuple(out.members),
            attempts=len(swarm.attempts) + sum("no group" in e for e in swarm.errors),
            rejected=out.rejected, encoded=out.encoded, digest=out.digest or "",
            diverged=swarm.diverged, outvoted=swarm.outvoted,
            latency_s=self.rounds.clock() - t0, pace_s=swarm.pace_s)
