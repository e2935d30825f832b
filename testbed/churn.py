"""Churn on the WAN test bed: N nodes train; every K seconds one is SIGKILLed and a new one
(a fresh worker id, on the host the dead one left) joins, recovers the state from its peers
and trains on. Used by tests/integration/test_churn.py and benchmarks/testbed/churn.py.

    result = run_churn(cfg, ChurnPlan(nodes=4, period_s=20, cycles=3, last_kill_step=200),
                       rate_mbit=50)
    result.max_step_gap_s(), result.fragment_gaps_s(), result.survivors()

Every event a node prints (`started`, `recovered`, `progress` with per-fragment round counts,
`summary`) is time-stamped here as it arrives, so stalls are measured from the outside: the
longest time a live node's step stood still, and the longest time no node advanced a
fragment's round. Nodes run to `cfg.total_steps`; a joiner takes the swarm's step with the
state, so every survivor ends at the same step.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from typing import Any

from testbed.hosts import swarm_on_testbed

__all__ = ["ChurnPlan", "ChurnResult", "NodeTrack", "run_churn"]


@dataclass(frozen=True)
class ChurnPlan:
    """When nodes die and join."""

    nodes: int = 4  # live nodes at any time
    period_s: float = 20.0  # K: one node killed and one started every K seconds
    # ... or every this many steps of the most advanced node, if that comes first (so a fast
    # machine still sees its kills before last_kill_step)
    period_steps: int = 10**9
    cycles: int = 3  # kill/start pairs at most
    last_kill_step: int = 10**9  # no kill once a node has passed this step (room to finish)
    deadline_s: float = 900.0  # the whole run, start to last summary

    def __post_init__(self) -> None:
        if self.nodes < 2 or self.period_s <= 0 or self.period_steps < 1 or self.cycles < 0:
            raise ValueError(f"ChurnPlan(nodes={self.nodes}, period_s={self.period_s}, "
                             f"period_steps={self.period_steps}, cycles={self.cycles}): need "
                             "nodes >= 2, period_s > 0, period_steps >= 1, cycles >= 0")


@dataclass
class NodeTrack:
    """One node process as seen from outside: its events with arrival times."""

    name: str
    host: str
    started_at: float
    killed_at: float | None = None
    recovered: dict[str, Any] | None = None
    progress: list[tuple[float, int, dict[str, int]]] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    ended_at: float | None = None
    bytes_sent: int = 0  # payload bytes, as of its last progress event or its summary

    @property
    def joiner(self) -> bool:
        return self.recovered is not None

    def round_advances(self) -> dict[str, list[float]]:
        """Fragment -> times at which this node's round count of it went up."""
        out: dict[str, list[float]] = {}
        last: dict[str, int] = {}
        for t, _step, rounds in self.progress:
            for frag, n in rounds.items():
                if n > last.get(frag, 0):
                    out.setdefault(frag, []).append(t)
                last[frag] = n
        return out


@dataclass
class ChurnResult:
    """Everything `run_churn` saw; the methods turn it into the figures tests check."""

    nodes: dict[str, NodeTrack]
    kills: list[tuple[float, str, str]]  # (time, killed node, started node)
    training_at: float  # every initial node had reported progress
    ended_at: float
    timeout_s: float  # the config's network.allreduce_timeout

    def survivors(self) -> dict[str, dict[str, Any]]:
        return {n: t.summary for n, t in self.nodes.items() if t.summary is not None}

    def max_step_gap_s(self) -> float:
        """Longest time any live node's step stood still (between two progress events)."""
        gaps = [0.0]
        for t in self.nodes.values():
            times = [p[0] for p in t.progress if p[0] >= self.training_at]
            gaps += [b - a for a, b in zip(times, times[1:], strict=False)]
        return max(gaps)

    def fragment_gaps_s(self) -> dict[str, float]:
        """Per fragment: longest time between two round advances seen on any node, over
        the churn (from training_at to the last summary)."""
        times: dict[str, list[float]] = {}
        for t in self.nodes.values():
            for frag, ts in t.round_advances().items():
                times.setdefault(frag, []).extend(ts)
        out = {}
        for frag, ts in sorted(times.items()):
            seq = sorted([self.training_at, *[x for x in ts if x >= self.training_at]])
            out[frag] = max(b - a for a, b in zip(seq, seq[1:], strict=False)) \
                if len(seq) > 1 else float("inf")
        return out

    def advances_per_period(self) -> list[dict[str, int]]:
        """For each interval between kills (and after the last), round advances per fragment."""
        edges = [self.training_at, *[k[0] for k in self.kills], self.ended_at]
        frags = sorted({f for t in self.nodes.values() for f in t.round_advances()})
        out = []
        for a, b in zip(edges, edges[1:], strict=False):
            out.append({f: sum(a <= x < b for t in self.nodes.values()
                               for x in t.round_advances().get(f, [])) for f in frags})
        return out


