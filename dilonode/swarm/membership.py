"""A node's membership in a run: its published peer record (with heartbeat and withdrawal),
the live peer list, and group forming for one (fragment, round, attempt).

Shared by the training node (`dilonode.node`) and the soak harness, which exercises the
network layer without a trainer.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from dilonode.allreduce.driver import FormedGroup
from dilonode.config import NetworkConfig
from dilonode.swarm.dht import SwarmDHT
from dilonode.swarm.matchmaking import form_group
from dilonode.swarm.records import GroupEntry, PeerRecord

__all__ = ["Membership"]

log = logging.getLogger(__name__)


class Membership:
    """Peer record, heartbeat and matchmaking for one node on a started `SwarmDHT`."""

    def __init__(self, dht: SwarmDHT, run_id: str, net: NetworkConfig, data_addr: str,
                 status: Callable[[], dict[str, Any]] | None = None, *,
                 settings: Mapping[str, str | int | float] | None = None) -> None:
        self.dht, self.run_id, self.net, self.data_addr = dht, run_id, net, data_addr
        self.status = status or (lambda: {})
        # Round settings every group member must share (`RoundPolicy.settings()`).
        self.settings = dict(settings or {})
        self.state_addr: str | None = None  # advertised state-sync listener, if any
        # Peer records can be briefly missing from a DHT read: peers that were in our groups
        # within one record ttl are expected too (a dead one costs a window, as its record does).
        self._seen: dict[str, float] = {}
        self._live: tuple[float, list[PeerRecord]] = (float("-inf"), [])
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Publish our record now and keep it fresh in a background thread."""
        self.publish()
        self._thread = threading.Thread(target=self._beat, name="dilonode-heartbeat",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the heartbeat and withdraw the record (a newer one marked leaving)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.dht.started:
            try:
                self.publish(leaving=True)
            except Exception as exc:  # leaving must not fail because the DHT is unwell
                log.warning("could not withdraw peer record: %s", exc)

    def publish(self, leaving: bool = False) -> None:
        status = {"leaving": True} if leaving else self.status()
        record = PeerRecord(peer_id=self.dht.peer_id, run_id=self.run_id,
                            data_addr=self.data_addr, bandwidth_mbps=self.net.bandwidth_mbps,
                            step=int(status.get("step", 0)), status=status,
                            state_addr=self.state_addr)
        # hivemind keeps the value expiring last: the leaving record must outlive the last one.
        self.dht.publish(record, ttl=self.net.peer_ttl + (1.0 if leaving else 0.0))

    def _beat(self) -> None:
        while not self._stop.wait(self.net.peer_ttl / 3):
            try:
                self.publish()
            except Exception as exc:  # a missed heartbeat is retried at the next one
                log.warning("heartbeat failed: %s", exc)

    def live_peers(self, max_age: float = 0.0) -> list[PeerRecord]:
        """Peers with a fresh record that are not leaving; reuses a read up to `max_age` s."""
        fetched_at, peers = self._live
        if time.monotonic() - fetched_at > max_age:
            peers = [r for r in self.dht.fetch_peers() if not (r.status or {}).get("leaving")]
            self._live = (time.monotonic(), peers)
        return peers

    def wait_for_peers(self, need: int, timeout: float) -> list[PeerRecord]:
        deadline = time.monotonic() + timeout
        while len(seen := self.live_peers()) < need:
            if time.monotonic() > deadline:
                raise TimeoutError(f"network.min_peers = {need}: only {len(seen)} peer(s) "
                                   f"visible after {timeout} s")
            time.sleep(0.2)
        return seen

    async def form(self, fragment: int, round_no: int, attempt: int,
                   exclude: set[str]) -> FormedGroup:
        """`FormGroup` for the all-reduce driver; the DHT calls run in a worker thread."""
        return await asyncio.to_thread(self.form_blocking, fragment, round_no, attempt, exclude)

    def form_blocking(self, fragment: int, round_no: int, attempt: int,
                      exclude: set[str]) -> FormedGroup:
        expected = self._expected(exclude)
        me = GroupEntry(peer_id=self.dht.peer_id, run_id=self.run_id, data_addr=self.data_addr,
                        fragment=fragment, round=round_no, attempt=attempt,
                        bandwidth_mbps=self.net.bandwidth_mbps, settings=self.settings)
        group = form_group(self.dht, self.run_id, fragment, round_no, attempt, me,
                           self.net.matchmaking_window, self.net.matchmaking_timeout,
                           poll_interval=0.05, expected=expected, exclude=exclude)
        now = time.monotonic()
        with self._lock:
            self._seen.update({m: now for m in group.members})
        return FormedGroup(group.members, group.data_addrs, group.weights, group.my_index,
                           group.digest())

    def _expected(self, exclude: set[str]) -> set[str]:
        now, ttl = time.monotonic(), self.net.peer_ttl
        with self._lock:
            recent = {p for p, t in self._seen.items() if now - t < ttl}
        # Every round asks; one DHT read a second is plenty (records live peer_ttl seconds).
        live = {r.peer_id for r in self.live_peers(max_age=1.0)}
        return (live | recent) - exclude
