"""`AloneWatch`: notices a node that keeps averaging alone while its swarm is alive.

A node cut off from its peers (a dead p2pd, a partition, a firewall) goes on training and
"averages" every round with itself, and without this watch would end with exit code 0
having never said so. `on_round(group_size, live_peers)` is called for every
landed round with the number of *other* peers whose records are live; after
`warn_after` rounds in a row alone while some are live, the node logs
"alone for N rounds while M peers are live" at WARNING (again at most every `log_every`
seconds while it lasts, and once at INFO when it ends), and `snapshot()` carries the same
sentence for the status endpoint and the dashboard. A node that is alone because nobody
else is live is not warned about. Nothing here does I/O but logging.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["AloneWatch"]

log = logging.getLogger("dilonode.alone")


class AloneWatch:
    """Counts rounds in a row that ended in a group of one while other peers were live."""

    def __init__(self, warn_after: int = 3, log_every: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if warn_after < 1:
            raise ValueError(f"warn_after = {warn_after}: must be >= 1")
        self.warn_after, self.log_every, self.clock = warn_after, log_every, clock
        self.rounds = 0  # rounds in a row alone while peers were live
        self.live_peers = 0  # other live peers at the last such round
        self.episodes = 0  # times the warning was raised
        self._logged_at: float | None = None
        self._lock = threading.Lock()

    def on_round(self, group_size: int, live_peers: int) -> None:
        """Record one landed round: its group size and the other peers live now."""
        with self._lock:
            if group_size >= 2 or live_peers <= 0:
                self._end(group_size)
                return
            self.rounds += 1
            self.live_peers = live_peers
            if self.rounds == self.warn_after:
                self.episodes += 1
            due = self.rounds >= self.warn_after and (
                self._logged_at is None or self.clock() - self._logged_at >= self.log_every)
            if due:
                self._logged_at = self.clock()
        if due:
            log.warning("%s", self._sentence())

    def _end(self, group_size: int) -> None:
        """Lock held: the run of lone rounds is over."""
        if self.rounds >= self.warn_after:
            log.info("back in a group of %d after %d round(s) alone", group_size, self.rounds)
        self.rounds, self._logged_at = 0, None

    def _sentence(self) -> str:
        return f"alone for {self.rounds} rounds while {self.live_peers} peers are live"

    def warning(self) -> str | None:
        """The warning while it holds, else None."""
        with self._lock:
            return self._sentence() if self.rounds >= self.warn_after else None

    def snapshot(self) -> dict[str, Any]:
        """JSON-ready: rounds alone in a row, live peers then, the warning (or null)."""
        warning = self.warning()
        with self._lock:
            return {"rounds": self.rounds, "live_peers": self.live_peers,
                    "warning": warning, "episodes": self.episodes}
