"""Sitting rounds out while our data listener is down, and coming back.

A listener the supervisor destroyed and rebuilt is back within a check; one that peers
cannot reach stays down, and every round with us would cost them a timeout. So while it
has been down for longer than a restart takes (`SitOut.away()`), the node's group former
sits rounds out (they are lone rounds: we re-sync after them, as after any other) and its
peer record says it is leaving. `DataListenerBack` is the supervisor's reaction once the
listener is healthy again.

`SitOut` is built before the supervisor (the group former needs it from the first round)
and reads it once `watch(supervisor)` is called; until then nothing is down.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from dilonode.config import SuperviseConfig

__all__ = ["DataListenerBack", "SitOut"]

log = logging.getLogger(__name__)

_POLL_S = 0.25  # how often a round waiting for the listener looks again


class SitOut:
    """Whether this node sits rounds out, from the supervisor's view of its data listener."""

    def __init__(self, cfg: SuperviseConfig, matchmaking_timeout: float, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg, self.matchmaking_timeout, self.clock = cfg, matchmaking_timeout, clock
        self._supervisor: Any = None

    def watch(self, supervisor: Any) -> None:
        """Read the data listener's health from `supervisor` (a `Supervisor`) from now on."""
        self._supervisor = supervisor

    def away(self) -> str | None:
        """Why we are sitting rounds out, or None: our data listener has been down for
        longer than a restart takes."""
        sup = self._supervisor
        down = sup.down_for("data") if sup is not None else None
        if down is not None and down >= 2 * self.cfg.check_interval:
            return f"data listener down for {down:.0f}s"
        return None

    async def wait_back(self, attempt: int) -> str | None:
        """While we sit rounds out, a round's first attempt waits as long as forming a
        group may take for our data listener to come back; None if it did. Going on at
        once instead made a node train ahead of its swarm through lone rounds, and a node
        ahead of its peers finds no newer state to re-sync to."""
        deadline = self.clock() + (self.matchmaking_timeout if attempt == 0 else 0.0)
        while (away := self.away()) is not None and self.clock() < deadline:
            await asyncio.sleep(_POLL_S)
        return away

    def last_outage_s(self) -> float:
        """How long the data listener's last outage lasted (0.0: none, or not watched)."""
        if self._supervisor is None:
            return 0.0
        parts = self._supervisor.snapshot()["parts"]
        return float(parts.get("data", {}).get("last_outage_s") or 0.0)


class DataListenerBack:
    """The supervisor's `on_change`: when our data listener is back after an outage longer
    than a restart, reset the connections peers had open to it (they may sit in TCP
    retransmission backoff after an outage, and would cost the next round a timeout) and
    publish our record at once, so that peers that left us out while we sat rounds out
    (`SitOut.away`, carried by the heartbeat) expect us again."""

    def __init__(self, sit_out: SitOut, plane: Any, thread: Any,
                 publish: Callable[[], None]) -> None:
        self.sit_out, self.plane, self.thread, self.publish = sit_out, plane, thread, publish

    def __call__(self, part: str, down: bool) -> None:
        if part != "data" or down:
            return
        if self.sit_out.last_outage_s() < 2 * self.sit_out.cfg.check_interval:
            return  # back within a restart (a destroyed listener): nothing went stale
        plane = self.plane

        async def reset() -> int:
            return plane.reset_inbound()

        dropped = self.thread.run(reset(), timeout=5.0)
        log.info("data listener back: reset %d connection(s) peers had open to it", dropped)
        self.publish()
