"""libp2p-stream fallback of the data plane and of state sync, for peers that cannot reach
each other's TCP addresses (NAT, firewalls): the same bytes, through the DHT's go-libp2p
daemon.

`Tunnel` connects a second client to the p2pd that `SwarmDHT` already runs (hivemind's
`P2P.replicate`), so there is no second daemon and no second identity: a stream reaches
the peer id used in member lists. It registers a stream handler that hands incoming
streams to `DataPlane.accept_stream` (and, with `serve_state`, one for the state server's
`accept_stream`), and offers `open(peer_id)` as the plane's `fallback`, tried when a direct
connection fails or at once for a peer behind a NAT, and `open_state(peer_id)` for state
sync. Over either path both ends run the same authenticating handshake and per-frame MACs
(`dilonode.net.channel`); libp2p's own transport security comes on top. Bulk data costs
more CPU this way (docs/reports/2026-11-22-p2p-stream.md), so it is only the fallback.

Usage, on the plane's event loop::

    tunnel = Tunnel(dht.p2p_daemon_maddr(), run_id)
    await tunnel.start(plane.accept_stream)  # then DataPlane(..., fallback=tunnel.open)
    ...
    await tunnel.reattach(dht.p2p_daemon_maddr())   # after the DHT (and p2pd) restarted
    ...
    await tunnel.aclose()

**Behind a NAT** (`dilonode.swarm.reachability`): libp2p reaches a private node through a circuit
relay, but the relays hivemind's p2pd runs are *limited*: its `-relayDataLimit` and
`-relayTimeLimit` flags do not reach the relay service it actually runs, which keeps
go-libp2p's defaults, 128 KiB and 2 minutes per relayed connection, then a reset. Enough for
DHT requests, not for a round. So a stream to a private peer rides a direct libp2p
connection when p2pd holds one, and otherwise goes through a `Relay`:

* a private node keeps direct libp2p connections to the public peers it averages with
  (`reach_out`, before it registers for a round), so their streams to it find one;
* every public node and the bootstrap serve a `Relay`: the opener asks one of its
  initial peers (where private nodes hold relay reservations, hence direct connections)
  to open the stream to the target and pipe the two together. Both ends still run the
  handshake and MACs, so the relay sees only sealed frames; it relays only to peers with
  a live record in the run.

The plane keeps calling the same `open`, so a re-attached tunnel needs no rewiring; it
serves the state server's streams and the relay again.

`import hivemind` happens in `start()`, never at module import.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from dilonode.swarm.records import PEER_ID_PATTERN

__all__ = ["LivePeers", "Relay", "Tunnel", "relay_name", "relay_peers", "relayed_name",
           "stream_name"]

log = logging.getLogger(__name__)

_OP_TIMEOUT = 10.0  # seconds for one daemon request (attach, register, open a stream)
_CONNECT_TIMEOUT = 5.0  # seconds for p2pd to connect to a peer (reach_out)
_PIPE_BYTES = 1 << 18  # one read of a relayed stream
# Relay answers to a request: the stream is piped to the target, or why not.
_OK, _REFUSED, _NO_TARGET = b"\x00", b"\x01", b"\x02"
# What a stream reaches: a service byte in relay requests.
_SERVICES = {"data": 0, "state": 1}

Pair = tuple[asyncio.StreamReader, asyncio.StreamWriter]
Accept = Callable[[asyncio.StreamReader, asyncio.StreamWriter, str], Awaitable[None]]


def stream_name(run_id: str, service: str = "data") -> str:
    """The libp2p stream handler of a run's data plane, or of its state server (`service`
    "state"); runs never share a handler."""
    return f"dilonode/{run_id}/data/v3" if service == "data" else f"dilonode/{run_id}/state/v1"


def relay_name(run_id: str) -> str:
    """The libp2p stream handler of a run's relay for streams to private nodes."""
    return f"dilonode/{run_id}/relay/v1"


def relayed_name(run_id: str, service: str = "data") -> str:
    """The handler a relay opens on the target: the stream starts with the requester's
    peer id (one length byte, then base58), so the target's admission caps count the
    requester, not the relay, as the connection's source."""
    return f"dilonode/{run_id}/relayed/{service}/v1"


