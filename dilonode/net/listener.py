"""The accept loop every listening port of a node runs: admission first, EMFILE backs off.

    sock = bind_listener(host, port)
    acceptor = Acceptor(sock, gate, factory)   # factory(ticket) -> the connection's protocol
    acceptor.start()                           # on the running loop
    ...
    acceptor.close()

`Acceptor` accepts on a non-blocking listening socket itself rather than through
`loop.create_server`, for two reasons. A connection the `Gate` refuses (a cap reached) is
closed right after `accept()`, before any protocol object or read buffer exists. And when
the process is out of descriptors (EMFILE/ENFILE), accepting pauses for a while, doubling
up to `backoff_max`, with one aggregated log line, instead of asyncio's ERROR traceback
every second or libuv's accept-and-drop loop; nothing else breaks, and it resumes by
itself. Admitted connections are handed to `loop.connect_accepted_socket` with the
protocol `factory(ticket)` makes; the protocol releases the ticket when it closes.

The acceptor also flushes its gate's `PeerLog` every `flush_every` seconds, so a burst's
summary line is written even when nothing follows it.
"""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Callable

from dilonode.net.admission import Gate, Ticket

__all__ = ["Acceptor", "ProtocolFactory", "bind_listener"]

ProtocolFactory = Callable[[Ticket], asyncio.BaseProtocol]

_OUT_OF_FDS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_ACCEPT_BATCH = 64  # accepts per wake-up, so a flood cannot hold the loop for long


def bind_listener(host: str, port: int, *, backlog: int = 256,
                  configure: Callable[[socket.socket], None] | None = None) -> socket.socket:
    """A non-blocking listening TCP socket on (host, port); `configure` runs before bind
    (options set there are inherited by accepted sockets). OSError if it cannot bind."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                               flags=socket.AI_PASSIVE)
    # A name ("localhost") or no host listens on IPv4; an IPv6 literal on IPv6.
    v6 = ":" in (host or "")
    family, kind, proto, _, addr = min(infos, key=lambda i: (i[0] == socket.AF_INET) == v6)
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if configure is not None:
            configure(sock)
        sock.bind(addr)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _source(addr: object) -> str:
    """The address part of what accept() returned (the port changes per connection)."""
    return str(addr[0]) if isinstance(addr, tuple) and addr else str(addr or "?")


class Acceptor:
    """Accepts connections on `sock` through `gate`; see the module docstring."""

    def __init__(self, sock: socket.socket, gate: Gate, factory: ProtocolFactory, *,
                 flush_every: float = 5.0, backoff_min: float = 0.05,
                 backoff_max: float = 2.0) -> None:
        self.sock, self.gate, self.factory = sock, gate, factory
        self.flush_every = flush_every
        self.backoff_min, self.backoff_max = backoff_min, backoff_max
        self._backoff = backoff_min
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._attaching: set[asyncio.Task[object]] = set()
        self._reading = False
        self.paused = 0  # times accepting paused for lack of descriptors
        self.closed = False

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def start(self) -> None:
        """Start accepting (on the running loop)."""
        self._loop = asyncio.get_running_loop()
        self._resume()
        self._timers["flush"] = self._loop.call_later(self.flush_every, self._flush)

    def close(self) -> None:
        """Stop accepting and close the listening socket; connections already handed to
        their protocol stay open, those still being attached are closed."""
        if self.closed:
            return
        self.closed = True
        self._stop_reading()
        for timer in self._timers.values():
            timer.cancel()
        for task in self._attaching:  # else a connection could outlive its listener
            task.cancel()
        self.sock.close()
        self.gate.log.flush(force=True)

    # -- accepting -------------------------------------------------------------------------
    def _resume(self) -> None:
        self._timers.pop("resume", None)
        if not self.closed and not self._reading:
            assert self._loop is not None
            self._loop.add_reader(self.sock.fileno(), self._on_readable)
            self._reading = True

    def _stop_reading(self) -> None:
        if self._reading and self._loop is not None:
            self._loop.remove_reader(self.sock.fileno())
            self._reading = False

    def _on_readable(self) -> None:
        for _ in range(_ACCEPT_BATCH):
            try:
                conn, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:  # the client gave up while in the backlog
                continue
            except OSError as exc:
                if exc.errno in _OUT_OF_FDS:
                    self._pause(exc)
                    return
                raise
            self._backoff = self.backoff_min
            self._admit(conn, _source(addr))

    def _admit(self, conn: socket.socket, source: str) -> None:
        ticket = self.gate.admit(source)
        if ticket is None:
            conn.close()
            return
        conn.setblocking(False)
        assert self._loop is not None
        task = self._loop.create_task(self._attach(conn, ticket))
        self._attaching.add(task)
        task.add_done_callback(self._attaching.discard)

    async def _attach(self, conn: socket.socket, ticket: Ticket) -> None:
        assert self._loop is not None
        try:
            await self._loop.connect_accepted_socket(lambda: self.factory(ticket), conn)
        except (OSError, RuntimeError, asyncio.CancelledError):
            # reset before we got to it, the loop closing, or the listener closed
            conn.close()
            self.gate.release(ticket)

    def _pause(self, exc: OSError) -> None:
        """Out of descriptors: stop accepting for a while (the kernel keeps the backlog)."""
        self.paused += 1
        self._stop_reading()
        delay, self._backoff = self._backoff, min(self._backoff * 2, self.backoff_max)
        self.gate.refuse_counted("fd_limit", "local", f"{self.gate.port} port: out of file "
                                 f"descriptors ({exc.strerror or exc}): accepting paused "
                                 f"for {delay:.2f} s")
        assert self._loop is not None
        self._timers["resume"] = self._loop.call_later(delay, self._resume)

    def _flush(self) -> None:
        self.gate.log.flush()
        if not self.closed:
            assert self._loop is not None
            self._timers["flush"] = self._loop.call_later(self.flush_every, self._flush)

