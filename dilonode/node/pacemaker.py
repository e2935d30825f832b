"""The swarm clock of a node paced by time (`diloco.pacing = "time"`): agreeing on it
through the DHT (`swarm/clock.py`'s `ClockKeeper`), which live node retunes it (the
pacemaker), what a joiner's state fetch measured of its link, and the first round a
joiner names in its record.

`Pacemaker(cfg, dht, worker, membership)` builds the keeper and does no I/O; `start()`
reads the clock once (a clock that already stands is followed from the first step) and
keeps it in a background thread; `close()` stops it. The node hands `announce_link` to
its state keeper (called once a recovery measured the link) and `first_round` to the
keeper's `prepare`. `is_pacemaker` and `retune_seconds` are the pure parts.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from dilonode.algo.codecs import get_codec
from dilonode.algo.pacing import (
    SwarmClock,
    TimePacer,
    expected_round_seconds,
    first_round,
    link_busy_seconds,
    retune_step_seconds,
)
from dilonode.config import RunConfig
from dilonode.status.snapshot import p90
from dilonode.swarm import swarm_time
from dilonode.swarm.clock import ClockKeeper
from dilonode.swarm.dht import SwarmDHT
from dilonode.swarm.membership import Membership

__all__ = ["Pacemaker", "is_pacemaker", "retune_seconds"]

log = logging.getLogger(__name__)


def is_pacemaker(peer_id: str, live: Collection[str], pacers: Collection[str] = ()) -> bool:
    """Whether `peer_id` retunes the swarm clock: the smallest peer id among the live nodes
    and `pacers`, the node that added the standing clock's last epoch if it still publishes
    the clock (`ClockKeeper.pacers`). Live views differ for a while (a record late to one
    reader): a node missing a smaller pacemaker from its view still sees its epoch in the
    clock, and defers to it; two that act at once resolve by the clock records' rule, which
    favours the smaller id. A node whose own record is not among the live ones yet (a
    joiner still fetching the state) does not pace: it knows no round latencies of its
    own, and a second pacemaker's epoch races the first's."""
    return peer_id in live and peer_id == min({*live, *pacers})


def retune_seconds(algo: Any, worker: Any, peers: Iterable[Any], clock: SwarmClock,
                   link_busy: Sequence[float] = (), *, me: str,
                   expected_round_s: float = 0.0) -> float | None:
    """Seconds per reference step the swarm needs (`pacing.retune_step_seconds`), from the
    round latencies (ours, `worker.stats.recent_latency`, and the live `peers`' published
    p90s), what the links of nodes not yet in rounds take for a round of every fragment
    (`link_busy`), and, when the clock was measured rather than set by hand
    (`algo.step_seconds` unset), the paces (wall seconds per own step) and lags behind the
    clock that live nodes publish. `me`: our peer id (our own record among `peers` is
    read from the worker, not counted twice). `expected_round_s`: what a round is expected
    to take (`pacing.expected_round_seconds`), standing in for the latencies until a
    round has measured one, so that paces alone never set a clock faster than the links
    are expected to allow.

    None when fewer than two nodes (a joiner's link record counts as one) gave a figure:
    one node's view is no swarm's (it went alone, so its rounds measured no link, and its
    pace counts the waits for peers that were not there). With paces from fewer than two
    nodes the rate keeps its pace (the latencies may still slow it)."""
    measured = algo.step_seconds is None
    own = p90(list(worker.stats.recent_latency))
    latencies = [own] if own is not None else []
    steps = [s] if measured and (s := worker.pacer.pace_s) else []
    behind = [float(worker.swarm_step - worker.step)] if steps else []
    nodes = int(bool(latencies or steps)) + len([b for b in link_busy if b > 0])
    for rec in peers:
        if rec.peer_id == me:
            continue
        status, gave = rec.status or {}, False
        if (value := _positive(status.get("round_p90_s"))) is not None:
            latencies.append(value)
            gave = True
        if measured and (value := _positive(status.get("pace_s"))) is not None:
            steps.append(value)
            gave = True
            if (lag := _steps_behind(status)) is not None:
                behind.append(lag)
        nodes += gave
    if nodes < 2:
        return None
    if not latencies and expected_round_s > 0:
        latencies = [expected_round_s]
    if measured and len(steps) < 2:
        steps, behind = [clock.current_step_seconds], []
    return retune_step_seconds(clock, latencies, steps, algo.sync_every,
                               algo.min_round_seconds, algo.max_round_seconds, link_busy,
                               behind)


class Pacemaker:
    """The swarm clock of one node whose worker is paced by it (see the module docstring)."""

    def __init__(self, cfg: RunConfig, dht: SwarmDHT, worker: Any,
                 membership: Membership) -> None:
        if not isinstance(worker.pacer, TimePacer):
            raise ValueError("Pacemaker: the worker is not paced by the swarm clock")
        self.cfg, self.worker, self.membership = cfg, worker, membership
        self.peer_id = dht.peer_id
        self.algo = a = cfg.diloco.effective()
        w, fixed, floor = worker, a.step_seconds, a.min_round_seconds / a.sync_every
        codec = get_codec(cfg.codec.wire_name, cfg.codec.block_size)
        # Each fragment's encoded round result: fixed for the run, read at every retune.
        self._result_bytes = [codec.encoded_size(sum(p.numel() for p in f.params))
                              for f in worker.frags]

        def propose() -> float | None:
            # Measured over a few steps (the first ones include warm-up), unless configured;
            # never so short that a fragment's rounds come faster than a group can form, or
            # than a round is expected to take on our links (`pacing.expected_round_seconds`).
            if fixed:
                return fixed
            if w.step < 5 or not w.pacer.step_s:
                return None
            expected = self._expected_round_s()
            links = 2.0 * expected / a.sync_every  # the retune's rule: half a period
            if links > max(w.pacer.step_s, floor):
                log.info("swarm clock: %.4g s a reference step for the links (a round "
                         "expected to take %.1f s at %.3f s a DHT call; our steps take "
                         "%.4g s)", links, expected, self.keeper.dht_call_s, w.pacer.step_s)
            return max(w.pacer.step_s, floor, links)

        self.keeper = ClockKeeper(dht, cfg.run_id, w.pacer, propose,
                                  frozen=lambda: any(f.next_round or f.pending is not None
                                                    for f in w.frags),
                                  ttl=max(4 * cfg.network.peer_ttl, 60.0),
                                  retune=self._retune if a.retune_clock else None,
                                  pacemaker=self._is_pacemaker, lead_steps=a.sync_every,
                                  link_unmeasured=lambda: len(w.stats.recent_latency) < 3,
                                  wall=swarm_time.now)

    def _expected_round_s(self) -> float:
        """`pacing.expected_round_seconds` from our DHT reads, the live peers we see, our
        fragments' encoded size and `network.bandwidth_mbps`."""
        peers = len(self._live() | {self.peer_id})
        return expected_round_seconds(self.keeper.dht_call_s, self._result_bytes, peers,
                                      self.cfg.network.bandwidth_mbps * 1e6 / 8)

    def start(self) -> None:
        try:
            self.keeper.tick()  # a clock that already stands is followed from the first step
        except (TimeoutError, RuntimeError) as exc:
            log.warning("swarm clock: first read failed (%s); reading again shortly", exc)
        self.keeper.start()

    def close(self) -> None:
        self.keeper.close()

    def _live(self) -> set[str]:
        # max_age=inf: membership's last read, no DHT call on the clock's thread.
        return {r.peer_id for r in self.membership.live_peers(max_age=math.inf)}

    def _is_pacemaker(self) -> bool:
        return is_pacemaker(self.peer_id, self._live(), self.keeper.pacers)

    def _retune(self, clock: SwarmClock, ref_now: float,
                link_busy: Sequence[float] = ()) -> float | None:
        return retune_seconds(self.algo, self.worker,
                              self.membership.live_peers(max_age=math.inf), clock, link_busy,
                              me=self.peer_id, expected_round_s=self._expected_round_s())

    def first_round(self, view_s: float) -> int | None:
        """We are about to publish our record after recovering a running swarm's state:
        name our first round in it, the first reference step `pacing.first_round` allows
        once `view_s` has passed, so that every peer counts us from the same round on
        whenever it reads the record. Returns the step our state must reach (every round
        before it), or None while no clock is agreed."""
        pacer = self.worker.pacer
        if pacer.clock is None:
            return None
        joins_from = first_round(pacer.clock.ref_step(pacer.now() + view_s))
        self.membership.join_from(joins_from)
        log.info("state sync: our first round is reference step %.1f of the swarm clock",
                 joins_from)
        return self.worker.joining_floor(joins_from)

    def announce_link(self, rate_Bps: float, result_bytes: dict[int, int], peers: int) -> None:
        """Our state fetch measured our link. If it is slower than `network.bandwidth_mbps`,
        take that as our weight in rounds (a smaller part of each round's traffic goes
        through it); and tell the pacemaker how long a round of every fragment takes on it
        (`pacing.link_busy_seconds`), so that the clock slows before our first round, not
        after slow ones. Fragments whose results the manifests did not list count as the
        mean of those that did."""
        if self.membership.advertise_bandwidth(rate_Bps * 8e-6):
            log.info("link: state sync moved %.1f Mbit/s, under network.bandwidth_mbps = %g: "
                     "our rounds give us a part of that weight", rate_Bps * 8e-6,
                     self.cfg.network.bandwidth_mbps)
        if not result_bytes:
            return
        mean = sum(result_bytes.values()) / len(result_bytes)
        sizes = [result_bytes.get(p, mean) for p in range(self.algo.num_fragments)]
        # As if our part were an equal one, though our weight may now be smaller: while we
        # fetch, the clock must also leave our link room for the results of every round
        # that lands meanwhile (B / rate each), or the fetch chases them pass after pass
        # while our peers wait for our first round. Counting the smaller part would set a
        # faster clock than the link allows (docs/reports/2026-11-29-slow-joiner.md).
        busy = link_busy_seconds(sizes, peers, rate_Bps)
        log.info("link: state sync moved %.2f MB/s; a round of every fragment with %d peers "
                 "takes %.1f s of it (published until our rounds measure it)",
                 rate_Bps / 1e6, peers, busy)
        if busy > 0:
            self.keeper.announce_link(busy, rate_Bps)


def _steps_behind(status: dict[str, Any]) -> float | None:
    """Reference steps the clock read minus the own steps a peer had trained, at its last
    published step (`swarm_step`, `step` of its status), else None (peers' data)."""
    ref, own = status.get("swarm_step"), status.get("step")
    if all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 40
           for v in (ref, own)):
        return float(ref - own)
    return None


def _positive(value: Any) -> float | None:
    """A finite positive number read off a peer's status, else None (peers' data)."""
    if isinstance(value, int | float) and not isinstance(value, bool) \
            and math.isfinite(value) and 0 < value < 1e5:
        return float(value)
    return None
