"""Drives one sans-IO all-reduce round over a `DataPlane`.

`run_round(plane, spec, my_index, local, peers, timeout)` runs one `AllReduceRound`: it
starts the round, feeds it what the plane delivers, ticks it at least every `TICK_SECONDS`,
performs its `Send`s and returns a `RoundOutcome` as soon as the round ends, by its
deadline whatever the peers do. Round calls (encode, decode, reduce, digests) run in a
worker thread by default (`offload=True`): they release the GIL in numpy/torch/hashlib, so
the event loop keeps reading and writing sockets meanwhile and the worst event-loop stall
stays short (benchmarks/loopback/allreduce.py measures both ways). Keep the process's torch
threads at 1 (or few): oversubscribed intra-op threads on shared cores make small tensor ops
many times slower.

All protocol decisions stay in `AllReduceRound`; this module moves events and actions
between it and the plane and keeps time with the injectable `clock`. The retry policy over
rounds is `allreduce/retry.py`; the `Collective` the trainer sees is
`allreduce/network_collective.py`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from dilonode.algo.replay import EncodedResult
from dilonode.algo.robust import AggregatorSpec
from dilonode.algo.sliced_encoding import SplicedEncoding
from dilonode.allreduce.inbox import Inbox, PeerEvent
from dilonode.allreduce.round import (
    Action,
    AllReduceRound,
    GroupSpec,
    RoundFailure,
    RoundState,
    Send,
)
from dilonode.allreduce.transport import DataPlane
from dilonode.wire.messages import Abort

__all__ = ["GRAD_FRAGMENT", "STATE_WIRE", "TICK_SECONDS", "RoundOutcome", "run_round"]

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
