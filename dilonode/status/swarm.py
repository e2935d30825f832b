"""`SwarmView`: the bootstrap peer's view of a run, built from the peer records in the DHT.

Every node publishes a small summary with its peer record (`NodeStatus.summary()`, sent by
`dilonode.swarm.membership.Membership`'s heartbeat). `SwarmView.refresh_forever()` runs on the
status server's event loop and reads those records every `interval` seconds in a worker thread
(DHT calls block); `snapshot()` and `history()` only copy what the last read found, so a
request never waits on the DHT.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from dilonode import PROTOCOL_VERSION, __version__
from dilonode.status.snapshot import HISTORY_SERIES, finite_or_none
from dilonode.swarm.records import PeerRecord

__all__ = ["SwarmView", "node_rows", "swarm_agreement"]

log = logging.getLogger(__name__)

# Summary fields a node publishes that the view passes on; anything else is ignored.
_SUMMARY_KEYS = ("worker_id", "state", "url", "total_steps", "tokens", "train_loss",
                 "eval_loss", "tokens_per_s", "sent_Bps", "recv_Bps", "bytes_sent",
                 "bytes_received", "compute_utilization", "peers_seen", "skipped_rounds",
                 "uptime_s", "version", "swarm_step", "state_chain", "agrees", "final_digest",
                 "device_summary", "mfu")


def node_rows(records: Sequence[PeerRecord], now: float) -> list[dict[str, Any]]:
    """One JSON-ready row per live (not leaving) peer record, by peer id."""
    rows = []
    for r in records:
        status = r.status or {}
        if status.get("leaving"):
            continue
        row: dict[str, Any] = {"peer_id": r.peer_id, "data_addr": r.data_addr, "step": r.step,
                               "expires_in_s": round(r.expires_at - now, 1)}
        for key in _SUMMARY_KEYS:
            value = status.get(key)
            # A peer's summary is foreign data: keep only plain scalars, never trust types.
            if isinstance(value, bool | str) or value is None:
                row[key] = value if not isinstance(value, str) else value[:200]
            elif isinstance(value, int | float):
                row[key] = finite_or_none(float(value))
        rows.append(row)
    return sorted(rows, key=lambda x: x["peer_id"])


def swarm_agreement(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether the nodes hold one model, from their published chains: nodes that landed the
    same rounds of a fragment must hold the same chain (nodes a round apart are mid-landing
    and not compared), and nodes that finished must hold the same final weights. `agrees`
    None when there is nothing to compare yet."""
    seen: dict[tuple[int, str], set[str]] = {}  # (fragment, rounds landed) -> chains
    for row in rows:
        for p, item in enumerate(str(row.get("state_chain") or "").split(";")):
            landed, _, chain = item.partition(":")
            if landed.isdigit() and chain:
                seen.setdefault((p, int(landed)), set()).add(chain)
    split = sorted(f"fragment {p} after {n} rounds" for (p, n), c in seen.items() if len(c) > 1)
    finals = {str(r["final_digest"]) for r in rows if r.get("final_digest")}
    compared = any(len(c) for c in seen.values()) or finals
    if split or len(finals) > 1:
        what = split[:3] + ([f"{len(finals)} different final weights"] if len(finals) > 1
                            else [])
        return {"agrees": False, "line": "nodes disagree: " + "; ".join(what)}
    if not compared:
        return {"agrees": None, "line": "nothing to compare yet"}
    return {"agrees": True, "line": f"one model on {len(rows)} node(s)"}


def _sum(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), float | int)]
    return round(sum(values), 3) if values else None


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), float | int)]
    return round(sum(values) / len(values), 6) if values else None


class SwarmView:
    """The swarm as the bootstrap sees it; `fetch` returns the run's peer records."""

    def __init__(self, peer_id: str, run_id: str, fetch: Callable[[], list[PeerRecord]], *,
                 maddrs: Sequence[str] = (), history: int = 600,
                 dht_time: Callable[[], float] = time.time,
                 clock: Callable[[], float] = time.time) -> None:
        self.peer_id, self.run_id, self.maddrs = peer_id, run_id, list(maddrs)
        self.url = ""
        self._fetch, self._dht_time, self._clock = fetch, dht_time, clock
        self._started = clock()
        self._lock = threading.Lock()
        self._rows: list[dict[str, Any]] = []
        self._records: dict[str, PeerRecord] = {}  # newest record seen per peer
        self._error: str | None = None
        self._updated: float | None = None
        self._hist_t: deque[float] = deque(maxlen=history)
        self._hist: dict[str, deque[float | None]] = {
            name: deque(maxlen=history) for name in HISTORY_SERIES}

    def update(self, records: Sequence[PeerRecord]) -> None:
        """Merge a fresh read of the peer records and append a history point.

        A DHT read can miss a peer's record (a replica that did not answer in time): a record
        seen earlier stays in the view until it expires, as it does for the nodes' matchmaking.
        """
        now, dht_now = self._clock(), self._dht_time()
        merged = dict(self._records)
        for r in records:
            old = merged.get(r.peer_id)
            if old is None or r.expires_at >= old.expires_at:
                merged[r.peer_id] = r
        self._records = {p: r for p, r in merged.items() if r.expires_at > dht_now}
        rows = node_rows(list(self._records.values()), dht_now)
        point = {"step": _mean(rows, "step"), "train_loss": _mean(rows, "train_loss"),
                 "eval_loss": _mean(rows, "eval_loss"),
                 "tokens_per_s": _sum(rows, "tokens_per_s"), "sent_Bps": _sum(rows, "sent_Bps"),
                 "recv_Bps": _sum(rows, "recv_Bps"), "peers": len(rows),
                 "mfu": _mean(rows, "mfu")}
        with self._lock:
            self._rows, self._error, self._updated = rows, None, now
            self._hist_t.append(round(now, 3))
            for name, col in self._hist.items():
                col.append(point[name])

    async def refresh_forever(self, interval: float = 2.0, timeout: float = 10.0) -> None:
        """Read the DHT every `interval` s until cancelled; a failed read is shown, not fatal."""
        while True:
            try:
                records = await asyncio.wait_for(asyncio.to_thread(self._fetch), timeout)
                self.update(records)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the DHT being unwell must not stop the status page
                log.warning("swarm view: reading peer records failed: %s", exc)
                with self._lock:
                    self._error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            await asyncio.sleep(interval)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            rows = [dict(r) for r in self._rows]
            error, updated = self._error, self._updated
        return {"kind": "swarm", "peer_id": self.peer_id, "run_id": self.run_id,
                "version": __version__, "protocol_version": PROTOCOL_VERSION, "url": self.url,
                "maddrs": self.maddrs, "started_at": round(self._started, 3),
                "uptime_s": round(self._clock() - self._started, 1),
                "updated_at": updated, "error": error, "nodes": rows,
                "tokens_per_s": _sum(rows, "tokens_per_s"),
                "tokens": _sum(rows, "tokens"), "agreement": swarm_agreement(rows)}

    def history(self) -> dict[str, Any]:
        with self._lock:
            return {"t": list(self._hist_t),
                    "series": {name: list(col) for name, col in self._hist.items()}}
