"""libp2p-stream fallback of the data plane, for peers that cannot reach each other's TCP
data address (NAT, firewalls): the same frames, through the DHT's go-libp2p daemon.

`Tunnel` connects a second client to the p2pd that `SwarmDHT` already runs (hivemind's
`P2P.replicate`), so there is no second daemon and no second identity: a stream reaches
the peer id used in member lists. It registers a stream handler that hands incoming
streams to `DataPlane.accept_stream`, and offers `open(peer_id)` as the plane's
`fallback`, tried when a direct connection fails. Over either path the plane runs the same
authenticating handshake and per-frame MACs (`dilonode.allreduce.channel`); libp2p's own
transport security comes on top. Bulk data costs more CPU this way (docs/benchmarks.md), so
it is only the fallback.

Usage, on the plane's event loop::

    tunnel = Tunnel(dht.p2p_daemon_maddr(), run_id)
    await tunnel.start(plane)          # then DataPlane(..., fallback=tunnel.open)
    ...
    await tunnel.aclose()

`import hivemind` happens in `start()`, never at module import.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from dilonode.allreduce.transport import DataPlane

__all__ = ["Tunnel", "stream_name"]

log = logging.getLogger(__name__)

_OP_TIMEOUT = 10.0  # seconds for one daemon request (attach, register, open a stream)


def stream_name(run_id: str) -> str:
    """The libp2p stream handler of a run's data plane (runs never share a handler)."""
    return f"dilonode/{run_id}/data/v3"


class Tunnel:
    """A client of the DHT's p2pd that carries data-plane connections over libp2p streams."""

    def __init__(self, daemon_maddr: Any, run_id: str) -> None:
        self.daemon_maddr = daemon_maddr
        self.name = stream_name(run_id)
        self._p2p: Any = None
        self._streams: set[asyncio.Task[None]] = set()

    async def start(self, plane: DataPlane) -> None:
        """Attach to the daemon and accept streams into `plane`."""
        from hivemind.p2p import P2P

        self._p2p = await asyncio.wait_for(P2P.replicate(self.daemon_maddr), _OP_TIMEOUT)

        async def on_stream(info: Any, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            self._streams.add(task)
            try:
                await plane.accept_stream(reader, writer, f"libp2p:{info.peer_id}")
            except asyncio.CancelledError:
                # aclose() cancelled it. End the handler task normally: on Python 3.11
                # asyncio's stream server calls exception() on a cancelled handler task
                # and logs the CancelledError it raises as an error.
                return
            finally:
                self._streams.discard(task)

        await asyncio.wait_for(self._p2p.add_binary_stream_handler(self.name, on_stream),
                               _OP_TIMEOUT)

    async def open(self, peer_id: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A stream to `peer_id`'s data plane (the plane's `fallback`)."""
        from hivemind.p2p import PeerID

        if self._p2p is None:
            raise ConnectionError("libp2p tunnel not started")
        try:
            _, reader, writer = await asyncio.wait_for(
                self._p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), self.name),
                _OP_TIMEOUT)
        except (ValueError, KeyError) as exc:  # not a base58 peer id
            raise ConnectionError(f"no libp2p stream to {peer_id!r}: {exc}") from None
        except Exception as exc:  # p2pd reports failures as its own error types
            if isinstance(exc, OSError | TimeoutError):
                raise
            raise ConnectionError(f"no libp2p stream to {peer_id}: {exc}") from None
        return reader, writer

    async def aclose(self) -> None:
        """Stop accepting streams and detach from the daemon (which keeps running)."""
        p2p, self._p2p = self._p2p, None
        if p2p is None:
            return
        for task in list(self._streams):
            task.cancel()
        try:
            await asyncio.wait_for(p2p.remove_binary_stream_handler(self.name), _OP_TIMEOUT)
        except Exception as exc:  # the daemon may already be gone with the DHT
            log.debug("removing the libp2p stream handler failed: %s", exc)
        await asyncio.wait_for(p2p.shutdown(), _OP_TIMEOUT)
