"""`Remerger`: finds the rest of the swarm again after a network partition heals.

During a partition each side's DHT drops the other side's nodes from its routing tables, and
after the heal nothing makes them meet again: both halves went on training in their own
groups to the end of the run. libp2p's routing-table refresh re-dials known peers;
this does the same for hivemind's DHT:

* every `interval` seconds it reads the live peer records and notes who is live, and asks
  p2pd for the DHT addresses of the peers it is connected to (`SwarmDHT.remember_peers`);
* when a peer that was live within `supervise.remember_for` seconds is live no more (and did
  not leave: a leaving record forgets it), it re-contacts every remembered peer and the
  initial peers (`SwarmDHT.reconnect`: dial, ping, look up our neighbourhood), with
  exponential backoff up to `supervise.remerge_backoff_max`, until the missing peers are
  live again or forgotten. One WARNING line when peers go missing, one INFO line when the
  swarm is whole again.

A peer that died for good is looked for until it is forgotten; that costs a dial every
`remerge_backoff_max` seconds. `tick()` is one step, for tests with a fake clock; `start()`
runs it on a daemon thread of its own, so a slow dial never delays the supervisor's health
checks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from dilonode.config import SuperviseConfig
from dilonode.node.supervisor import Backoff
from dilonode.wire.errors import one_line

__all__ = ["Remerger"]

log = logging.getLogger(__name__)

_DIAL_TIMEOUT = 3.0  # seconds for one dial and ping (they run concurrently in the DHT process)
# A record can be missing from one DHT read: a peer counts as missing only after this long.
_MISSING_AFTER = 5.0


class Remerger:
    """Re-contacts remembered DHT peers while peers seen recently are missing."""

    def __init__(self, dht: Any, cfg: SuperviseConfig, *, interval: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.dht, self.cfg, self.interval, self.clock = dht, cfg, interval, clock
        self.backoff = Backoff(1.0, cfg.remerge_backoff_max)
        self.seen: dict[str, float] = {}  # peer id -> when its record was last live
        self.missing_since: float | None = None
        self.attempts = 0  # re-contact rounds in all
        self.healed_after: list[float] = []  # seconds missing, per episode that ended
        self._next_try = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="dilonode-remerge", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.tick()
            except Exception as exc:  # the DHT is down: the supervisor deals with that
                log.debug("re-merge check skipped: %s", one_line(str(exc)))

    def tick(self) -> None:
        """Note who is live; re-contact known peers if someone seen recently is missing."""
        now = self.clock()
        missing = self._missing(now)
        if not missing:
            self._whole_again(now)
            return
        if self.missing_since is None:
            self.missing_since = now
            log.warning("%d peer(s) live within the last %.0fs are not live now (%s): "
                        "re-contacting the initial and remembered DHT peers",
                        len(missing), self.cfg.remember_for,
                        ", ".join(sorted(p[:16] for p in missing)))
        if now >= self._next_try:
            self._recontact(now)

    def _missing(self, now: float) -> set[str]:
        me = self.dht.peer_id
        records = self.dht.fetch_peers()
        for r in records:
            if (r.status or {}).get("leaving"):
                self.seen.pop(r.peer_id, None)  # left cleanly: not to be looked for
            elif r.peer_id != me:
                self.seen[r.peer_id] = now
        self.dht.remember_peers()
        horizon = now - self.cfg.remember_for
        self.seen = {p: t for p, t in self.seen.items() if t >= horizon}
        return {p for p, t in self.seen.items() if now - t >= _MISSING_AFTER}

    def _recontact(self, now: float) -> None:
        self._next_try = now + self.backoff.next()
        self.attempts += 1
        targets = self.dht.known_peers()
        answered = self.dht.reconnect(targets, timeout=_DIAL_TIMEOUT)
        log.info("re-merge attempt %d: %d of %d known DHT peer(s) answered; next in %.0fs "
                 "if peers are still missing", self.attempts, len(answered), len(targets),
                 self._next_try - now)

    def _whole_again(self, now: float) -> None:
        if self.missing_since is not None:
            took = now - self.missing_since
            self.healed_after.append(took)
            log.info("every peer seen recently is live again, %.1fs after they went "
                     "missing (%d re-contact attempt(s))", took, self.attempts)
        self.missing_since = None
        self.backoff.reset()
        self._next_try = 0.0
