"""State sync over TCP: the server every node runs for joiners, and the joiner's client.

Serving (`SnapshotSource` + `StateServer`): a manifest request asks the training thread, via
`SnapshotSource`, for a copy of the outer state at the next round boundary (no fragment sync
in flight, so peers that took part in the same rounds hold identical bytes). The training
thread only copies the fragments that changed since the last snapshot, at most once per
request burst; hashing and sending run on the node's network loop and its worker threads, so
training never waits on a joiner. When the node is not training (starting, stopping) the
snapshot is taken directly.

Joining (`recover`): ask every serving peer for its manifest, pick the state to trust
(`plan.choose_target`), reuse every chunk we already hold, fetch the rest spread over all
peers that advertised it (a window of requests in flight per peer; a peer that fails, times
out or sends a bad chunk is dropped and its chunks go to the others), and repeat with fresh
manifests until no round has landed since (rounds land every H/P steps somewhere in the
state, so the last pass usually fetches one fragment or nothing). Every network operation has
a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from dilonode import PROTOCOL_VERSION
from dilonode.config import StateSyncConfig
from dilonode.statesync.plan import (
    Assembler,
    FetchPlan,
    Target,
    choose_target,
    chunk_bytes_of,
    manifest_of,
)
from dilonode.statesync.protocol import (
    HEADER,
    MAX_FRAME_BYTES,
    Chunk,
    ChunkRequest,
    Error,
    Manifest,
    ManifestRequest,
    StateMessage,
    decode_body,
    encode_frame,
)
from dilonode.train.state import WorkerState
from dilonode.wire.errors import RemoteProtocolError, one_line

__all__ = ["Recovery", "RecoveryError", "SnapshotSource", "StateServer", "recover"]

log = logging.getLogger(__name__)

_IDLE_CLOSE_S = 120.0  # a connection with no request for this long is closed
_MAX_FAILED_FETCHES = 3
_RETRY_S = 0.2  # pause before asking peers again (busy, or a round is landing)
_HOLD_S = 120.0  # snapshots are dropped after this long without a manifest request
BUSY = "busy"  # error reason prefix: ask again shortly
MAX_SOURCES = 8  # peers asked at once; more adds connections, not bandwidth


class _Exportable(Protocol):
    step: int
    pending: dict[int, Any]

    def export_state(self, reuse: WorkerState | None = None) -> WorkerState: ...


class SnapshotSource:
    """Hands copies of a worker's outer state from the training thread to the server.

    The outer state only changes inside the training thread's `land`, after a sync result
    arrived. So a snapshot may be taken by the requesting thread itself whenever the trainer
    is not training or is blocked waiting for a result (`blocked(True)`, from the worker's
    `wait_hook`; `blocked(False)` takes the lock, so a copy in progress finishes first), and
    otherwise by the training thread at its next `poll(worker)` between steps.
    """

    def __init__(self, worker: _Exportable | None = None) -> None:
        self._worker = worker
        self._cond = threading.Condition()
        self._wanted = False
        self._training = False
        self._frozen = False
        self._latest: WorkerState | None = None
        self._unservable = ""
        self.taken = 0

    def attach(self, worker: _Exportable) -> None:
        with self._cond:
            self._worker, self._latest = worker, None

    def training(self, on: bool) -> None:
        with self._cond:
            self._training = on

    def blocked(self, on: bool) -> None:
        """Training thread: about to block on a sync result (True) or back (False)."""
        with self._cond:
            self._frozen = on

    def detach(self) -> None:
        """Serve nothing from now on (the worker's counters no longer match its state)."""
        with self._cond:
            self._worker, self._latest = None, None

    def forget(self) -> None:
        """Drop the held snapshot (no joiner for a while: give the memory back)."""
        with self._cond:
            self._latest = None

    def poll(self, worker: _Exportable) -> None:
        """Training thread, between steps: take the snapshot asked for, if any."""
        if self._wanted:
            with self._cond:
                self._take(worker)

    def _take(self, worker: _Exportable) -> None:
        try:
            self._latest = worker.export_state(reuse=self._latest)
        except RuntimeError as exc:  # this schedule always has a round in flight
            self._latest, self._unservable = None, str(exc)
        self._wanted = False
        self.taken += 1
        self._cond.notify_all()

    def request(self, timeout: float) -> WorkerState:
        """A snapshot of the current state.

        LookupError when there is nothing to serve yet (we are joining ourselves);
        TimeoutError when the trainer did not come by within `timeout` s. An older snapshot
        is never served instead: a joiner adopting it would miss the rounds that landed
        since, and they cannot be replayed.
        """
        with self._cond:
            worker = self._worker
            if worker is None:
                raise LookupError("no state to serve yet")
            if not self._training or self._frozen:
                self._take(worker)
            else:
                taken = self.taken
                self._wanted = True
                if not self._cond.wait_for(lambda: self.taken > taken, timeout):
                    raise TimeoutError(f"{BUSY}: the trainer did not pass a step within "
                                       f"{timeout} s")
            if self._latest is None:
                raise LookupError(self._unservable or "no state to serve yet")
            return self._latest


class _Conn:
    """One framed TCP connection; every read has a timeout."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 timeout: float) -> None:
        self.reader, self.writer, self.timeout = reader, writer, timeout

    @classmethod
    async def open(cls, addr: str, timeout: float) -> _Conn:
        host, _, port = addr.rpartition(":")
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)),
                                                timeout)
        return cls(reader, writer, timeout)

    def send(self, msg: StateMessage) -> None:
        self.writer.write(encode_frame(msg))

    async def drain(self) -> None:
        await asyncio.wait_for(self.writer.drain(), self.timeout)

    async def recv(self, timeout: float | None = None) -> StateMessage:
        async with asyncio.timeout(timeout or self.timeout):
            (n,) = HEADER.unpack(await self.reader.readexactly(HEADER.size))
            if not 1 <= n <= MAX_FRAME_BYTES:
                raise RemoteProtocolError(f"state sync frame of {n} bytes (max "
                                          f"{MAX_FRAME_BYTES})")
            return decode_body(await self.reader.readexactly(n))

    def close(self) -> None:
        self.writer.close()


class StateServer:
    """Serves manifests and chunks of this node's snapshots on the network loop."""

    def __init__(self, source: SnapshotSource, run_id: str, config_digest: str,
                 cfg: StateSyncConfig, host: str = "127.0.0.1") -> None:
        self.source, self.run_id, self.digest, self.cfg = source, run_id, config_digest, cfg
        self.host = cfg.host or host
        self._server: asyncio.Server | None = None
        self._lock: asyncio.Lock | None = None
        self._cache: dict[str, tuple[torch.Tensor, list[bytes]]] = {}
        # Served snapshots, newest last: a transfer that started on the previous one can
        # finish its unchanged chunks after another joiner asked for a newer one.
        self._served: deque[tuple[WorkerState, Manifest, dict[bytes, tuple[str, int]]]] = \
            deque(maxlen=2)
        self._conns: dict[asyncio.Task[Any], _Conn] = {}
        self._asked_at = time.monotonic()
        self._janitor: asyncio.Task[None] | None = None
        self.bytes_served = 0
        self.manifests_served = 0
        self.address = ""

    async def start(self) -> str:
        self._lock = asyncio.Lock()
        self._server = await asyncio.start_server(self._handle, self.host, self.cfg.port)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"{self.host}:{port}"
        self._janitor = asyncio.create_task(self._release_idle())
        return self.address

    async def _release_idle(self) -> None:
        while True:
            await asyncio.sleep(_HOLD_S / 4)
            if self._served and time.monotonic() - self._asked_at > _HOLD_S:
                self._served.clear()
                self._cache.clear()
                self.source.forget()

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._janitor is not None:
            self._janitor.cancel()
        for conn in list(self._conns.values()):
            conn.close()  # their handlers see EOF and return
        if self._conns:
            _, late = await asyncio.wait(list(self._conns), timeout=2.0)
            for task in late:
                task.cancel()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        conn = self._conns[task] = _Conn(reader, writer, self.cfg.request_timeout)
        peer = writer.get_extra_info("peername")
        try:
            while True:
                req = await conn.recv(_IDLE_CLOSE_S)
                conn.send(await self._answer(req))
                await conn.drain()
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass  # the joiner is done, gone or idle
        except RemoteProtocolError as exc:
            log.warning("state sync: dropping %s: %s", peer, exc)
        finally:
            self._conns.pop(task, None)
            conn.close()

    async def _answer(self, req: StateMessage) -> StateMessage:
        if isinstance(req, ManifestRequest):
            if req.version != PROTOCOL_VERSION or req.run_id != self.run_id:
                return Error(reason=one_line(f"this node serves run {self.run_id!r}, protocol "
                                             f"{PROTOCOL_VERSION}"))
            return await self._manifest()
        if isinstance(req, ChunkRequest):
            return self._chunk(req.digest)
        raise RemoteProtocolError(f"state sync: {req.type} is not a request")

    async def _manifest(self) -> StateMessage:
        assert self._lock is not None
        self._asked_at = time.monotonic()
        async with self._lock:  # concurrent joiners share one snapshot and its hashing
            try:
                state = await asyncio.to_thread(self.source.request, self.cfg.snapshot_wait)
            except (LookupError, TimeoutError) as exc:
                return Error(reason=str(exc))
            if not self._served or self._served[-1][0] is not state:
                manifest = await asyncio.to_thread(manifest_of, state, self.run_id,
                                                   self.digest, self.cfg.chunk_bytes,
                                                   self._cache)
                index = {d: (t.name, i) for t in manifest.tensors
                         for i, d in enumerate(t.chunks)}
                self._served.append((state, manifest, index))
            self.manifests_served += 1
            return self._served[-1][1]

    def _chunk(self, digest: bytes) -> StateMessage:
        for state, _, index in reversed(self._served):
            where = index.get(digest)
            if where is not None:
                payload = bytes(chunk_bytes_of(state.tensors[where[0]], where[1],
                                               self.cfg.chunk_bytes))
                self.bytes_served += len(payload)
                return Chunk(digest=digest, payload=payload)
        return Error(reason=f"chunk {digest.hex()[:12]} is not in a current snapshot")


def _why(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "no answer in time (statesync.request_timeout)"
    return f"{type(exc).__name__}: {exc}"


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
    passes: int = 0
    sources: dict[str, int] = field(default_factory=dict)  # peer -> payload bytes from it
    agreed_by: tuple[str, ...] = ()  # peers whose manifest was exactly the adopted state


class _Client:
    """One recovery: connections to the serving peers and the passes over them."""

    def __init__(self, peers: dict[str, str], run_id: str, digest: str,
                 cfg: StateSyncConfig) -> None:
        # A random subset, so that many joiners spread over a large swarm.
        chosen = random.sample(sorted(peers), min(len(peers), MAX_SOURCES))
        self.addrs = {p: peers[p] for p in sorted(chosen)}
        self.run_id, self.digest, self.cfg = run_id, digest, cfg
        self.conns: dict[str, _Conn] = {}
        self.busy: set[str] = set()
        self.fetched_once = False
        self.result = Recovery(state=WorkerState(0, (), ()))

    def _drop(self, peer: str, why: str) -> None:
        log.warning("state sync: dropping peer %s: %s", peer, one_line(why, 200))
        conn = self.conns.pop(peer, None)
        self.addrs.pop(peer, None)
        if conn is not None:
            conn.close()

    async def _manifest(self, peer: str) -> Manifest | None:
        try:
            if peer not in self.conns:
                self.conns[peer] = await _Conn.open(self.addrs[peer], self.cfg.request_timeout)
            conn = self.conns[peer]
            conn.send(ManifestRequest(run_id=self.run_id))
            msg = await conn.recv()
        except (OSError, TimeoutError, asyncio.IncompleteReadError, RemoteProtocolError) as exc:
            self._drop(peer, _why(exc))
            return None
        if isinstance(msg, Error):
            log.info("state sync: peer %s has no manifest: %s", peer, msg.reason)
            if msg.reason.startswith(BUSY):
                self.busy.add(peer)
            return None
        if not isinstance(msg, Manifest) or msg.run_id != self.run_id or \
                msg.version != PROTOCOL_VERSION or msg.config_digest != self.digest:
            self._drop(peer, "answered with a manifest of another run, protocol or config"
                       if isinstance(msg, Manifest) else f"answered {msg.type} to manifest?")
            return None
        return msg

    async def manifests(self) -> dict[str, Manifest]:
        """One manifest per peer that has one now; `busy` names those to ask again."""
        peers, self.busy = list(self.addrs), set()
        got = await asyncio.gather(*(self._manifest(p) for p in peers))
        return {p: m for p, m in zip(peers, got, strict=True) if m is not None}

    async def fetch(self, target: Target, manifests: dict[str, Manifest],
                    held: WorkerState | None, known: dict[str, list[bytes]]) -> WorkerState:
        asm = Assembler(target.manifest)
        reused = asm.reuse(held, known)
        if not self.fetched_once:  # later passes reuse what we fetched, not what we had
            self.result.reused_bytes, self.fetched_once = reused, True
        sources = {p: {d for t in m.tensors for d in t.chunks} for p, m in manifests.items()}
        plan = FetchPlan(asm.needed(), sources)
        changed = asyncio.Event()
        await asyncio.gather(*(self._pull(p, plan, asm, changed) for p in list(sources)))
        for peer, n in plan.fetched_from.items():
            self.result.sources[peer] = self.result.sources.get(peer, 0) + n
            self.result.fetched_bytes += n
        if not plan.complete:
            raise RecoveryError(f"state sync: {plan.missing} chunks of the state at step "
                                f"{target.step} could not be fetched from any live peer")
        return asm.state()

    async def _pull(self, peer: str, plan: FetchPlan, asm: Assembler,
                    changed: asyncio.Event) -> None:
        conn, outstanding = self.conns.get(peer), deque[bytes]()
        if conn is None:
            plan.drop(peer)
            return
        while not plan.complete:
            while len(outstanding) < self.cfg.window and (d := plan.next_for(peer)):
                conn.send(ChunkRequest(digest=d))
                outstanding.append(d)
            if not outstanding:
                if plan.stuck():
                    return
                changed.clear()  # nothing for us now; wake when a dropped peer's work returns
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), self.cfg.request_timeout)
                continue
            try:
                msg = await conn.recv()
                d = outstanding.popleft()
                if isinstance(msg, Error):
                    plan.failed(peer, d)
                elif isinstance(msg, Chunk) and msg.digest == d:
                    plan.delivered(peer, d, msg.payload)
                    asm.put(d, msg.payload)
                else:
                    raise RemoteProtocolError(f"state sync: answered {msg.type} for chunk?")
            except (OSError, TimeoutError, asyncio.IncompleteReadError,
                    RemoteProtocolError) as exc:
                plan.drop(peer)
                self._drop(peer, _why(exc))
                changed.set()
                return
            changed.set()

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()


