"""The swarm clock, agreed through the DHT: when reference step s starts, on every node.

With `diloco.pacing = "time"` rounds open on this clock (`algo/pacing.py`), so nodes of any
speed meet in every round. Agreement without a coordinator:

* Every node stores the clock it follows under `clock_key(run)` (subkey: its peer id) and
  re-stores it in the background, so the clock outlives whichever node started it.
* The clock that stands is the one with the earliest `t0` (then the smallest origin peer
  id) among the valid records a node reads: every node that reads the same records picks
  the same one.
* A node that finds no clock proposes one once it knows its own step time (or
  `diloco.step_seconds` is set), starting now. Nodes started together may each propose;
  every node keeps reading (every `poll` s until its first round, then every min(ttl/6, 5)
  seconds) and follows the clock that stands. A node that switches after it started
  rounds (two halves that started apart and met) jumps to the standing clock's newest
  round: the rounds in between count as missed, and the chains of its fragments (which
  differ from the others') make it adopt their state at its next round.
* A clock whose `t0` lies in the future, or older than `max_age`, is ignored: it cannot be
  this run's.
* Retuned clocks (epochs added by the pacemaker, `node/pacemaker.py`) of one lineage: the
  longest history stands, then the one whose last epoch the smallest peer id added
  (`paced_by`), then the smallest. The node that added the standing clock's last epoch and
  still publishes it is among its `pacers`: a node whose view of the live peers lacks it
  for a while defers to it instead of retuning too.
* A node whose link the swarm has not seen in rounds yet (a joiner, which measured it in
  its state fetch) publishes how long its link takes for a round of every fragment
  (`announce_link`, a `LinkRecord`) until its own rounds measure it; the pacemaker reads
  those records with the peers' latencies, so the clock slows before the joiner's first
  round; then it withdraws the record (its latencies carry its link).

Nodes read swarm time (`swarm_time.now`: their wall clock corrected by the offset they
measured against their peers), so hosts without NTP still open rounds together.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from dilonode.algo.pacing import SwarmClock, TimePacer
from dilonode.swarm.dht import read_records, store_record
from dilonode.swarm.records import (
    MAX_CLOCK_EPOCHS,
    ClockRecord,
    LinkRecord,
    clock_key,
    link_key,
)

__all__ = ["ClockKeeper", "Proposal", "Retune", "clock_of", "clock_pacers", "standing_clock"]

log = logging.getLogger(__name__)

# Seconds per reference step this node proposes, or None while it does not know yet.
Proposal = Callable[[], float | None]
# (the clock followed, the reference step now, the seconds nodes' links take for a round
# of every fragment (`LinkRecord`)) -> seconds per step the swarm needs now, or None to
# keep the clock as it is (asked only of the pacemaker).
Retune = Callable[[SwarmClock, float, Sequence[float]], float | None]


def standing_clock(records: dict[str, ClockRecord], now: float,
                   max_age: float = 30 * 86400.0) -> ClockRecord | None:
    """The clock every node picks from the same records: earliest t0, then smallest origin
    (clocks starting in the future or more than `max_age` ago are not considered)."""
    usable = [r for r in records.values() if now - max_age <= r.t0 <= now + 5.0]
    if not usable:
        return None
    first = min(usable, key=lambda r: (r.t0, r.origin, r.step_seconds))
    lineage = [r for r in usable if (r.t0, r.origin, r.step_seconds)
               == (first.t0, first.origin, first.step_seconds)]
    return min(lineage, key=_epoch_order)


def _epoch_order(record: ClockRecord) -> tuple[int, str, list[list[float]]]:
    """Within one clock's lineage: the longest epoch history stands (the newest retuning);
    of two equally long ones (two pacemakers at once), the one whose last epoch the
    smaller peer id added, then the smallest. A total order: every node that reads the
    same records picks the same one, whichever it wrote itself."""
    return -len(record.epochs), record.paced_by, record.epochs


def clock_pacers(records: dict[str, ClockRecord], standing: ClockRecord) -> set[str]:
    """Who added the standing clock's last epoch, if that node still publishes the clock
    (its record is among `records`, which expire a ttl after its last store): evidence that
    it paces the swarm even to a node whose view of the live peers lacks it for a while."""
    author = standing.paced_by
    return {author} if author and author in records else set()


def clock_of(record: ClockRecord) -> SwarmClock:
    return SwarmClock(record.t0, record.step_seconds,
                      tuple((since, rate) for since, rate in record.epochs))


class ClockKeeper:
    """Reads, proposes and republishes the swarm clock for one node (module docstring)."""

    def __init__(self, dht: Any, run_id: str, pacer: TimePacer, propose: Proposal,
                 frozen: Callable[[], bool], *, ttl: float = 60.0, poll: float = 0.5,
                 wall: Callable[[], float] = time.time, retune: Retune | None = None,
                 pacemaker: Callable[[], bool] = lambda: False, lead_steps: float = 30.0,
                 link_unmeasured: Callable[[], bool] = lambda: True) -> None:
        self.dht, self.run_id, self.pacer = dht, run_id, pacer
        self.propose, self.frozen = propose, frozen
        self.retune, self.pacemaker, self.lead_steps = retune, pacemaker, lead_steps
        self.retunes = 0  # epochs this node added
        # Who paces the standing clock, as its records say (`clock_pacers`; read by the
        # `pacemaker` callback, which may defer to them).
        self.pacers: set[str] = set()
        self._full_warned = False
        self.ttl, self.poll, self.wall = ttl, poll, wall
        self.following: ClockRecord | None = None
        self.switches = 0  # clocks followed after this node had started rounds
        self._read_at, self._unread_warned = wall(), False  # the last read of the clock
        self._published_at = float("-inf")
        # What our link takes for a round of every fragment (announce_link), published
        # while `link_unmeasured()` (our rounds have not measured it), then withdrawn.
        self.link: LinkRecord | None = None
        self.link_unmeasured = link_unmeasured
        self._link_published_at = float("-inf")
        self._read_s: deque[float] = deque(maxlen=15)  # our last reads' durations
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def dht_call_s(self) -> float:
        """The median of our last reads of the clock (s): what one DHT call takes from here
        (0.0 before the first)."""
        return statistics.median(self._read_s) if self._read_s else 0.0

    # -- one pass (the thread repeats it; tests call it directly) ------------------------
    def read(self, timeout: float = 5.0) -> ClockRecord | None:
        """The standing clock (None when none); notes who paces it (`pacers`)."""
        t0 = time.monotonic()
        records = read_records(self.dht, clock_key(self.run_id), ClockRecord, timeout)
        self._read_s.append(time.monotonic() - t0)
        now = self.wall()
        if self._unread_warned:
            log.info("swarm clock: read again after %.0f s", now - self._read_at)
            self._unread_warned = False
        self._read_at = now
        standing = standing_clock(records, now)
        self.pacers = clock_pacers(records, standing) if standing is not None else set()
        return standing

    def _store(self, key: str, record: ClockRecord | LinkRecord) -> float:
        """Store our `record` under `key` for `ttl`; when it was stored."""
        store_record(self.dht, key, record, self.ttl)
        return time.monotonic()

    def tick(self) -> None:
        """Read the clocks; follow the standing one or propose ours; republish when due."""
        standing = self.read()
        if standing is not None:
            self._follow(standing)
        elif self.following is None and (step_s := self.propose()) is not None:
            self._follow(ClockRecord(peer_id=self.dht.peer_id, run_id=self.run_id,
                                     t0=self.wall(), step_seconds=step_s,
                                     origin=self.dht.peer_id), proposed=True)
        if self.following is not None and self.retune is not None and self.pacemaker():
            self._maybe_retune()
        if self.following is not None and \
                time.monotonic() - self._published_at > self.ttl / 3:
            self._publish()
        self._publish_link()

    def announce_link(self, busy_s: float, rate_Bps: float) -> None:
        """Tell the pacemaker that a round of every fragment takes `busy_s` of our link
        (moving `rate_Bps` each way: `pacing.link_busy_seconds`) until our rounds measure
        it; published at the next pass (any thread may call this)."""
        self.link = LinkRecord(peer_id=self.dht.peer_id, run_id=self.run_id,
                               busy_s=busy_s, rate_Bps=rate_Bps)
        self._link_published_at = float("-inf")

    def _publish_link(self) -> None:
        link = self.link
        if link is None:
            return
        if not self.link_unmeasured():
            # Our latencies say it now: withdraw the need (a record of 0 replaces ours).
            link = link.model_copy(update={"busy_s": 0.0})
            self.link, self._link_published_at = None, float("-inf")
        if time.monotonic() - self._link_published_at > self.ttl / 3:
            self._link_published_at = self._store(link_key(self.run_id), link)

    def read_links(self, timeout: float = 5.0) -> list[float]:
        """What the links of nodes not yet measured in rounds take for a round of every
        fragment (s)."""
        links = read_records(self.dht, link_key(self.run_id), LinkRecord, timeout)
        return [r.busy_s for r in links.values() if r.busy_s]

    @property
    def read_every(self) -> float:
        """Seconds between a node's reads of the clock once its rounds have started: often
        enough that a retune applies within seconds (one small DHT read)."""
        return min(self.ttl / 6, 5.0)

    @property
    def epoch_notice_s(self) -> float:
        """The least seconds between a retune and the moment its epoch applies: 1.5 read
        intervals and 2 s, so every node that reads has read it (`_maybe_retune`)."""
        return 1.5 * self.read_every + 2.0

    def _maybe_retune(self) -> None:
        """As the swarm's pacemaker: add an epoch when the swarm calls for another rate. It
        starts at least `lead_steps` reference steps (a round period) and 1.5 read
        intervals plus 2 s ahead, so every node reads it before it applies (a node still
        on the old rate past it reads other reference steps than its peers, and misses
        their rounds); readings stay continuous, rounds keep their numbers."""
        assert self.following is not None and self.retune is not None
        clock = clock_of(self.following)
        now_ref = clock.ref_step(self.wall())
        if clock.epochs and now_ref < clock.epochs[-1][0]:
            return  # the last change has not applied yet
        rate = self.retune(clock, now_ref, self.read_links())
        if rate is None:
            return
        if len(clock.epochs) >= MAX_CLOCK_EPOCHS:
            # One more would make the record invalid to every reader: the peers would keep
            # the clock we left, and we would read theirs back at the next pass.
            if not self._full_warned:
                log.warning("swarm clock: %d epochs, the most a clock record holds; the rate "
                            "stays at %.4g s per reference step (wanted %.4g s)",
                            len(clock.epochs), clock.current_step_seconds, rate)
                self._full_warned = True
            return
        ahead = max(self.lead_steps, self.epoch_notice_s / clock.rate_at(now_ref))
        since = float(math.ceil(now_ref + ahead))
        record = self.following.model_copy(update={
            "epochs": [*self.following.epochs, [since, float(rate)]],
            "paced_by": self.dht.peer_id})
        log.info("swarm clock: one reference step = %.4g s from reference step %d (was %.4g s)",
                 rate, since, clock.current_step_seconds)
        self.retunes += 1
        self._follow(record)

    def _follow(self, record: ClockRecord, proposed: bool = False) -> None:
        mine = self.following
        if mine is not None and (mine.t0, mine.origin, mine.epochs, mine.paced_by) == \
                (record.t0, record.origin, record.epochs, record.paced_by):
            return
        same_lineage = mine is not None and (mine.t0, mine.origin) == (record.t0, record.origin)
        switching = mine is not None and not same_lineage and self.frozen()
        self.following = record
        self.pacer.clock = clock_of(record)
        self._published_at = float("-inf")  # republish the one we follow now
        if same_lineage:
            log.info("swarm clock: now %d epoch(s); one reference step = %.4g s from "
                     "reference step %d", len(record.epochs), record.epochs[-1][1]
                     if record.epochs else record.step_seconds,
                     record.epochs[-1][0] if record.epochs else 0)
        elif switching:
            self.switches += 1
            log.warning("swarm clock: switching to the clock started by %s %.1f s earlier "
                        "than ours (two groups met); rounds in between are missed",
                        record.origin, (mine.t0 if mine else record.t0) - record.t0)
        else:
            log.info("swarm clock: %s (one reference step = %.4g s)",
                     "proposing ours" if proposed else f"following {record.origin}'s",
                     record.step_seconds)

    def _publish(self) -> None:
        assert self.following is not None
        mine = self.following.model_copy(update={"peer_id": self.dht.peer_id})
        self._published_at = self._store(clock_key(self.run_id), mine)

    # -- background thread ---------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dilonode-clock", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.run_pass()
            wait = self.poll if not self.frozen() else self.read_every
            self._stop.wait(wait)

    def run_pass(self) -> None:
        """One pass of the thread: `tick`, a failure logged (a DHT hiccup: read again at
        the next pass). A node that has not read the clock for longer than an epoch's
        notice (`epoch_notice_s`) says so once: it may be on a rate its peers have left."""
        try:
            self.tick()
        except Exception as exc:
            log.debug("swarm clock: %s", exc)
            unread = self.wall() - self._read_at
            if self.following is not None and not self._unread_warned \
                    and unread > self.epoch_notice_s:
                log.warning("swarm clock: not read for %.0f s (%s); following the clock "
                            "read before, which the swarm may have retuned", unread,
                            str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                self._unread_warned = True

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
