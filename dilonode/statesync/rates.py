"""How fast a joiner's fetch goes and whether it can catch up: the chunk transfer rate
(`RateMeter`), the rate at which landing rounds move the state on (`ResultRate`), and
`catch_up_seconds` from the two. Pure arithmetic over what the client records.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from dilonode.statesync.protocol import (
    Manifest,
)

__all__ = ["RateMeter", "ResultRate", "catch_up_seconds"]


log = logging.getLogger(__name__)

RATE_TRUSTED_AFTER_S = 0.5  # the transfer rate is trusted after this long (near-end estimate)
_IN_FLIGHT_S = 1.0  # chunk requests in flight: about this many seconds of the fetch's rate


def catch_up_seconds(missing_bytes: float, rate: float, moving: float) -> float:
    """Seconds until a fetch with `missing_bytes` left at `rate` bytes/s holds the current
    state, when the state moves on by `moving` bytes/s of round results (each round that
    lands adds its result to fetch); inf when the fetch cannot catch up."""
    net = rate - moving
    return missing_bytes / net if net > 0 else math.inf


@dataclass
class RateMeter:
    """Payload bytes per second arriving lately, over all peers; and how many chunk requests
    to keep in flight at that rate: about `_IN_FLIGHT_S` worth. On a slow link, requests
    queued beyond that would arrive seconds later, and a fetch that a round cuts short
    waits for all of them before it goes on with the new state (16 MiB in flight take 13 s
    at 10 Mbit/s)."""

    span: float = 3.0
    arrivals: deque[tuple[float, int]] = field(default_factory=deque)
    total: int = 0  # bytes in `arrivals`
    first: float | None = None
    received: int = 0  # bytes since the first reply

    def add(self, nbytes: int, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        self.first = now if self.first is None else self.first
        self.arrivals.append((now, nbytes))
        self.total += nbytes
        self.received += nbytes
        self._forget(now)

    def _forget(self, now: float) -> None:
        """Drop replies older than `span` (asked once per request: no pass over them)."""
        while self.arrivals and self.arrivals[0][0] < now - self.span:
            self.total -= self.arrivals.popleft()[1]

    def rate(self, now: float | None = None) -> float | None:
        """Bytes/s over the last `span` s; None until replies have come for `RATE_TRUSTED_AFTER_S`
        s."""
        now = time.perf_counter() if now is None else now
        if self.first is None or now - self.first < RATE_TRUSTED_AFTER_S:
            return None
        self._forget(now)
        if len(self.arrivals) < 2:  # one reply or none in the span: as slow as that says
            return self.total / self.span
        # Between the first reply in the span and the last: what came after the first.
        (t0, n0), (t1, _) = self.arrivals[0], self.arrivals[-1]
        return (self.total - n0) / max(t1 - t0, 1e-3)

    def window(self, chunk_bytes: int, peers: int, most: int,
               now: float | None = None) -> int:
        """Chunk requests each of `peers` may have in flight: an equal share of about
        `_IN_FLIGHT_S` worth at the rate seen (at least 2 over all), at least 1, at most
        `most` (statesync.window); 1 until a rate is known."""
        rate = self.rate(now)
        if rate is None:
            return 1
        total = max(2, math.ceil(rate * _IN_FLIGHT_S / chunk_bytes))
        return max(1, min(most, math.ceil(total / max(peers, 1))))


@dataclass
class ResultRate:
    """Bytes per second of round results the peers' manifests add: the rounds that land
    while a joiner fetches, each a result it must fetch too (rounds already listed in the
    first manifests read are not counted)."""

    seen: set[tuple[int, int]] = field(default_factory=set)
    sizes: dict[int, int] = field(default_factory=dict)  # fragment -> its latest result bytes
    new_bytes: int = 0
    new_rounds: int = 0
    since: float | None = None

    def note(self, manifests: Iterable[Manifest]) -> None:
        first = self.since is None
        if first:
            self.since = time.perf_counter()
        for m in manifests:
            for r in m.replays:
                if (r.fragment, r.round) not in self.seen:
                    self.seen.add((r.fragment, r.round))
                    self.sizes[r.fragment] = r.nbytes
                    self.new_bytes += 0 if first else r.nbytes
                    self.new_rounds += not first

    def rate(self) -> float:
        return self.new_bytes / self._elapsed()

    def rounds_per_second(self) -> float:
        """Rounds landing per second, over all fragments."""
        return self.new_rounds / self._elapsed()

    def _elapsed(self) -> float:
        """Seconds since the first manifests (at least 1: a rate from one reading is not
        one); the counts are 0 before any, so the rates are too."""
        return max(time.perf_counter() - self.since, 1.0) if self.since is not None else 1.0
