"""TCP data plane of the all-reduce: moves frames between peers and routes them to rounds.

`DataPlane` owns one listening socket and, per peer, one persistent outgoing connection.
Connections are one-way: a node writes only on the connections it opened and reads only on
the ones it accepted, so there is never a question of which of two connections to use.
Every connection starts with the authenticating handshake of `dilonode.net.channel`
(Hello, HelloAck, HelloAuth): each side proves its libp2p identity and the swarm secret, the
acceptor checks the allowlist, and from then on it attributes every frame on that connection
(each followed by a MAC tag under the session key) to that proven peer. Refused attempts are
counted in `stats["unauthorized"]` (`unauthorized_attempts`) and logged through the port's
`Gate` (`dilonode.net.admission`): the first of each peer in full, the rest in one line per
reason per minute. The listening socket is served by `dilonode.net.listener.Acceptor`, which
caps connections that are still in their handshake (per port and per source address)
before anything is read from them.

Usage (all on one asyncio event loop):

    plane = DataPlane("peer-a", "run-1")    # or limits=PlaneLimits(...) (plane_limits.py)
    await plane.start()                      # listens; plane.address is "host:port"
    inbox = plane.register((fragment, round, attempt), members)
    fut = plane.send("peer-b", "127.0.0.1:4242", frame)   # resolves once written
    events = await inbox.get_batch(timeout=0.1)           # PeerEvents for that round
    plane.unregister(key)
    await plane.aclose()

Nothing here decides anything about the protocol: frames are decoded (`FrameDecoder`), and
round messages are handed, with the peer id of their connection, to the `Inbox` of the round
registered under their (fragment, round, attempt); `dilonode.allreduce.driver` feeds them
to the sans-IO `AllReduceRound`. Problems become `PeerEvent`s too: a frame that does not
decode, or a bad first frame, is a peer *error* (the round fails naming the peer); a lost
connection is the peer being *gone* (the round fails only if it still needs that peer).

The plane's bounds and switches are one `PlaneLimits` (`plane_limits.py`, a field each).
Frames for a key nobody registered yet are kept for `pending_ttl` seconds, because peers
start a round a few ms apart; count and bytes are bounded, and whatever overflows or
expires is dropped with a log line. Inboxes are bounded too: above `max_queued_bytes` of
undelivered frames the plane stops reading from its sockets until the rounds catch up.
Counters (bytes, frames, rejections, drops) are in `stats`; `bytes_in_direct` counts the
bytes the event loop read straight into the frame body their message keeps (`_Inbound`).

Connections are persistent, and in a grouped swarm (`algo/groups.py`) a node meets new
peers every round. With `max_idle_inbound` set, once more connections than that are open
to us, the receiving side retires those idle for `idle_close_s` seconds whose peer has no
round registered or pending here (oldest first): it writes the one-byte close notice and
keeps reading until the sender closes its side, because a frame the sender writes before
the notice reaches it (half a round trip) must still arrive. The sender stops writing on a
connection once it reads the notice, closes it after what it wrote is flushed, and its next
frame opens a new one, so neither side takes the other for dead (a sender closing on its
own would look to the receiver like a peer that died, `gone`). A sender's connection
objects whose socket is gone are forgotten past the same bound. So open connections per node stay
bounded by what the rounds in flight need plus that many, whatever the swarm's size.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import time
from collections import deque
from collections.abc import Iterable
from typing import cast

from dilonode.allreduce.allocator import tune_allocator
from dilonode.allreduce.inbox import (
    EventKind,
    Inbox,
    PeerEvent,
    PeerUnreachable,
    PendingFrames,
    RoundKey,
    parse_address,
)
from dilonode.allreduce.plane_limits import PlaneLimits
from dilonode.net import congestion, sockbuf
from dilonode.net.admission import Admission, Gate, Ticket
from dilonode.net.aio import bounded
from dilonode.net.auth import Credentials
from dilonode.net.channel import (
    HANDSHAKE_FRAME_MAX,
    TAG_BYTES,
    FrameSealer,
    HandshakeError,
    InboundChannel,
    OutboundHandshake,
    StreamOpener,
    read_handshake_frame,
)
from dilonode.net.listener import Acceptor, bind_listener
from dilonode.wire.errors import RemoteProtocolError, one_line
from dilonode.wire.framing import FrameParts
from dilonode.wire.messages import Hello, Message

__all__ = ["DataPlane"]

log = logging.getLogger(__name__)

_READ_LIMIT = 1 << 20
_SCRATCH_BYTES = 64 << 10  # one read outside a large frame body (headers, tags, small frames)
_WRITE_HIGH_WATER = 1 << 20
_RECENT_KEYS = 256  # finished keys remembered, so their late frames are dropped quietly
CLOSE_NOTICE = b"\x00"  # the acceptor's only byte after the handshake: "finish and close"


class _Inbound(asyncio.BufferedProtocol):
    """One accepted connection: the handshake first, then round messages from that peer.

    The event loop reads the rest of a large frame body straight into the buffer its
    message will keep (`InboundChannel.read_buffer`), everything else into a scratch buffer
    that is fed on; a libp2p stream (`DataPlane.accept_stream`) calls `data_received`.
    """

    def __init__(self, plane: DataPlane, ticket: Ticket | None = None) -> None:
        self.plane = plane
        self.ticket = ticket  # its place in the port's admission gate
        self.remote = "?"
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.channel = InboundChannel(plane.auth, plane.run_id, plane.peer_id,
                                      max_frame_bytes=plane.limits.max_frame_bytes)
        self.proven = False  # the plane has been told this peer is connected
        self._scratch: memoryview | None = None
        self._direct = False  # the last get_buffer handed out a frame body, not scratch
        self.last_active = time.monotonic()  # the last bytes read (idle connections close)
        self.retiring = False  # the close notice is written; reading until the peer closes

    @property
    def peer_id(self) -> str | None:
        """The peer this connection is attributed to, once the handshake has proven it."""
        return self.channel.peer_id

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses but have the same API.
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self.remote = f"{peer[0]}:{peer[1]}" if peer else "?"
        self.plane._configure(transport.get_extra_info("socket"))
        self.plane._inbound.add(self)
        if self.ticket is not None:
            self.ticket.close = self.close  # if evicted for a newcomer from elsewhere
        self.plane.stats["connections_in"] += 1
        if self.plane._reading_paused:
            self.transport.pause_reading()
        asyncio.get_running_loop().call_later(self.plane.limits.connect_timeout,
                                              self._hello_due)

    def _hello_due(self) -> None:
        if self.peer_id is None and not self.closed:
            self.plane._reject(self, f"no complete handshake within "
                               f"{self.plane.limits.connect_timeout:g}s", unauthorized=True,
                               kind="handshake_timeout")

    def get_buffer(self, sizehint: int) -> memoryview:
        direct = None if self.closed else self.channel.read_buffer()
        self._direct = direct is not None
        if direct is not None:
            return direct
        if self._scratch is None:
            self._scratch = memoryview(bytearray(_SCRATCH_BYTES))
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        if self.closed:
            return
        if not self._direct:
            assert self._scratch is not None
            # Fed and consumed before the next read reuses the scratch buffer.
            self.data_received(self._scratch[:nbytes])
            return
        self.last_active = time.monotonic()
        self.plane.stats["bytes_in"] += nbytes
        self.plane.stats["bytes_in_direct"] += nbytes
        try:
            self.channel.filled(nbytes)
        except RemoteProtocolError as exc:
            self._refuse(exc)

    def data_received(self, data: bytes | memoryview) -> None:
        if self.closed:
            return
        self.last_active = time.monotonic()
        self.plane.stats["bytes_in"] += len(data)
        try:
            for msg, size in self.channel.feed(data):
                self._dispatch(msg, size)
                if self.closed:
                    return
            self._handshake_progress()
            if not self.proven and self.peer_id is not None:
                self.proven = True
                self.plane.gone.pop(self.peer_id, None)
                if self.ticket is not None:
                    self.plane.gate.established(self.ticket)
                self.plane._close_idle()
        except RemoteProtocolError as exc:
            self._refuse(exc)

    def _refuse(self, exc: RemoteProtocolError) -> None:
        unauthorized = isinstance(exc, HandshakeError)
        self.plane._reject(self, exc.reason, unauthorized=unauthorized,
                           kind="unauthorized" if unauthorized else "malformed")

    def _handshake_progress(self) -> None:
        """Write what the handshake has to say (the HelloAck)."""
        assert self.transport is not None
        for frame in self.channel.outgoing:
            self.transport.write(frame)
        self.channel.outgoing.clear()

    def _dispatch(self, msg: Message, size: int) -> None:
        # The channel yields round messages only once the peer is proven.
        assert self.peer_id is not None
        self.plane.stats["frames_in"] += 1
        self.plane._route(self.peer_id, msg, size)

    def connection_lost(self, exc: Exception | None) -> None:
        self.plane._inbound.discard(self)
        if self.retiring:
            self.closed = True  # the sender closed as asked
        if not self.closed:
            self.closed = True
            reason = f"connection lost ({exc})" if exc else "connection closed"
            if self.peer_id is None and self.channel.claimed is not None:
                # Hung up after our HelloAck: most likely our proof (secret, identity) did
                # not satisfy it; an unauthorized attempt either way.
                self.plane._reject(self, f"handshake abandoned: {reason}", unauthorized=True,
                                   kind="abandoned")
            self.plane._peer_problem(self.peer_id, "gone", reason)
            if self.peer_id is not None and not self.plane._closed:
                self.plane.gone[self.peer_id] = time.monotonic()
        if self.ticket is not None:
            self.plane.gate.release(self.ticket)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def retire(self) -> None:
        """Ask the sender to close (module docstring); whatever it still writes is read."""
        assert self.transport is not None
        self.retiring = True
        self.transport.write(CLOSE_NOTICE)
        self._retire_due(time.monotonic())

    def _retire_due(self, since: float) -> None:
        """Close a retiring connection its sender has left open and silent for
        `connect_timeout` s since the notice (or its last bytes after the notice)."""
        if self.closed:
            return
        left = max(since, self.last_active) + self.plane.limits.connect_timeout \
            - time.monotonic()
        if left > 0:
            asyncio.get_running_loop().call_later(left, self._retire_due, since)
        else:
            self.close()


class _Outbound:
    """The persistent connection to one peer and the queue of frames to write on it."""

    def __init__(self, plane: DataPlane, peer_id: str, address: str) -> None:
        self.plane = plane
        self.peer_id = peer_id
        self.address = address
        self.queue: deque[tuple[FrameParts, asyncio.Future[None]]] = deque()
        self.wake = asyncio.Event()
        self.writer: asyncio.StreamWriter | None = None
        self.sealer: FrameSealer | None = None  # MACs frames on the current connection
        self.watch: asyncio.Task[None] | None = None
        self.task: asyncio.Task[None] | None = None  # the writer, started by the first frame

    def submit(self, frame: FrameParts) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self.queue.append((frame, fut))
        self.wake.set()
        if self.task is None or self.task.done():
            self.task = loop.create_task(self._run(), name=f"dataplane-send-{self.peer_id}")
        return fut

    async def _run(self) -> None:
        while True:
            if not self.queue:
                self.wake.clear()
                await self.wake.wait()
                continue
            frame, fut = self.queue.popleft()
            if fut.done():  # cancelled by its round: skip it
                continue
            try:
                await self._write(frame)
            except asyncio.CancelledError:
                fut.cancel()  # closing: whoever waits on this frame must not hang
                raise
            except (OSError, TimeoutError, ValueError) as exc:  # ValueError: bad address
                reason = one_line(f"{type(exc).__name__}: {exc}".rstrip(": "), 200)
                if not fut.done():
                    fut.set_exception(PeerUnreachable(reason))
                self._fail_all(reason)
                continue
            if not fut.done():
                fut.set_result(None)

    async def _write(self, frame: FrameParts) -> None:
        if self.writer is None or self.writer.is_closing():
            await self._connect()
        assert self.writer is not None and self.sealer is not None
        # One vectored write of the pieces and the tag: no frame is joined into one buffer.
        self.writer.writelines([*frame, self.sealer.seal(*frame)])
        await self.writer.drain()
        self.plane.stats["bytes_out"] += sum(len(p) for p in frame) + TAG_BYTES
        self.plane.stats["frames_out"] += 1

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A direct TCP connection, or else the plane's fallback stream if it has one; a
        peer that cannot be dialled (`DataPlane.skips_direct`) gets the stream at once."""
        plane = self.plane
        direct = plane.skips_direct(self.peer_id)
        if direct is None:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation
            # that races with the connect completing, and aclose() would then wait for a
            # live task.
            try:
                host, port = parse_address(self.address)
                async with asyncio.timeout(plane.limits.connect_timeout):
                    return await asyncio.open_connection(host, port, limit=_READ_LIMIT)
            except (OSError, TimeoutError, ValueError) as exc:
                if plane.fallback is None:
                    raise
                direct = one_line(f"{type(exc).__name__}: {exc}".rstrip(": "), 120)
            plane.stats["direct_failures"] += 1
            plane._direct_failed[self.peer_id] = time.monotonic()
            log.info("data plane %s: no direct connection to %s at %s (%s); trying a "
                     "libp2p stream", plane.peer_id, self.peer_id, self.address, direct)
        else:
            log.debug("data plane %s: %s: libp2p stream to %s", plane.peer_id, direct,
                      self.peer_id)
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(plane.limits.connect_timeout):
                pair = await plane.fallback(self.peer_id)
        except (OSError, TimeoutError) as exc:
            raise PeerUnreachable(f"direct: {direct}; libp2p stream: "
                                  f"{type(exc).__name__}: {exc}") from None
        plane.stats["fallback_connections"] += 1
        log.info("data plane %s: libp2p stream to %s open in %.2f s", plane.peer_id,
                 self.peer_id, time.monotonic() - t0)
        return pair

    async def _connect(self) -> None:
        reader, writer = await self._open()
        async with asyncio.timeout(self.plane.limits.connect_timeout):
            try:
                self.sealer = await self._handshake(reader, writer)
            except BaseException:
                writer.transport.abort()
                raise
        self.plane._configure(writer.get_extra_info("socket"))
        writer.transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER)
        self.writer = writer
        self.plane.stats["connections_out"] += 1
        self.watch = asyncio.get_running_loop().create_task(self._watch(reader, writer))

    async def _handshake(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> FrameSealer:
        """Prove ourselves to the peer and check that it is `peer_id`, proven and admitted."""
        plane = self.plane
        shake = OutboundHandshake(plane.auth, plane.run_id, plane.peer_id, self.peer_id)
        writer.write(shake.hello_frame())
        buf = bytearray()
        try:
            while (body := read_handshake_frame(buf)) is None:
                chunk = await reader.read(HANDSHAKE_FRAME_MAX)
                if not chunk:
                    raise ConnectionError("connection closed during the handshake")
                buf += chunk
            auth_frame, sealer = shake.on_ack(body)
        except RemoteProtocolError as exc:
            plane._count_unauthorized(isinstance(exc, HandshakeError))
            log.warning("data plane %s: refused peer %s at %s: %s", plane.peer_id,
                        self.peer_id, self.address, exc.reason)
            raise PeerUnreachable(f"handshake refused: {exc.reason}") from None
        writer.write(auth_frame)
        return sealer

    async def _watch(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The peer writes nothing on our connection but the close notice; without it, the
        end of the stream means the peer went away and frames still queued fail."""
        got = b""
        with contextlib.suppress(OSError):
            got = await reader.read(1)
        if self.writer is not writer:
            return
        if got:
            # Asked to close: what we wrote is still read; queued frames take a new one.
            self.writer = self.sealer = None
            await self._close_flushed(writer)
            return
        self._drop_connection()
        if self.queue:
            self._fail_all("connection closed by the peer")
        # else: nothing lost; the next frame reconnects

    async def _close_flushed(self, writer: asyncio.StreamWriter) -> None:
        writer.close()
        if not await bounded(writer.wait_closed(), self.plane.limits.connect_timeout):
            writer.transport.abort()

    def _drop_connection(self) -> None:
        if self.writer is not None:
            self.writer.transport.abort()
            self.writer = None
            self.sealer = None

    def _fail_all(self, reason: str) -> None:
        """Nothing queued can reach the peer on this connection; the next send reconnects."""
        self._drop_connection()
        self.plane.stats["send_failures"] += 1
        log.info("data plane %s: sending to %s at %s failed: %s", self.plane.peer_id,
                 self.peer_id, self.address, reason)
        while self.queue:
            _, fut = self.queue.popleft()
            if not fut.done():
                fut.set_exception(PeerUnreachable(reason))

    async def aclose(self, grace: float) -> None:
        """Let queued frames go out and flush the socket, each for up to `grace` s; close."""
        queued = [fut for _, fut in self.queue if not fut.done()]
        if queued and grace > 0:
            await asyncio.wait(queued, timeout=grace)
        if self.task is not None:
            self.task.cancel()
        if self.watch is not None:
            self.watch.cancel()
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.close()
            if not await bounded(writer.wait_closed(), grace):
                writer.transport.abort()
        for _, fut in self.queue:
            fut.cancel()
        self.queue.clear()
        if self.task is not None:
            await bounded(asyncio.shield(self.task), grace)


class DataPlane:
    """TCP server and client for round frames; see the module docstring.

    `limits` bounds frames, connection attempts, frames waiting for their round or in
    registered inboxes, and idle connections, and sets the sockets' buffers and congestion
    control (`PlaneLimits`, a docstring per field).
    `auth` holds this node's identity and the run's secret and allowlist; None runs the
    handshake in trust mode (made-up peer ids, tests and benchmarks only; see `channel`).
    `fallback(peer_id)`, if given, opens a stream by another path when a direct connection
    fails (`dilonode.swarm.tunnel`); the other side hands such streams to `accept_stream`.
    With a fallback, peers in `stream_only` (behind a NAT, as their records say) and peers
    a direct dial failed to within `limits.direct_retry` seconds get the stream without a
    dial first, so an undialable peer costs at most one `connect_timeout` per
    `direct_retry`. `gate` admits incoming connections (the node's
    `Admission.gate("data")`; None: a gate of its own with the default limits).
    """

    def __init__(self, peer_id: str, run_id: str, host: str = "127.0.0.1", port: int = 0, *,
                 limits: PlaneLimits | None = None, auth: Credentials | None = None,
                 fallback: StreamOpener | None = None, gate: Gate | None = None) -> None:
        Hello(run_id=run_id, peer_id=peer_id)  # validates both ids (ValidationError)
        if auth is not None and (auth.peer_id, auth.run_id) != (peer_id, run_id):
            raise ValueError(f"DataPlane: credentials of {auth.peer_id}@{auth.run_id} for "
                             f"{peer_id}@{run_id}")
        self.limits = limits if limits is not None else PlaneLimits()
        self._kernel: sockbuf.KernelLimits | None = None  # read at the first socket
        self.auth = auth
        self.fallback = fallback
        # Peers to reach by the fallback only (set by the node from peer records), and
        # when a direct dial to a peer last failed (time.monotonic()).
        self.stream_only: frozenset[str] = frozenset()
        self._direct_failed: dict[str, float] = {}
        self.peer_id = peer_id
        self.run_id = run_id
        self.host = host
        self.port = port
        self.gate = gate or Admission().gate("data")
        self.gate.log.logger = log  # its lines are logged as this module's
        self.stats: dict[str, int] = dict.fromkeys(
            ("bytes_in", "bytes_in_direct", "bytes_out", "frames_in", "frames_out",
             "connections_in", "connections_out", "rejected_connections", "rejected_hellos",
             "dropped_frames", "late_frames", "stray_frames", "send_failures", "unauthorized",
             "fallback_connections", "fallback_accepts", "idle_closed", "direct_failures"),
            0)
        self._acceptor: Acceptor | None = None
        self._rounds: dict[RoundKey, Inbox] = {}
        self._pending: dict[RoundKey, PendingFrames] = {}
        self._pending_bytes = 0
        self._recent: deque[RoundKey] = deque(maxlen=_RECENT_KEYS)
        self._inbound: set[_Inbound] = set()
        # Peers whose connection to us the peer closed, and when (time.monotonic()), until
        # they connect again: a SIGKILLed peer's DHT record outlives it, this does not.
        # Written on the loop; read from other threads as `gone.copy()`.
        self.gone: dict[str, float] = {}
        self._outbound: dict[str, _Outbound] = {}
        self._queued_total = 0
        self._reading_paused = False
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    @property
    def address(self) -> str:
        """"host:port" that peers connect to (the real port once started)."""
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        """Bind and listen (and `tune_allocator()` unless `tune_malloc` is False)."""
        if self.limits.tune_malloc:
            tune_allocator()
        if self._acceptor is not None:
            raise RuntimeError("DataPlane.start: already started")
        self._listen()
        log.debug("data plane %s listening on %s", self.peer_id, self.address)

    def _listen(self) -> None:
        # Configured before listen() so accepted sockets inherit it and the window scales.
        sock = bind_listener(self.host, self.port, configure=self._configure)
        self._acceptor = Acceptor(sock, self.gate, lambda ticket: _Inbound(self, ticket))
        self._acceptor.start()
        self.port = self._acceptor.port

    def reset_inbound(self) -> int:
        """Abort every accepted connection; returns how many (on the loop). After our
        listener was unreachable for a while, peers' connections to it sit in TCP
        retransmission backoff long after the path is back; reset, they connect afresh
        with their next frame."""
        conns = list(self._inbound)
        for conn in conns:
            conn.close()
        return len(conns)

    async def relisten(self) -> None:
        """Replace the listening socket by a new one on the same address (the node's
        supervisor, when the listener stopped accepting). Connections already accepted
        and outgoing ones are kept."""
        if self._closed:
            raise RuntimeError("DataPlane.relisten: closed")
        acceptor, self._acceptor = self._acceptor, None
        if acceptor is not None:
            acceptor.close()
        # The old socket may close on a later loop iteration: until then the port is still
        # taken (EADDRINUSE), so try again for a second.
        for _ in range(20):
            try:
                self._listen()
                return
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                await asyncio.sleep(0.05)
        self._listen()

    async def aclose(self, grace: float = 1.0) -> None:
        """Stop listening, flush outgoing frames for up to `grace` s, close everything."""
        self._closed = True
        if self._acceptor is not None:
            self._acceptor.close()
        await asyncio.gather(*(out.aclose(grace) for out in self._outbound.values()))
        self._outbound.clear()
        for conn in list(self._inbound):
            conn.close()
        for key in list(self._pending):
            self._drop_pending(key, None)
        for inbox in self._rounds.values():
            inbox._discard()

    async def __aenter__(self) -> DataPlane:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _configure(self, sock: socket.socket | None) -> None:
        if sock is None:
            return
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._kernel is None:
            self._kernel = sockbuf.limits()
        sockbuf.apply(sock, self.limits.socket_buffer_bytes, self._kernel)
        congestion.apply(sock, self.limits.tcp_congestion)

    # ------------------------------------------------------------------ rounds

    def register(self, key: RoundKey, members: Iterable[str]) -> Inbox:
        """Start receiving for round `key` from `members`; frames that came early are
        delivered first."""
        if key in self._rounds:
            raise RuntimeError(f"DataPlane.register: round {key} is already registered")
        inbox = Inbox(key, frozenset(members) - {self.peer_id}, self._queued)
        self._rounds[key] = inbox
        pending = self._pending.get(key)
        if pending is not None:
            for event in pending.events:
                if event.peer_id in inbox.members:
                    inbox.put(event)
                else:
                    self.stats["stray_frames"] += event.kind == "message"
            self._drop_pending(key, None)
        return inbox

    def skips_direct(self, peer_id: str) -> str | None:
        """Why a connection to `peer_id` goes straight to the fallback (None: dial first)."""
        if self.fallback is None:
            return None
        if peer_id in self.stream_only:
            return "peer is not dialable (behind a NAT)"
        failed = self._direct_failed.get(peer_id)
        if failed is not None and time.monotonic() - failed < self.limits.direct_retry:
            return f"direct dial failed {time.monotonic() - failed:.0f}s ago"
        return None

    def is_registered(self, key: RoundKey) -> bool:
        return key in self._rounds

    def unregister(self, key: RoundKey) -> None:
        """Stop receiving for `key`; later frames for it are dropped and counted."""
        inbox = self._rounds.pop(key, None)
        if inbox is not None:
            inbox._discard()
        self._recent.append(key)

    async def accept_stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                            remote: str) -> None:
        """Serve one incoming connection that arrived by another path than our listening
        socket (a libp2p stream): the same handshake and frames; returns when it ends."""
        ticket = None if self._closed else self.gate.admit(remote)
        if ticket is None:
            writer.transport.abort()
            return
        conn = _Inbound(self, ticket)
        conn.connection_made(writer.transport)
        conn.remote = remote
        self.stats["fallback_accepts"] += 1
        error: Exception | None = None
        try:
            while not conn.closed and (data := await reader.read(_READ_LIMIT)):
                conn.data_received(data)
        except OSError as exc:
            error = exc
        finally:
            if not conn.closed:
                writer.transport.abort()
            conn.connection_lost(error)

    def send(self, peer_id: str, address: str,
             frame: bytes | FrameParts) -> asyncio.Future[None]:
        """Queue `frame` (bytes, or pieces as `encode_frame_parts` makes them) to `peer_id`
        at `address` ("host:port").

        The future resolves once the frame is handed to the socket, or fails with
        `PeerUnreachable`; cancel it to skip a frame that was not written yet. Frames to one
        peer are written in order, each peer's queue by its own task.
        """
        if self._closed:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            fut.set_exception(PeerUnreachable("data plane closed"))
            return fut
        out = self._outbound.get(peer_id)
        if out is None or out.address != address:
            if out is not None:
                asyncio.get_running_loop().create_task(out.aclose(0.0))
            out = self._outbound[peer_id] = _Outbound(self, peer_id, address)
            self._forget_closed_outbound()
        return out.submit((frame,) if isinstance(frame, bytes) else frame)

    def _busy_peers(self) -> set[str]:
        """Peers a registered round or frames waiting for one involve."""
        busy = {p for inbox in self._rounds.values() for p in inbox.members}
        return busy | {p for pending in self._pending.values() for p in pending.peers}

    def _close_idle(self) -> None:
        """Above `max_idle_inbound` open connections, close idle ones (module docstring)."""
        bound, idle_s = self.limits.max_idle_inbound, self.limits.idle_close_s
        open_ = [c for c in self._inbound if not c.closed and not c.retiring]
        if not bound or len(open_) <= bound:
            return
        busy, now = self._busy_peers(), time.monotonic()
        idle = sorted((c for c in open_ if c.peer_id is not None and c.peer_id not in busy
                       and now - c.last_active >= idle_s), key=lambda c: c.last_active)
        for conn in idle[:len(open_) - bound]:
            self.stats["idle_closed"] += 1
            conn.retire()

    def _forget_closed_outbound(self) -> None:
        """Above `max_idle_inbound` peers, drop connection objects with nothing queued
        whose socket the peer closed (a later frame builds a new one)."""
        bound = self.limits.max_idle_inbound
        if not bound or len(self._outbound) <= bound:
            return
        busy = self._busy_peers()
        for peer, out in list(self._outbound.items()):
            if out.writer is None and not out.queue and peer not in busy:
                del self._outbound[peer]
                asyncio.get_running_loop().create_task(out.aclose(0.0))

    # ------------------------------------------------------------------ routing

    def _route(self, peer_id: str, msg: Message, size: int) -> None:
        assert not isinstance(msg, Hello)
        key = (msg.fragment, msg.round, msg.attempt)
        inbox = self._rounds.get(key)
        if inbox is not None:
            if peer_id in inbox.members:
                inbox.put(PeerEvent(peer_id, "message", msg, size))
            else:
                self.stats["stray_frames"] += 1
                log.debug("data plane %s: dropped a %s for round %s from non-member %s",
                          self.peer_id, msg.type, key, peer_id)
        elif key in self._recent:
            self.stats["late_frames"] += 1
        else:
            self._hold(key, PeerEvent(peer_id, "message", msg, size))

    def _hold(self, key: RoundKey, event: PeerEvent) -> None:
        pending = self._pending.get(key)
        if pending is None:
            if len(self._pending) >= self.limits.max_pending_keys:
                self._overflow(key, None, "too many rounds waiting to be registered")
                return
            pending = self._pending[key] = PendingFrames()
            pending.expiry = asyncio.get_running_loop().call_later(
                self.limits.pending_ttl, self._drop_pending, key, "no round registered in time")
        if (len(pending.events) >= self.limits.max_pending_frames
                or self._pending_bytes + event.frame_bytes > self.limits.max_pending_bytes):
            self._overflow(key, pending, "early-frame buffer full")
            return
        pending.events.append(event)
        pending.nbytes += event.frame_bytes
        pending.peers.add(event.peer_id)
        self._pending_bytes += event.frame_bytes

    def _overflow(self, key: RoundKey, pending: PendingFrames | None, reason: str) -> None:
        self.stats["dropped_frames"] += 1
        if pending is None or not pending.overflowed:
            # Proven peers' frames, but a peer can still send them on purpose: aggregated.
            self.gate.log.event("dropped_frames", "peers", f"data plane {self.peer_id}: "
                                f"dropping frames for round {key}: {reason}", key=str(key))
        if pending is not None:
            pending.overflowed = True

    def _drop_pending(self, key: RoundKey, reason: str | None) -> None:
        pending = self._pending.pop(key, None)
        if pending is None:
            return
        if pending.expiry is not None:
            pending.expiry.cancel()
        self._pending_bytes -= pending.nbytes
        frames = sum(e.kind == "message" for e in pending.events)
        if reason is not None and frames:
            self.stats["dropped_frames"] += frames
            self.gate.log.event("dropped_frames", "peers", f"data plane {self.peer_id}: "
                                f"dropped {frames} frame(s) for round {key}: {reason}",
                                key=str(key))

    def _peer_problem(self, peer_id: str | None, kind: EventKind, reason: str) -> None:
        """Tell every round that involves `peer_id`, registered or waiting, about it."""
        if peer_id is None:
            return
        event = PeerEvent(peer_id, kind, reason=reason)
        for inbox in self._rounds.values():
            if peer_id in inbox.members:
                inbox.put(event)
        for pending in self._pending.values():
            if peer_id in pending.peers:  # its frames there may be incomplete now
                pending.events.append(event)

    @property
    def unauthorized_attempts(self) -> int:
        """Connections refused for failing authentication or authorization, either way."""
        return self.stats["unauthorized"]

    def _count_unauthorized(self, unauthorized: bool) -> None:
        self.stats["unauthorized"] += unauthorized

    def _reject(self, conn: _Inbound, reason: str, *, unauthorized: bool = False,
                kind: str = "malformed") -> None:
        """A peer sent something we cannot accept: count, log (aggregated by the gate:
        `kind` is the reason it counts under), close, report.

        Only a proven peer is reported to rounds: a claimed id could be anyone's.
        """
        claimed = conn.channel.claimed
        who = conn.peer_id or (f"unproven {one_line(claimed, 64)}" if claimed
                               else "an unidentified peer")
        self.gate.closing(conn.ticket, kind, f"data plane {self.peer_id}: rejected connection "
                          f"from {who} ({conn.remote}): {self.gate.log.cap(reason)}",
                          key=who)
        self.stats["rejected_connections"] += 1
        self._count_unauthorized(unauthorized)
        if conn.peer_id is None:
            self.stats["rejected_hellos"] += 1
        conn.close()
        self._peer_problem(conn.peer_id, "error", reason)

    # ------------------------------------------------------------------ flow control

    def _queued(self, delta: int) -> None:
        """Pause every socket while registered inboxes hold too much, resume at half."""
        self._queued_total += delta
        bound = self.limits.max_queued_bytes
        if not self._reading_paused and self._queued_total > bound:
            self._reading_paused = True
            for conn in self._inbound:
                if conn.transport is not None and not conn.closed:
                    conn.transport.pause_reading()
        elif self._reading_paused and self._queued_total <= bound // 2:
            self._reading_paused = False
            for conn in self._inbound:
                if conn.transport is not None and not conn.closed:
                    conn.transport.resume_reading()