def run_churn(cfg: Any, plan: ChurnPlan, rate_mbit: float | None) -> ChurnResult:
    """Run `plan` on a fresh test bed with `cfg` (its total_steps ends the run)."""
    with swarm_on_testbed(cfg, plan.nodes, rate_mbit) as (_bed, swarm):
        return _Churn(swarm, plan, cfg.network.allreduce_timeout).run()


class _Churn:
    def __init__(self, swarm: Any, plan: ChurnPlan, timeout_s: float) -> None:
        self.swarm, self.plan, self.timeout_s = swarm, plan, timeout_s
        self.tracks: dict[str, NodeTrack] = {}
        self.procs: dict[str, Any] = {}
        self.kills: list[tuple[float, str, str]] = []
        self.next_id = plan.nodes
        self.deadline = time.monotonic() + plan.deadline_s

    def run(self) -> ChurnResult:
        sw = self.swarm
        sw.start_bootstrap()
        sw.start_nodes()
        now = time.monotonic()
        for i, proc in enumerate(sw.procs):
            name = f"node-{i}"
            self.procs[name] = proc
            self.tracks[name] = NodeTrack(name, sw.placement.host_of(name), now)
        self._pump_until(lambda: all(t.progress for t in self.tracks.values()))
        training_at = time.monotonic()
        while len(self.kills) < self.plan.cycles:
            at, step = time.monotonic() + self.plan.period_s, self._top_step()
            self._pump_until(lambda at=at, step=step: time.monotonic() >= at or self._all_ended()
                             or self._top_step() >= step + self.plan.period_steps)
            if self._all_ended() or self._top_step() > self.plan.last_kill_step:
                break
            self._kill_and_replace()
        self._pump_until(self._all_ended)
        return ChurnResult(self.tracks, self.kills, training_at, time.monotonic(),
                           self.timeout_s)

    def _top_step(self) -> int:
        return max((t.progress[-1][1] for t in self.tracks.values() if t.progress), default=0)

    def _live(self) -> list[str]:
        """Nodes still training (a node that printed its summary is done, not a victim)."""
        return [n for n, t in self.tracks.items()
                if t.killed_at is None and t.ended_at is None and t.summary is None]

    def _all_ended(self) -> bool:
        return not self._live()

    def _kill_and_replace(self) -> None:
        # The oldest live node dies, so over several cycles joiners get killed too.
        victim = self._live()[0]
        self.procs[victim].kill()
        self.procs[victim].wait(timeout=10)
        now = time.monotonic()
        self.tracks[victim].killed_at = now
        name = f"node-{self.next_id}"
        self.next_id += 1
        host = self.tracks[victim].host
        self.swarm.placement.place(name, host)
        # min_peers is the first nodes' start barrier; a joiner enters a running swarm, and
        # waiting for peers after recovering would let its fresh state go stale.
        self.procs[name] = self.swarm.start_node(self.next_id - 1,
                                                 ["--set", "network.min_peers=1"])
        self.tracks[name] = NodeTrack(name, host, now)
        self.kills.append((now, victim, name))

    def _pump_until(self, done: Any) -> None:
        while not done():
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"churn run still going after {self.plan.deadline_s} s; "
                                   f"live: {self._live()}")
            try:
                name, ev = self.swarm.events.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            self._on_event(name, ev, time.monotonic())

    def _on_event(self, name: str, ev: dict[str, Any], now: float) -> None:
        track = self.tracks.get(name)
        if track is None:
            return  # the bootstrap
        kind = ev.get("event")
        if kind == "progress":
            # Swarm steps: with pacing by the clock, nodes' own step counts differ.
            track.progress.append((now, int(ev.get("progress", ev["step"])),
                                   dict(ev.get("rounds") or {})))
            track.bytes_sent = int(ev.get("bytes_sent", 0))
        elif kind == "recovered":
            track.recovered = ev
        elif kind == "summary":
            track.summary = ev
            track.bytes_sent = int(ev["bytes_sent"])
        elif kind == "eof" and track.killed_at is None:
            track.ended_at = now
