"""The parts of a node that its supervisor watches (`dilonode.node.supervisor`), as thin adapters
over objects the node already holds. `Node.start()` builds them with `node_parts(...)`.

* `DHTPart` ("dht"): the hivemind DHT process and its p2pd (`SwarmDHT.health`/`restart`).
  After a restart it runs the node's hooks: re-attach the libp2p tunnel to the new p2pd and
  re-publish our peer record; a hook that failed keeps the part down (and is retried at the
  next restart) rather than leaving the node healed in name only.
* `ListenerPart` ("data", "state", "status"): a TCP listener on the node's network loop.
  Healthy when the loop answers and a connection to the listener's address opens within
  the deadline: that fails for a destroyed listening socket (refused), a filtered or
  wedged one (no answer) and a stuck loop. Restarted in place, on the same port.

A probe connects and closes without a word: the data plane counts it in
`stats["connections_in"]`, the state server and the status server ignore it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from dilonode.node.supervisor import PartDown
from dilonode.wire.errors import one_line

__all__ = ["DHTPart", "ListenerPart", "node_parts", "probe_address"]

log = logging.getLogger(__name__)

Hook = Callable[[], None]


class DHTPart:
    """The DHT process and its p2pd, restarted together (p2pd is the DHT process's child)."""

    name = "dht"

    def __init__(self, dht: Any, after_restart: Sequence[tuple[str, Hook]] = ()) -> None:
        self.dht = dht
        self.hooks = list(after_restart)
        self._owed: list[tuple[str, Hook]] = []  # hooks that failed after the last restart

    def health(self, timeout: float) -> None:
        self.dht.health(timeout)
        if self._owed:
            names = ", ".join(name for name, _ in self._owed)
            raise PartDown(f"DHT restarted but not yet: {names}")

    def restart(self, timeout: float) -> None:
        if self._owed and self._dht_ok(timeout):
            self._run_hooks(self._owed)  # the process is fine: finish what failed last time
            return
        self.dht.restart(timeout)
        self._run_hooks(self.hooks)

    def _dht_ok(self, timeout: float) -> bool:
        try:
            self.dht.health(timeout)
        except Exception:
            return False
        return True

    def _run_hooks(self, hooks: list[tuple[str, Hook]]) -> None:
        owed = []
        for name, hook in hooks:
            try:
                hook()
            except Exception as exc:
                owed.append((name, hook))
                log.warning("after the DHT restart, %s failed: %s", name, one_line(str(exc)))
        self._owed = owed
        if owed:
            raise PartDown("after the DHT restart: " + ", ".join(n for n, _ in owed) + " failed")


class ListenerPart:
    """A listener on the node's network loop (`thread`, a `LoopThread`)."""

    def __init__(self, name: str, thread: Any, address: Callable[[], str],
                 relisten: Callable[[], Awaitable[None]]) -> None:
        self.name, self.thread = name, thread
        self.address = address
        self.relisten = relisten

    def health(self, timeout: float) -> None:
        addr = self.address()
        try:
            self.thread.run(probe_address(addr, timeout), timeout=timeout + 0.5)
        except (TimeoutError, concurrent.futures.TimeoutError):
            raise PartDown(f"{self.name} listener {addr}: no connection within "
                           f"{timeout:g}s", certain=False) from None
        except OSError as exc:
            raise PartDown(f"{self.name} listener {addr}: {exc.strerror or exc}") from None

    def restart(self, timeout: float) -> None:
        self.thread.run(asyncio.wait_for(self.relisten(), timeout), timeout=timeout + 0.5)


async def probe_address(address: str, timeout: float) -> None:
    """Open a TCP connection to `address` ("host:port") within `timeout` s, then close it.
    A wildcard host is probed on loopback."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout)
    writer.transport.abort()  # no FIN handshake to wait for


def node_parts(node: Any) -> list[Any]:
    """The parts of a started `dilonode.node.daemon.Node`: its DHT, data plane listener, state
    server (when it serves state) and status server (when enabled)."""
    thread = node.collective.thread
    hooks: list[tuple[str, Hook]] = []
    if node.tunnel is not None:
        tunnel = node.tunnel
        hooks.append(("re-attaching the libp2p tunnel", lambda: thread.run(
            tunnel.reattach(node.dht.p2p_daemon_maddr()), timeout=30.0)))
    hooks.append(("re-publishing our peer record", node.membership.publish))
    plane = node.collective.plane
    parts: list[Any] = [DHTPart(node.dht, hooks),
                        ListenerPart("data", thread, lambda: plane.address, plane.relisten)]
    if (state := node.keeper.server) is not None:
        parts.append(ListenerPart("state", thread, lambda: state.address,
                                  functools.partial(_relisten_state, state)))
    if (status := node.status_server) is not None:
        parts.append(ListenerPart("status", thread, lambda: f"{status.host}:{status.port}",
                                  functools.partial(_relisten_status, status)))
    return parts


async def _relisten_state(server: Any) -> None:
    """The state server again, on the port it had (joiners read it from our record)."""
    port = int(server.address.rsplit(":", 1)[1])
    await server.aclose()
    server.cfg = server.cfg.model_copy(update={"port": port})
    await _rebind(server.start)


async def _relisten_status(server: Any) -> None:
    """The status server again on the same port (`StatusServer.start` keeps it)."""
    await server.aclose()
    await _rebind(server.start)


async def _rebind(start: Callable[[], Awaitable[Any]], tries: int = 20) -> None:
    """`start()` again while the old listening socket is still closing: uvloop closes it on
    a later loop iteration, and until then binding the port fails (EADDRINUSE; the status
    server reports that as a ValueError naming the port)."""
    for _ in range(tries - 1):
        try:
            await start()
            return
        except (OSError, ValueError) as exc:
            if isinstance(exc, OSError) and exc.errno != errno.EADDRINUSE:
                raise
            await asyncio.sleep(0.05)
    await start()
