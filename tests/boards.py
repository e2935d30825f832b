"""An in-memory stand-in for the swarm DHT's keys, for matchmaking tests without hivemind."""

from __future__ import annotations

import threading
import time

from dilonode.net.auth import Credentials
from dilonode.swarm.dht import RawEntry

__all__ = ["Board", "View"]


class Board:
    """In-memory DHT keys: per subkey the value expiring last wins (as in hivemind).

    `latency` (seconds) makes every call take that long, as a DHT round trip does: a store
    lands when its call returns, and a read answers with the keys as they stood when it
    was sent, so what a peer reads is up to one latency stale.
    """

    def __init__(self, latency: float = 0.0) -> None:
        self.data: dict[str, dict[str, tuple[bytes, float]]] = {}
        self.lock = threading.Lock()
        self.latency = latency


class View:
    """One node's `GroupBoard` on a shared `Board`, recording what it rejected."""

    def __init__(self, board: Board, creds: Credentials) -> None:
        self.board, self.credentials = board, creds
        self.rejected: list[tuple[str, str, bool]] = []

    @property
    def peer_id(self) -> str:
        return self.credentials.peer_id

    def store_raw(self, key: str, subkey: str, value: bytes, ttl: float,
                  timeout: float | None = None) -> bool:
        expires = time.time() + ttl
        time.sleep(self.board.latency)  # the store's round trip (a simulated network)
        with self.board.lock:
            slot = self.board.data.setdefault(key, {})
            if subkey in slot and slot[subkey][1] >= expires:
                return False
            slot[subkey] = (value, expires)
            return True

    def get_raw(self, key: str, timeout: float | None = None) -> dict[str, RawEntry]:
        now = time.time()
        with self.board.lock:
            got = {s: RawEntry(v, e) for s, (v, e) in self.board.data.get(key, {}).items()
                   if e > now}
        time.sleep(self.board.latency)  # the answer's way back (a simulated network)
        return got

    def note_rejected(self, key: str, subkey: str, reason: str, *,
                      unauthorized: bool = False, once_per: str | None = None) -> None:
        self.rejected.append((subkey, reason, unauthorized))
