"""What the data plane hands a round: `PeerEvent`s (a message, a peer's error, a peer gone)
queued per registered round in an `Inbox`, the frames kept for rounds not registered yet
(`PendingFrames`), and peer addresses (`parse_address`, `PeerUnreachable`)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from dilonode.net.aio import bounded
from dilonode.wire.messages import RoundMessage

__all__ = ["EventKind", "Inbox", "PeerEvent", "PeerUnreachable", "PendingFrames", "RoundKey",
           "parse_address"]

RoundKey = tuple[int, int, int]  # (fragment, round, attempt)
EventKind = Literal["message", "error", "gone"]


def parse_address(address: str) -> tuple[str, int]:
    """"host:port" -> (host, port); ValueError on anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address {address!r}: expected 'host:port'")
    return host.strip("[]"), int(port)


class PeerUnreachable(ConnectionError):
    """A frame could not be written to a peer (connect failed, connection lost)."""


@dataclass(frozen=True)
class PeerEvent:
    """What the plane has for a round: a message from a peer, or a problem with a peer.

    `kind` is "message" (`msg`, `frame_bytes` set), "error" (the peer sent something
    undecodable: fail naming it) or "gone" (its connection was lost); `reason` is one line.
    """

    peer_id: str
    kind: EventKind
    msg: RoundMessage | None = None
    frame_bytes: int = 0
    reason: str = ""


class Inbox:
    """Events for one registered round, in arrival order; read by one driver."""

    def __init__(self, key: RoundKey, members: frozenset[str],
                 on_queued: Callable[[int], None]) -> None:
        self.key = key
        self.members = members
        self._on_queued = on_queued  # told the change of undelivered bytes (the plane's bound)
        self._events: deque[PeerEvent] = deque()
        self._bytes = 0
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._events)

    def put(self, event: PeerEvent) -> None:
        """Queue an event (also used by the driver for its own send failures)."""
        self._events.append(event)
        self._bytes += event.frame_bytes
        self._on_queued(event.frame_bytes)
        self._ready.set()

    async def get_batch(self, timeout: float, *, max_items: int = 64,
                        max_bytes: int = 64 << 20) -> list[PeerEvent]:
        """Up to `max_items` events (at least one if any arrives within `timeout` s)."""
        if not self._events and timeout > 0:
            self._ready.clear()
            await bounded(self._ready.wait(), timeout)
        out: list[PeerEvent] = []
        taken = 0
        while self._events and len(out) < max_items and (not out or taken < max_bytes):
            event = self._events.popleft()
            out.append(event)
            taken += event.frame_bytes
        self._bytes -= taken
        self._on_queued(-taken)
        return out

    def _discard(self) -> None:
        self._on_queued(-self._bytes)
        self._events.clear()
        self._bytes = 0


@dataclass
class PendingFrames:
    """Frames (and peer problems) for a key that no round registered yet."""

    events: list[PeerEvent] = field(default_factory=list)
    nbytes: int = 0
    peers: set[str] = field(default_factory=set)
    overflowed: bool = False
    expiry: asyncio.TimerHandle | None = None