def relay_peers(maddrs: Iterable[str]) -> list[str]:
    """The peer ids in multiaddrs (`.../p2p/<id>`), in order, once each: a node's relays are
    its initial peers."""
    out: list[str] = []
    for maddr in maddrs:
        parts = maddr.split("/")
        for proto, value in zip(parts, parts[1:], strict=False):
            if proto in ("p2p", "ipfs") and value not in out:
                out.append(value)
    return out


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                stats: dict[str, int]) -> None:
    """Copy until EOF, then half-close; drain bounds what is buffered. Counts the bytes in
    `stats["bytes"]` as they pass (a data-plane stream lives for many rounds)."""
    while chunk := await reader.read(_PIPE_BYTES):
        writer.write(chunk)
        stats["bytes"] += len(chunk)
        await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()


async def _accept_relayed(accept: Accept, relay: str, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
    """Serve a stream a relay opened for a requester it names first (`relayed_name`); a
    stream without a valid name is dropped. The name is the relay's word: it only sorts
    connections for the admission caps, the handshake still proves who is on the line."""
    try:
        async with asyncio.timeout(_OP_TIMEOUT):
            size = (await reader.readexactly(1))[0]
            requester = (await reader.readexactly(size)).decode("ascii", "replace")
    except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
        log.debug("relayed stream from %s: no requester: %s", relay, exc)
        writer.transport.abort()
        return
    if not re.fullmatch(PEER_ID_PATTERN, requester):
        log.info("relayed stream from %s: bad requester name %r", relay, requester[:64])
        writer.transport.abort()
        return
    await accept(reader, writer, f"libp2p:{requester} via {relay}")


async def _handler_task(tasks: set[asyncio.Task[Any]], serve: Awaitable[None]) -> None:
    """Run a stream handler's body, tracked in `tasks` so that closing can cancel it."""
    task = asyncio.current_task()
    assert task is not None
    tasks.add(task)
    try:
        await serve
    except asyncio.CancelledError:
        # Cancelled by aclose(). End the handler task normally: on Python 3.11 asyncio's
        # stream server calls exception() on a cancelled handler task and logs the
        # CancelledError it raises as an error.
        return
    finally:
        tasks.discard(task)


class LivePeers:
    """Peer ids with a live record in the run, re-read every `interval` s on the loop and
    at most every second when asked about a peer it has not seen (for a `Relay` where no
    membership keeps them: the bootstrap)."""

    def __init__(self, fetch: Callable[[], Iterable[Any]], interval: float = 5.0) -> None:
        self.fetch, self.interval = fetch, interval
        self.ids: frozenset[str] = frozenset()
        self._read_at = float("-inf")

    async def __call__(self, peer_id: str) -> bool:
        if peer_id not in self.ids and time.monotonic() - self._read_at > 1.0:
            await self.refresh()
        return peer_id in self.ids

    async def refresh(self) -> None:
        self._read_at = time.monotonic()
        try:
            records = await asyncio.to_thread(self.fetch)
        except (TimeoutError, RuntimeError) as exc:  # the DHT is unwell: keep the last read
            log.debug("relay: reading peer records failed: %s", exc)
            return
        self.ids = frozenset(r.peer_id for r in records if not (r.status or {}).get("leaving"))

    async def refresh_forever(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.interval)


class Relay:
    """Pipes a stream to a private node's data plane or state server (module docstring).

    Request: a service byte (`_SERVICES`), one byte n, then n bytes of the target's peer id
    (base58); answer: one byte, `_OK` then the target's bytes both ways, or `_REFUSED`
    (a target without a live record in the run, too many relayed streams) / `_NO_TARGET`
    (no stream to it), then the stream closes. `admitted(peer_id)` (a bool, or an
    awaitable of one) says whether a peer has a live record. Whoever asks must still pass
    the target's handshake (the run's secret and allowlist), which the relay cannot see.
    """

    def __init__(self, p2p: Any, run_id: str,
                 admitted: Callable[[str], bool | Awaitable[bool]], *,
                 max_streams: int = 256) -> None:
        self.p2p, self.run_id, self.admitted = p2p, run_id, admitted
        self.name = relay_name(run_id)
        self.max_streams = max_streams
        self.stats = dict.fromkeys(("relayed", "refused", "no_target", "bytes"), 0)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._owns_p2p = False

    @classmethod
    async def attach(cls, daemon_maddr: Any, run_id: str,
                     admitted: Callable[[str], bool | Awaitable[bool]]) -> Relay:
        """A started relay on a client of its own of the p2pd at `daemon_maddr`."""
        from hivemind.p2p import P2P

        p2p = await asyncio.wait_for(P2P.replicate(daemon_maddr), _OP_TIMEOUT)
        relay = cls(p2p, run_id, admitted)
        relay._owns_p2p = True
        await relay.start()
        return relay

    async def start(self) -> None:
        await asyncio.wait_for(self.p2p.add_binary_stream_handler(self.name, self._serve),
                               _OP_TIMEOUT)

    async def aclose(self, timeout: float = _OP_TIMEOUT) -> None:
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(Exception):  # the daemon may already be gone
            await asyncio.wait_for(self.p2p.remove_binary_stream_handler(self.name), timeout)
        if self._owns_p2p:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.p2p.shutdown(), timeout)

    async def _serve(self, info: Any, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        try:
            await _handler_task(self._tasks, self._relay(str(info.peer_id), reader, writer))
        except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
            log.debug("relay: stream from %s ended: %s", info.peer_id, exc)
        finally:
            writer.close()

    async def _admits(self, peer_id: str) -> bool:
        got = self.admitted(peer_id)
        return bool(await got) if inspect.isawaitable(got) else bool(got)

    async def _open(self, target: Any, service: str, requester: str) -> Pair:
        """A stream to `target` that names `requester` first; to a target that predates
        `relayed_name`, the plain one (it then counts us as the source)."""
        try:
            _, reader, writer = await asyncio.wait_for(self.p2p.call_binary_stream_handler(
                target, relayed_name(self.run_id, service)), _OP_TIMEOUT)
        except Exception as exc:  # p2pd's own error types: e.g. no such handler there
            if isinstance(exc, TimeoutError):
                raise
            _, reader, writer = await asyncio.wait_for(self.p2p.call_binary_stream_handler(
                target, stream_name(self.run_id, service)), _OP_TIMEOUT)
            return reader, writer
        writer.write(bytes([len(requester)]) + requester.encode("ascii"))
        return reader, writer

    @staticmethod
    async def _answer(writer: asyncio.StreamWriter, answer: bytes) -> None:
        writer.write(answer)
        await asyncio.wait_for(writer.drain(), _OP_TIMEOUT)

    async def _relay(self, requester: str, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        async with asyncio.timeout(_OP_TIMEOUT):
            service, size = await reader.readexactly(2)
            target = (await reader.readexactly(size)).decode("ascii", "replace")
        names = {v: k for k, v in _SERVICES.items()}
        # Only to members of the run; the requester need not have a record yet (a joiner
        # fetching state publishes its record after): the target's handshake checks it.
        if (service not in names or len(self._tasks) > self.max_streams
                or target == requester or not await self._admits(target)):
            self.stats["refused"] += 1
            log.info("relay: refused a stream from %s to %s", requester, target[:64])
            await self._answer(writer, _REFUSED)
            return
        from hivemind.p2p import PeerID

        try:
            out_reader, out_writer = await self._open(PeerID.from_base58(target),
                                                      names[service], requester)
        except Exception as exc:  # p2pd's own error types, timeouts, a bad peer id
            self.stats["no_target"] += 1
            log.info("relay: no stream from %s to %s: %s", requester, target, exc)
            await self._answer(writer, _NO_TARGET)
            return
        self.stats["relayed"] += 1
        log.info("relay: piping %s -> %s (%s)", requester, target, names[service])
        writer.write(_OK)
        try:
            pipes = [asyncio.ensure_future(_pipe(reader, out_writer, self.stats)),
                     asyncio.ensure_future(_pipe(out_reader, writer, self.stats))]
            # A data-plane connection is one-way, a state-sync one ends with the joiner:
            # when either end hangs up, the relayed stream is over.
            done, pending = await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
            for p in pending:
                p.cancel()
            for p in done:
                p.exception()  # retrieved: a reset is how relayed streams usually end
        finally:
            # close(), not abort(): what the last drain left buffered still goes out.
            out_writer.close()
            try:
                await asyncio.wait_for(out_writer.wait_closed(), _OP_TIMEOUT)
            except Exception:  # a reset, or a peer that stopped reading
                out_writer.transport.abort()


class Tunnel:
    """A client of the DHT's p2pd that carries data-plane and state-sync connections over
    libp2p streams.

    `private_peers()` names the peers behind a NAT (from their records): a stream to one
    of them goes through a `Relay` at one of `relays` (peer ids, tried in order) unless p2pd
    holds a direct connection to it. `private`: this node is behind a NAT (`reach_out`
    matters). `admitted`, when given, makes this node serve a `Relay` itself (public nodes
    do).
    """

    def __init__(self, daemon_maddr: Any, run_id: str, *, private: bool = False,
                 relays: Iterable[str] = (),
                 private_peers: Callable[[], frozenset[str]] = frozenset,
                 admitted: Callable[[str], bool] | None = None) -> None:
        self.daemon_maddr = daemon_maddr
        self.run_id = run_id
        self.name = stream_name(run_id)
        self.private = private
        self.relays = list(relays)
        self.private_peers = private_peers
        self.admitted = admitted
        self.relay: Relay | None = None
        self.stats = dict.fromkeys(("relayed_out", "reached_out"), 0)
        self._p2p: Any = None
        self._accept_data: Accept | None = None  # the data plane's, served again on reattach
        self._state_accept: Accept | None = None  # serve_state's, served again on reattach
        self._streams: set[asyncio.Task[Any]] = set()

    async def start(self, accept_data: Accept) -> None:
        """Attach to the daemon and accept data-plane streams into `accept_data` (the
        plane's `DataPlane.accept_stream`)."""
        from hivemind.p2p import P2P

        self._accept_data = accept_data
        self._p2p = await asyncio.wait_for(P2P.replicate(self.daemon_maddr), _OP_TIMEOUT)
        await self._serve("data", accept_data)
        if self.admitted is not None:
            old, self.relay = self.relay, Relay(self._p2p, self.run_id, self.admitted)
            if old is not None:  # re-attached: the counts go on
                self.relay.stats = old.stats
            await self.relay.start()

    async def serve_state(self, accept: Accept) -> None:
        """Also accept streams for the state server (`StateServer.accept_stream`)."""
        self._state_accept = accept
        await self._serve("state", accept)

    async def _serve(self, service: str, accept: Accept) -> None:
        """Accept `service`'s streams: straight from the opener, or from a relay that
        names the opener first."""
        async def on_stream(info: Any, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> None:
            await _handler_task(self._streams,
                                accept(reader, writer, f"libp2p:{info.peer_id}"))

        async def on_relayed(info: Any, reader: asyncio.StreamReader,
                             writer: asyncio.StreamWriter) -> None:
            await _handler_task(self._streams,
                                _accept_relayed(accept, str(info.peer_id), reader, writer))

        for name, handler in ((stream_name(self.run_id, service), on_stream),
                              (relayed_name(self.run_id, service), on_relayed)):
            await asyncio.wait_for(self._p2p.add_binary_stream_handler(name, handler),
                                   _OP_TIMEOUT)

    async def open(self, peer_id: str, service: str = "data",
                   private: bool | None = None) -> Pair:
        """A stream to `peer_id`'s data plane (the plane's `fallback`) or state server
        (`service` "state"): through a relay to a private peer (`private`, default: in
        `private_peers()`) p2pd holds no direct connection to, else a libp2p stream of its
        own."""
        from hivemind.p2p import PeerID

        if self._p2p is None:
            raise ConnectionError("libp2p tunnel not started")
        if private is None:
            private = peer_id in self.private_peers()
        if private and not await self._connected(peer_id):
            return await self._via_relay(peer_id, service)
        try:
            _, reader, writer = await asyncio.wait_for(
                self._p2p.call_binary_stream_handler(PeerID.from_base58(peer_id),
                                                     stream_name(self.run_id, service)),
                _OP_TIMEOUT)
        except (ValueError, KeyError) as exc:  # not a base58 peer id
            raise ConnectionError(f"no libp2p stream to {peer_id!r}: {exc}") from None
        except Exception as exc:  # p2pd reports failures as its own error types
            if isinstance(exc, OSError | TimeoutError):
                raise
            raise ConnectionError(f"no libp2p stream to {peer_id}: {exc}") from None
        return reader, writer

    async def open_state(self, peer_id: str) -> Pair:
        """State sync's opener, which it calls for peers behind a NAT only."""
        return await self.open(peer_id, "state", private=True)

    async def _direct(self) -> set[str]:
        """Peers p2pd holds a direct (not relayed) connection to."""
        conns = await asyncio.wait_for(self._p2p.list_peers(), _OP_TIMEOUT)
        return {str(c.peer_id) for c in conns
                if not any("p2p-circuit" in str(a) for a in c.addrs)}

    async def _connected(self, peer_id: str) -> bool:
        try:
            return peer_id in await self._direct()
        except Exception as exc:  # the daemon is unwell: the relay path may still work
            log.debug("listing p2pd connections failed: %s", exc)
            return False

    async def _via_relay(self, peer_id: str, service: str) -> Pair:
        from hivemind.p2p import PeerID

        why = []
        request = bytes([_SERVICES[service], len(peer_id)]) + peer_id.encode("ascii")
        for relay in self.relays:
            if relay == peer_id:
                continue
            try:
                _, reader, writer = await asyncio.wait_for(
                    self._p2p.call_binary_stream_handler(PeerID.from_base58(relay),
                                                         relay_name(self.run_id)),
                    _OP_TIMEOUT)
                writer.write(request)
                answer = await asyncio.wait_for(reader.readexactly(1), _OP_TIMEOUT)
            except Exception as exc:  # p2pd's own errors, timeouts, a closed stream
                why.append(f"{relay}: {type(exc).__name__}: {exc}")
                continue
            if answer == _OK:
                self.stats["relayed_out"] += 1
                return reader, writer
            writer.transport.abort()
            why.append(f"{relay}: " + ("refused" if answer == _REFUSED else "no stream to it"))
        raise ConnectionError(f"no relay reached {peer_id}: " + ("; ".join(why) or "no relays"))

    async def reach_out(self, peer_ids: Iterable[str], timeout: float = _CONNECT_TIMEOUT) -> int:
        """Make p2pd hold a direct connection to each of `peer_ids` (public peers) that it
        has none to: their streams to this private node then ride it, not a relay. Returns
        how many were connected now; failures are logged, not raised."""
        from hivemind.p2p import PeerID

        wanted = set(peer_ids)
        if self._p2p is None or not wanted:
            return 0
        try:
            missing = sorted(wanted - await self._direct())
        except Exception as exc:  # the daemon is unwell: the rounds will say more
            log.debug("listing p2pd connections failed: %s", exc)
            return 0

        async def connect(peer: str) -> bool:
            t0 = time.monotonic()
            try:
                await asyncio.wait_for(self._p2p._client.connect(PeerID.from_base58(peer), []),
                                       timeout)
            except Exception as exc:  # unreachable now; the round's own paths decide
                log.info("no direct libp2p connection to %s: %s", peer, exc)
                return False
            log.info("direct libp2p connection to %s in %.2f s", peer, time.monotonic() - t0)
            return True

        done = sum(await asyncio.gather(*(connect(p) for p in missing)))
        self.stats["reached_out"] += done
        return done

    async def reattach(self, daemon_maddr: Any) -> None:
        """Attach to a new daemon (the DHT restarted with a new p2pd) and serve the same
        plane through it; streams through the old daemon are dropped."""
        if self._accept_data is None:
            raise RuntimeError("Tunnel.reattach: start() first")
        await self.aclose(timeout=2.0)  # the old daemon is usually dead: do not wait long
        self.daemon_maddr = daemon_maddr
        await self.start(self._accept_data)
        if self._state_accept is not None:
            await self.serve_state(self._state_accept)
        log.info("libp2p tunnel re-attached to %s", daemon_maddr)

    async def aclose(self, timeout: float = _OP_TIMEOUT) -> None:
        """Stop accepting streams and detach from the daemon (which keeps running)."""
        p2p, self._p2p = self._p2p, None
        if p2p is None:
            return
        if self.relay is not None:
            await self.relay.aclose(timeout)
        for task in list(self._streams):
            task.cancel()
        for name in (self.name, stream_name(self.run_id, "state"),
                     relayed_name(self.run_id, "data"), relayed_name(self.run_id, "state")):
            try:
                await asyncio.wait_for(p2p.remove_binary_stream_handler(name), timeout)
            except Exception as exc:  # the daemon may be gone, or the handler never set
                log.debug("removing the libp2p stream handler %s failed: %s", name, exc)
        await asyncio.wait_for(p2p.shutdown(), timeout)