async def recover(peers: dict[str, str], local: WorkerState | None, run_id: str,
                  config_digest: str, cfg: StateSyncConfig, min_rounds: int = -1,
                  before_final: Callable[[], Awaitable[None]] | None = None
                  ) -> Recovery | None:
    """Fetch the swarm's current outer state from `peers` (peer id -> state address).

    `local` is the state we hold (fresh or from a checkpoint): its chunks are never fetched.
    `before_final` runs once the fetched state is current (or after `cfg.max_passes`
    fetches): the node publishes its record there and waits until peers see it. Rounds the
    peers start after that wait expect us; rounds started before it may not, so the state
    adopted must include all of them: we re-read manifests until its step is at least the
    peers' step right after the wait. Returns None when no peer serves a state with more
    than `min_rounds` rounds landed (summed over fragments); raises `RecoveryError` when
    peers are ahead but the state could not be completed. The caller bounds the whole
    call (statesync.recover_timeout); every request has its own timeout.
    """
    t0 = time.perf_counter()
    client = _Client(peers, run_id, config_digest, cfg)
    held, known = local, dict[str, list[bytes]]()
    held_target: Target | None = None  # the state `held` is, with its freshest step
    floor: int | None = None  # after publishing: rounds started by then may exclude us
    fetches, failures, published = 0, 0, False
    try:
        while True:
            client.result.passes += 1
            manifests = await client.manifests()
            if not manifests and client.busy:
                await asyncio.sleep(_RETRY_S)  # a trainer is mid-step; ask again
                continue
            target = choose_target(manifests)
            if target is None or (held_target is None and
                                  sum(target.manifest.rounds) <= min_rounds):
                break
            if floor is None and published and before_final is None:
                floor = max(m.current_step for m in manifests.values())
            current = held_target is not None and \
                target.manifest.content_key() == held_target.manifest.content_key()
            if current or (before_final is not None and fetches >= cfg.max_passes):
                if current:
                    held_target = target  # same content, fresher step
                if before_final is not None:
                    await before_final()
                    before_final, published = None, True
                    continue
                if floor is None or target.step >= floor:
                    break
                await asyncio.sleep(_RETRY_S)  # a round that may exclude us is landing
                continue
            t_fetch = time.perf_counter()
            try:
                held = await client.fetch(target, manifests, held, known)
            except RecoveryError as exc:  # e.g. every peer holding a chunk moved on: re-read
                failures += 1
                if failures >= _MAX_FAILED_FETCHES or not client.addrs:
                    raise
                log.warning("%s; asking for manifests again", exc)
                continue
            finally:
                client.result.fetch_seconds += time.perf_counter() - t_fetch
            held_target, fetches = target, fetches + 1
            known = {t.name: list(t.chunks) for t in target.manifest.tensors}
    finally:
        client.close()
    if held_target is None or held is None:
        return None
    held.step = held_target.step
    client.result.state = held
    client.result.agreed_by = held_target.supporters
    client.result.seconds = time.perf_counter() - t0
    return client.result
