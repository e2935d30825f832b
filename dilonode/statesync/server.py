"""State sync's serving side: the server every node runs for joiners.

Every connection is authenticated (`link.Link`: the data plane's handshake, then a MAC on
every frame both ways): a server serves only joiners the run's credentials admit.

A manifest request asks the training thread, via `SnapshotSource`, for a copy of the outer
state at the next round boundary (no fragment sync in flight, so peers that took part in the
same rounds hold identical bytes). The training thread only copies the fragments that
changed since the last snapshot, at most once per request burst; hashing and sending run on
the node's network loop and its worker threads, so training never waits on a joiner. When
the node is not training (starting, stopping) the snapshot is taken directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from dilonode import PROTOCOL_VERSION
from dilonode.config import StateSyncConfig
from dilonode.net import congestion
from dilonode.net.admission import Admission, Gate, Ticket
from dilonode.net.auth import Credentials
from dilonode.net.channel import HandshakeError
from dilonode.net.listener import Acceptor, bind_listener
from dilonode.statesync.link import Link, own_peer_id
from dilonode.statesync.plan import (
    chunk_bytes_of,
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
    replay_name,
)
from dilonode.train.state import WorkerState
from dilonode.wire.errors import RemoteProtocolError, one_line

__all__ = ["SnapshotSource", "StateServer"]


log = logging.getLogger(__name__)

_IDLE_CLOSE_S = 120.0  # a connection with no request for this long is closed
_STREAM_LIMIT = 1 << 16  # asyncio's default buffer limit of a server's StreamReader
_HOLD_S = 120.0  # snapshots are dropped after this long without a manifest request


class _Exportable(Protocol):
    step: int

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
        self._polled_at = time.monotonic()  # the trainer's last pass between steps
        self._counts: Callable[[int, int, str], bool] | None = None  # see `attach`

    def attach(self, worker: _Exportable,
               counts: Callable[[int, int, str], bool] | None = None) -> None:
        """Serve `worker`'s state from now on. `counts(fragment, round, joiner)`: whether
        that round, in flight here, counts the joiner (it expected it in matchmaking or
        grouped it: `Membership.counts`); None: none does."""
        with self._cond:
            self._worker, self._latest, self._counts = worker, None, counts

    def training(self, on: bool) -> None:
        with self._cond:
            self._training = on

    def blocked(self, on: bool) -> None:
        """Training thread: about to block on a sync result (True) or back (False)."""
        with self._cond:
            self._frozen = on

    @contextlib.contextmanager
    def replacing(self) -> Iterator[None]:
        """Training thread: the outer state is being replaced (a re-sync adopts a peer's);
        no snapshot is copied meanwhile, and the held one is stale afterwards."""
        with self._cond:
            yield
            self._latest = None

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
        self._polled_at = time.monotonic()
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

    def step_now(self, joiner: str | None = None) -> int | None:
        """The step a joiner's state must reach, as of now, without waiting for the trainer;
        None when there is nothing to serve. Our current step, except that rounds in flight
        that count `joiner` are left out: it takes part in them, and asking it to wait for
        them to land would make it and them wait on each other."""
        worker, counts = self._worker, self._counts
        if worker is None:
            return None
        if joiner is None or counts is None:
            return worker.step
        return worker.floor_step(lambda fragment, round_no: counts(fragment, round_no, joiner))

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
                    since = time.monotonic() - self._polled_at
                    raise TimeoutError(
                        f"{BUSY}: the trainer did not pass a step within {timeout} s (at step "
                        f"{worker.step}, last between steps {since:.1f} s ago)")
            if self._latest is None:
                raise LookupError(self._unservable or "no state to serve yet")
            return self._latest


class StateServer:
    """Serves manifests and chunks of this node's snapshots on the network loop.

    Only to joiners that pass the handshake under `auth` (the node's credentials; None:
    trust mode, tests and benchmarks only, with the made-up `peer_id`); refused attempts
    are counted in `unauthorized_attempts` and logged through `gate` (the node's
    `Admission.gate("state")`, which also caps connections still in their handshake;
    None: a gate of its own with the default limits). `tcp_congestion`: the congestion
    control its connections send with (`dilonode.net.congestion`; "system" leaves the kernel's).
    """

    def __init__(self, source: SnapshotSource, run_id: str, config_digest: str,
                 cfg: StateSyncConfig, host: str = "127.0.0.1", *,
                 auth: Credentials | None = None, peer_id: str | None = None,
                 gate: Gate | None = None, tcp_congestion: str = congestion.SYSTEM) -> None:
        self.source, self.run_id, self.digest, self.cfg = source, run_id, config_digest, cfg
        self.auth, self.peer_id = auth, own_peer_id(auth, peer_id)
        self.host = cfg.host or host
        self.tcp_congestion = tcp_congestion
        self.gate = gate or Admission().gate("state")
        self.gate.log.logger = log
        self._acceptor: Acceptor | None = None
        self._lock: asyncio.Lock | None = None
        self._cache: dict[str, tuple[object, list[bytes]]] = {}
        # The newest snapshot and the newest of the content before it (older rounds): a
        # transfer that started on that one can finish it, and replay the round since.
        self._served: deque[_Served] = deque(maxlen=2)
        self._conns: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}
        self._asked_at = time.monotonic()
        self._janitor: asyncio.Task[None] | None = None
        self.bytes_served = 0
        self.manifests_served = 0
        self.unauthorized_attempts = 0
        self.address = ""

    async def start(self) -> str:
        self._lock = asyncio.Lock()
        self._acceptor = Acceptor(bind_listener(self.host, self.cfg.port), self.gate,
                                  self._protocol)
        self._acceptor.start()
        self.address = f"{self.host}:{self._acceptor.port}"
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
        if self._acceptor is not None:
            self._acceptor.close()
        if self._janitor is not None:
            self._janitor.cancel()
        for writer in list(self._conns.values()):
            writer.close()  # their handlers see EOF and return
        if self._conns:
            _, late = await asyncio.wait(list(self._conns), timeout=2.0)
            for task in late:
                task.cancel()

    async def accept_stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                            remote: str) -> None:
        """Serve one joiner that came by another path than our listening socket (a libp2p
        stream to a node behind a NAT): the same gate, handshake and requests."""
        ticket = self.gate.admit(remote)
        if ticket is None or self._acceptor is None:
            writer.transport.abort()
            return
        await self._handle(reader, writer, ticket)

    def _protocol(self, ticket: Ticket) -> asyncio.StreamReaderProtocol:
        """The protocol of one admitted connection: a stream pair served by `_handle`."""
        reader = asyncio.StreamReader(limit=_STREAM_LIMIT)
        return asyncio.StreamReaderProtocol(
            reader, functools.partial(self._handle, ticket=ticket))

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      ticket: Ticket | None = None) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns[task] = writer
        peer = writer.get_extra_info("peername")
        congestion.apply(writer.get_extra_info("socket"), self.tcp_congestion)
        if ticket is not None:
            ticket.close = writer.transport.abort  # if evicted for a newcomer from elsewhere
        try:
            conn = await Link.accept(reader, writer, self.auth, self.run_id, self.peer_id,
                                     self.cfg.request_timeout)
            if ticket is not None:
                self.gate.established(ticket)
            peer = f"{conn.peer_id} at {peer}"
            while True:
                req = await conn.recv(_IDLE_CLOSE_S)
                conn.send(await self._answer(req, conn.peer_id))
                await conn.drain()
        except TimeoutError:  # a proven joiner that stopped asking
            if ticket is not None:
                self.gate.release(ticket, "idle")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the joiner is done or gone
        except RemoteProtocolError as exc:
            self._refused(ticket, peer, exc)
        except (RuntimeError, asyncio.CancelledError):
            # `aclose` closed the connection while an answer was being made (uvloop refuses
            # the write), or gave up waiting for it: nothing is left to send. Ending quietly
            # keeps asyncio from logging an ERROR per connection at every shutdown.
            if not writer.is_closing():
                raise
        finally:
            self._conns.pop(task, None)
            writer.close()
            if ticket is not None:
                self.gate.release(ticket)

    def _refused(self, ticket: Ticket | None, peer: object, exc: RemoteProtocolError) -> None:
        """Count and log (aggregated per address by the gate) a connection we drop."""
        unauthorized = isinstance(exc, HandshakeError)
        self.unauthorized_attempts += unauthorized
        # Link.accept turns its deadline into this HandshakeError.
        kind = ("handshake_timeout" if exc.reason.startswith("no complete handshake")
                else "unauthorized" if unauthorized else "malformed")
        self.gate.closing(ticket, kind, f"state sync: dropping {self.gate.log.cap(peer)}: "
                          f"{self.gate.log.cap(exc.reason)}")

    async def _answer(self, req: StateMessage, joiner: str | None = None) -> StateMessage:
        if isinstance(req, ManifestRequest):
            if req.version != PROTOCOL_VERSION or req.run_id != self.run_id:
                return Error(reason=one_line(f"this node serves run {self.run_id!r}, protocol "
                                             f"{PROTOCOL_VERSION}"))
            return await self._manifest(joiner)
        if isinstance(req, ChunkRequest):
            return self._chunk(req.digest)
        raise RemoteProtocolError(f"state sync: {req.type} is not a request")

    async def _manifest(self, joiner: str | None = None) -> StateMessage:
        assert self._lock is not None
        self._asked_at = time.monotonic()
        # A joiner's floor: every round started by now is in a state it may adopt. The
        # snapshot comes at the trainer's next step, when a round that already counts the
        # joiner (and waits for it) may have started, so its step would be too late.
        asked = await asyncio.to_thread(self.source.step_now, joiner)  # reads peer records
        async with self._lock:  # concurrent joiners share one snapshot and its hashing
            try:
                state = await asyncio.to_thread(self.source.request, self.cfg.snapshot_wait)
            except (LookupError, TimeoutError) as exc:
                return Error(reason=str(exc))
            if not self._served or self._served[-1].state is not state:
                served = await asyncio.to_thread(_Served.of, state, self.run_id, self.digest,
                                                 self.cfg.chunk_bytes, self._cache)
                if self._served and self._served[-1].content == served.content:
                    self._served.pop()  # same rounds, fresher step: keep the older content
                self._served.append(served)
            self.manifests_served += 1
            manifest = self._served[-1].manifest
            if asked is None:
                return manifest
            return manifest.model_copy(update={"current_step": asked})

    def _chunk(self, digest: bytes) -> StateMessage:
        for served in reversed(self._served):
            payload = served.chunk(digest, self.cfg.chunk_bytes)
            if payload is not None:
                self.bytes_served += len(payload)
                return Chunk(digest=digest, payload=payload)
        return Error(reason=f"chunk {digest.hex()[:12]} is not in a current snapshot")


@dataclass
class _Served:
    """A snapshot being served: its manifest, where each chunk is, and the replays' bytes."""

    state: WorkerState
    manifest: Manifest
    index: dict[bytes, tuple[str, int]]  # digest -> (tensor or replay name, chunk index)
    blobs: dict[str, bytes]  # replay name -> the encoded result

    @classmethod
    def of(cls, state: WorkerState, run_id: str, digest: str, chunk_bytes: int,
           cache: dict[str, tuple[object, list[bytes]]]) -> _Served:
        manifest = manifest_of(state, run_id, digest, chunk_bytes, cache)
        index = {d: (t.name, i) for t in manifest.tensors for i, d in enumerate(t.chunks)}
        for r in manifest.replays:
            index.update({d: (replay_name(r.fragment, r.round), i)
                          for i, d in enumerate(r.chunks)})
        blobs = {replay_name(p, r): enc.blob() for p, r, enc in state.replay_rounds()}
        return cls(state, manifest, index, blobs)

    @property
    def content(self) -> tuple[object, ...]:
        return self.manifest.content_key()

    def chunk(self, digest: bytes, chunk_bytes: int) -> bytes | None:
        where = self.index.get(digest)
        if where is None:
            return None
        name, i = where
        if name in self.blobs:
            return self.blobs[name][i * chunk_bytes:(i + 1) * chunk_bytes]
        return bytes(chunk_bytes_of(self.state.tensors[name], i, chunk_bytes))
