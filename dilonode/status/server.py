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
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from functools import cache
from importlib import resources
from typing import Any, Protocol

from aiohttp import web

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
    """Serves one `StatusSource`; `metrics(snapshot)` turns a snapshot into metric families."""

    def __init__(self, source: StatusSource,
                 metrics: Callable[[Mapping[str, Any]], list[Metric]], *,
                 host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float = 1.0) -> None:
        self.source, self.metrics = source, metrics
        self.host, self.port = host, port
        self.url = ""
        self._shutdown_timeout = shutdown_timeout
        self._runner: web.AppRunner | None = None

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
                               shutdown_timeout=self._shutdown_timeout)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.port).start()
        except OSError as exc:
            await runner.cleanup()
            raise ValueError(f"status endpoint: cannot listen on {self.host}:{self.port} "
                             f"(status.host/status.port): {exc.strerror or exc}") from None
        self._runner = runner
        host, port = runner.addresses[0][:2]
        self.port = port
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        log.info("status endpoint: %s", self.url)
        return self.url

    async def aclose(self) -> None:
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
