"""`StatusServer`: the read-only HTTP endpoint of a node or a bootstrap peer (aiohttp).

Routes (GET and HEAD only; any other method gets 405 with an `Allow` header, any other path
404):

* `/`          the dashboard (one HTML page shipped with the package, no external resources)
* `/status`    the source's snapshot as JSON
* `/history`   the source's ring buffer as JSON (the dashboard's charts)
* `/metrics`   Prometheus text format

The server runs on an event loop the caller owns (the node's network `LoopThread`): the
constructor does no I/O, `await start()` binds and returns the base URL, `await aclose()`
stops it. Handlers only call the source's `snapshot()`/`history()`, which copy values under
a short lock, so serving never blocks training and never changes any state.

The port may face the internet, so it is admitted like the node's other ports
(`dilonode.net.listener.Acceptor` and a `Gate`, `dilonode.net.admission`): every connection counts
as unauthenticated (there is no authentication here), so the per-address and per-port caps
hold for its whole life. `_Guard` sits in front of aiohttp's handler: a connection must
send its first request head within `handshake_timeout` seconds and in `max_head_bytes`,
else it is closed before aiohttp parses anything; after that aiohttp closes it once idle
for `keepalive_timeout`. Bad requests are logged by `_HttpLog` through the gate's
aggregator: one capped line naming the peer and the error class, never the request bytes.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping
from functools import cache
from importlib import resources
from typing import Any, Protocol, cast

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from dilonode.net.admission import Admission, Gate, Ticket
from dilonode.net.listener import Acceptor, bind_listener
from dilonode.status.metrics import CONTENT_TYPE, Metric, render

__all__ = ["StatusServer", "StatusSource", "dashboard_html"]

log = logging.getLogger(__name__)

ALLOWED = ("GET", "HEAD")
# The page is self-contained: forbid every origin but our own, so a missing inline asset or a
# stray CDN link fails loudly in the browser instead of leaking requests.
_CSP = ("default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "img-src 'self' data:; connect-src 'self'")


class StatusSource(Protocol):
    """What a status server reads; both methods return JSON-ready dicts and never block."""

    def snapshot(self) -> dict[str, Any]: ...

    def history(self) -> dict[str, Any]: ...


@cache
def dashboard_html() -> bytes:
    """The dashboard page, read once from the package data."""
    return resources.files("dilonode.status").joinpath("dashboard.html").read_bytes()


class StatusServer:
    """Serves one `StatusSource`; `metrics(snapshot)` turns a snapshot into metric families.

    `gate` admits connections (the node's `Admission.gate("status")`; None: a gate of its
    own with the default limits); `handshake_timeout`, `keepalive_timeout` and
    `max_head_bytes` are described in the module docstring.
    """

    def __init__(self, source: StatusSource,
                 metrics: Callable[[Mapping[str, Any]], list[Metric]], *,
                 host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float = 1.0,
                 gate: Gate | None = None, handshake_timeout: float = 5.0,
                 keepalive_timeout: float = 15.0, max_head_bytes: int = 16 << 10) -> None:
        self.source, self.metrics = source, metrics
        self.host, self.port = host, port
        self.url = ""
        self.gate = gate or Admission().gate("status")
        self.gate.log.logger = log
        self.handshake_timeout, self.keepalive_timeout = handshake_timeout, keepalive_timeout
        self.max_head_bytes = max_head_bytes
        self._shutdown_timeout = shutdown_timeout
        self._runner: web.AppRunner | None = None
        self._acceptor: Acceptor | None = None

    def _app(self) -> web.Application:
        app = web.Application()
        routes = {"/": self._dashboard, "/status": self._status, "/history": self._history,
                  "/metrics": self._metrics}
        for path, handler in routes.items():
            app.router.add_route("*", path, _read_only(handler))
        return app

    async def start(self) -> str:
        """Bind and serve; returns the base URL ("http://host:port")."""
        if self._runner is not None:
            raise RuntimeError("StatusServer.start: already started")
        runner = web.AppRunner(self._app(), access_log=None,
                               shutdown_timeout=self._shutdown_timeout,
                               keepalive_timeout=self.keepalive_timeout,
                               logger=_HttpLog(self.gate), max_headers=32)
        await runner.setup()
        try:
            sock = bind_listener(self.host, self.port)
        except OSError as exc:
            await runner.cleanup()
            raise ValueError(f"status endpoint: cannot listen on {self.host}:{self.port} "
                             f"(status.host/status.port): {exc.strerror or exc}") from None
        self._runner = runner
        self._acceptor = Acceptor(sock, self.gate, self._protocol)
        self._acceptor.start()
        host, self.port = sock.getsockname()[:2]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{self.port}"
        log.info("status endpoint: %s", self.url)
        return self.url

    def _protocol(self, ticket: Ticket) -> asyncio.Protocol:
        assert self._runner is not None and self._runner.server is not None
        handler = cast(asyncio.Protocol, self._runner.server())
        return _Guard(handler, self.gate, ticket, deadline=self.handshake_timeout,
                      max_head=self.max_head_bytes, keepalive=self.keepalive_timeout)

    async def aclose(self) -> None:
        acceptor, self._acceptor = self._acceptor, None
        if acceptor is not None:
            acceptor.close()
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    # -- handlers --------------------------------------------------------------------------
    async def _dashboard(self, _req: web.Request) -> web.Response:
        return web.Response(body=dashboard_html(), content_type="text/html", charset="utf-8",
                            headers={"Content-Security-Policy": _CSP, **_NO_STORE})

    async def _status(self, _req: web.Request) -> web.Response:
        return _json(self.source.snapshot())

    async def _history(self, _req: web.Request) -> web.Response:
        return _json(self.source.history())

    async def _metrics(self, _req: web.Request) -> web.Response:
        text = render(self.metrics(self.source.snapshot()))
        return web.Response(text=text, headers={"Content-Type": CONTENT_TYPE, **_NO_STORE})


_NO_STORE = {"Cache-Control": "no-store"}
Handler = Callable[[web.Request], Any]


def _read_only(handler: Handler) -> Handler:
    async def wrapped(request: web.Request) -> web.StreamResponse:
        if request.method not in ALLOWED:
            raise web.HTTPMethodNotAllowed(request.method, list(ALLOWED))
        response: web.StreamResponse = await handler(request)
        return response
    return wrapped


def _json(data: dict[str, Any]) -> web.Response:
    # allow_nan=False: a NaN that slipped through is our bug, and browsers reject it anyway.
    return web.Response(text=json.dumps(data, allow_nan=False), content_type="application/json",
                        headers=_NO_STORE)


class _Guard(asyncio.Protocol):
    """aiohttp's handler for one connection, behind a deadline and a size cap on the first
    request head (see the module docstring); releases the connection's admission ticket
    when it closes, counting why we closed it."""

    def __init__(self, inner: asyncio.Protocol, gate: Gate, ticket: Ticket, *,
                 deadline: float, max_head: int, keepalive: float) -> None:
        self.inner, self.gate, self.ticket = inner, gate, ticket
        self.deadline, self.max_head, self.keepalive = deadline, max_head, keepalive
        self.transport: asyncio.Transport | None = None
        self.remote = "?"
        self.head_seen = 0  # bytes received before the first complete request head
        self.head_done = False
        self._tail = b""  # last bytes of the previous read: "\r\n\r\n" may straddle two
        self._last_data = 0.0
        self._eof = False
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self.remote = str(peer[0]) if peer else "?"
        self.ticket.close = self.transport.abort  # if evicted for a newcomer from elsewhere
        loop = asyncio.get_running_loop()
        self._last_data = loop.time()
        self._timer = loop.call_later(self.deadline, self._too_slow)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.ticket.released:  # closed by us; aiohttp must not see what follows
            return
        self._last_data = asyncio.get_running_loop().time()
        if not self.head_done and not self._watch_head(data):
            return
        self.inner.data_received(data)

    def _watch_head(self, data: bytes) -> bool:
        """Track the first request head; False when the connection was closed for it."""
        window = self._tail + data
        end = window.find(b"\r\n\r\n")
        if end >= 0:
            self.head_seen += end + 4 - len(self._tail)
            self.head_done = True
            if self._timer is not None:
                self._timer.cancel()
        else:
            self.head_seen += len(data)
            self._tail = window[-3:]
        if self.head_seen > self.max_head:
            self._close("oversized", f"status port: closed a connection from {self.remote}: "
                        f"request head over {self.max_head} bytes")
            return False
        return True

    def _too_slow(self) -> None:
        if not self.head_done and not self.ticket.released:
            self._close("handshake_timeout", f"status port: closed a connection from "
                        f"{self.remote}: no request within {self.deadline:g} s")

    def _close(self, reason: str, text: str) -> None:
        self.gate.closing(self.ticket, reason, text)
        assert self.transport is not None
        self.transport.abort()

    def eof_received(self) -> bool | None:
        self._eof = True
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if not self.ticket.released and not self._eof and exc is None and self.head_done:
            idle = asyncio.get_running_loop().time() - self._last_data
            if idle >= self.keepalive * 0.9:  # aiohttp's keep-alive deadline closed it
                self.gate.closing(self.ticket, "idle", f"status port: closed an idle "
                                  f"connection from {self.remote}")
        self.gate.release(self.ticket)
        self.inner.connection_lost(exc)


class _HttpLog:
    """The logger aiohttp's request handlers use: a peer's malformed request becomes one
    aggregated line through the gate (the peer and the error class, never the bytes it
    sent, which aiohttp would quote at length); our own errors go to our logger."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    def _peer_error(self, args: tuple[Any, ...], kw: dict[str, Any]) -> bool:
        exc = kw.get("exc_info")
        if not isinstance(exc, HttpProcessingError):
            return False
        remote = self.gate.log.cap(args[0] if args else "?", 64)
        self.gate.closing(None, "malformed", f"status port: bad request from {remote} "
                          f"({type(exc).__name__}, HTTP {exc.code})", source=remote)
        return True

    def debug(self, msg: str, *args: Any, **kw: Any) -> None:
        if not self._peer_error(args, kw):
            log.debug(msg, *args, **kw)

    def info(self, msg: str, *args: Any, **kw: Any) -> None:
        log.info(msg, *args, **kw)

    def warning(self, msg: str, *args: Any, **kw: Any) -> None:
        if not self._peer_error(args, kw):
            log.warning(msg, *args, **kw)

    def error(self, msg: str, *args: Any, **kw: Any) -> None:
        if not self._peer_error(args, kw):
            log.error(msg, *args, **kw)

    def exception(self, msg: str, *args: Any, **kw: Any) -> None:
        kw.setdefault("exc_info", True)
        if not self._peer_error(args, kw):
            log.error(msg, *args, **kw)
