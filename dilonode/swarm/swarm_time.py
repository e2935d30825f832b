"""Swarm time: the one wall clock every node of a run reads, whatever its host's clock says.

Volunteers' hosts run without NTP, and their clocks drift seconds to minutes apart. The
run's time rests on wall clocks in three places: hivemind stamps DHT records with an
expiration (`get_dht_time`) and refuses peers more than 3 s apart; peer records expire
by it; the swarm clock (`swarm/clock.py`) opens rounds by it. So each node measures how far
its clock is from its initial peers' (the bootstrap peers it joins through, whose clocks are
the swarm's: `estimate_offset`, from pings: their `dht_time` against the midpoint of our
send and receive times, the sample with the shortest round trip of each, the median over
them) and from then on reads
`now()`: its wall clock plus that offset. `install()` hands the same reading to hivemind,
in this process and in the DHT process it forks (the offset lives in shared memory), and
widens hivemind's own check to `max_offset` so that a skewed node can join long enough to
measure its offset. A node further off than `network.max_clock_offset` stops with one
line naming the offset it measured.

One offset per process: every DHT a process starts shares its host's clock. A node with no
initial peers (the first one, a bootstrap) keeps its own clock: the swarm's time is the
time of the peers it was started from.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Iterable
from typing import Any

__all__ = ["ClockOffsetError", "estimate_offset", "install", "now", "offset", "set_offset"]

log = logging.getLogger(__name__)

_offset: Any = None  # mp.Value("d"): seconds to add to time.time(), shared with forks
_original: Any = None  # hivemind's own get_dht_time


class ClockOffsetError(ValueError):
    """This host's clock is further from its peers' than the run allows (one line)."""


def now() -> float:
    """Swarm time: this host's wall clock plus the measured offset (seconds since the epoch)."""
    return time.time() + (_offset.value if _offset is not None else 0.0)


def offset() -> float:
    return float(_offset.value) if _offset is not None else 0.0


def set_offset(seconds: float) -> None:
    """Read `seconds` more than this host's clock from now on (here and in the DHT process)."""
    global _offset
    if _offset is None:
        _offset = mp.Value("d", 0.0, lock=False)
    _offset.value = float(seconds)


def install(max_offset: float) -> None:
    """Make hivemind read swarm time (every module that imported `get_dht_time`) and accept
    peers up to `max_offset` apart (plus its own 3 s) until we have measured ours. Before
    the first DHT process forks, so it inherits both."""
    global _original
    set_offset(offset())  # the shared value exists before any fork
    import hivemind.dht.protocol as protocol
    import hivemind.utils.timed_storage as timed_storage

    if _original is None:
        _original = timed_storage.get_dht_time
    for name, module in list(sys.modules.items()):
        if (name == "hivemind" or name.startswith("hivemind.")) and \
                getattr(module, "get_dht_time", None) is _original:
            module.get_dht_time = now
    protocol.MAX_DHT_TIME_DISCREPANCY_SECONDS = max(
        protocol.MAX_DHT_TIME_DISCREPANCY_SECONDS, max_offset + 3.0)


def estimate_offset(samples: Iterable[tuple[str, float, float]]) -> float | None:
    """The offset to add to our clock from (peer, their time minus our midpoint, round trip)
    samples: per peer the sample of the shortest round trip (the least queueing), then the
    median over peers; None without samples."""
    best: dict[str, tuple[float, float]] = {}
    for peer, delta, rtt in samples:
        if rtt >= 0 and (peer not in best or rtt < best[peer][1]):
            best[peer] = (delta, rtt)
    if not best:
        return None
    return float(statistics.median(d for d, _ in best.values()))
