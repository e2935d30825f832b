"""When a worker starts and lands its fragment rounds: paced by its own steps, or by the
swarm's clock so that workers of different speeds meet in every round.

The sync plan (`schedule.SyncPlan`) places round r of fragment p at *reference step*
`start_step(p, r)`. A pacer maps a worker's progress to reference steps:

* `StepPacer`: the reference step is the worker's own step (every worker runs exactly H
  inner steps per round). Right when all workers are equally fast; a slower one falls
  behind and misses its groups.
* `TimePacer`: the reference step is read off a `SwarmClock` that every node shares (a
  start time and the seconds one reference step lasts, agreed through the DHT by the
  daemon, virtual in the simulator). Rounds open at the same wall time on every node; a
  fast node has done more inner steps by then than a slow one, and each contributes the
  pseudo-gradient of whatever it trained, weighted by its tokens. A worker acts at its
  step boundaries only, so it starts a round at the last boundary before the round opens
  (`lead` = its own step, in reference steps, minus a hair so that a boundary falling
  exactly on the opening still counts as "at" it): at most one of its steps early, never
  late. Early is what matchmaking handles well (a peer alone at the end of its window
  while others are expected waits for them); late registrations miss groups, which is
  how slow nodes were left out of rounds under step pacing.

Landing. With `StepPacer` a round lands exactly tau own steps after it started, blocking if
the result is late (today's Streaming DiLoCo). With `TimePacer` it lands at the first step
boundary at least tau own steps after its start at which the result is there; the worker
blocks only when the fragment's next round is due and the result still is not (`due_starts`
then lists that fragment): the result is truly late.

Everything here is pure: the clock is passed in, nothing reads the time itself.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from dilonode.algo.schedule import SyncPlan, SyncStart

# The most the clock slows below the fastest node's pace to give back steps it ran ahead
# of that node (`retune_step_seconds`): rounds then come at most this much further apart.
_CATCH_UP_MAX = 0.25

# The most one retune changes the seconds per reference step, either way: a swarm that
# needs more gets there an epoch (a round period) at a time, so one wrong reading (a round
# in which the pacemaker went alone, a pace measured across a long state fetch) cannot
# set a clock many times off before the next retune reads the swarm again.
RETUNE_MAX_FACTOR = 4.0

# A round's latency before any round has measured it, in DHT calls
# (`expected_round_seconds`):
# matchmaking's registration, polls, roster store and read and the wait for a competing
# roster; the data connections' handshakes; and TCP's slow start through both halves of
# the butterfly, each a round trip or more. On the WAN test bed, whose longest round trip
# is 0.46 s, rounds took 8-12 s on average: 17-26 of them (docs/reports/
# 2026-12-03-continents-short.md and 2026-12-03-continents-1200.md).
ROUND_TRIPS = 20

# Keeps a boundary that lands on an opening from also counting as "before" the next one
# (equal-speed workers on an exact clock then start exactly where step pacing does).
_HAIR = 1e-6

__all__ = ["JOIN_LEAD_STEPS", "RETUNE_MAX_FACTOR", "Pacer", "StepPacer", "SwarmClock",
           "TimePacer", "due_starts", "expected_round_seconds", "final_rounds", "first_round",
           "link_busy_seconds",
           "retune_step_seconds", "rounds_before"]

# Reference steps by which a joiner's first round follows the moment every peer has read
# its record: a peer starts a round up to its own step early (`TimePacer.at_step`'s lead,
# about one reference step on a clock the swarm keeps up with), and one step to spare.
JOIN_LEAD_STEPS = 2.0


@dataclass(frozen=True)
class SwarmClock:
    """Wall time -> reference steps: step `(t - t0) / step_seconds`, then, from reference
    step `since` of each later epoch `(since, step_seconds)`, at that epoch's rate.

    Epochs let the swarm slow its rounds down (or speed them up) when the links it
    measures call for it (`swarm/clock.py`) without renumbering anything: the reading is
    continuous, only its rate changes, so every round keeps its number and its opening
    step. Epochs are listed in increasing `since`.
    """

    t0: float
    step_seconds: float
    epochs: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        rates = [self.step_seconds, *(s for _, s in self.epochs)]
        starts = [since for since, _ in self.epochs]
        if not (math.isfinite(self.t0) and all(math.isfinite(r) and r > 0 for r in rates)
                and all(math.isfinite(x) and x >= 0 for x in starts)
                and starts == sorted(set(starts))):
            raise ValueError(f"SwarmClock: t0={self.t0}, step_seconds={self.step_seconds}, "
                             f"epochs={list(self.epochs)}: need finite values, rates > 0 "
                             "and epochs in increasing order")

    def _segments(self) -> list[tuple[float, float, float]]:
        """(reference step, wall time, seconds per step) at the start of each epoch."""
        out = [(0.0, self.t0, self.step_seconds)]
        for since, rate in self.epochs:
            ref0, t_0, rate0 = out[-1]
            out.append((since, t_0 + (since - ref0) * rate0, rate))
        return out

    def ref_step(self, t: float) -> float:
        ref0, t_0, rate = next(seg for seg in reversed(self._segments())
                               if seg[1] <= t or seg[0] == 0.0)
        return ref0 + (t - t_0) / rate

    def _segment_of(self, ref_step: float) -> tuple[float, float, float]:
        """The segment (see `_segments`) that reference step `ref_step` falls in."""
        return next(seg for seg in reversed(self._segments())
                    if seg[0] <= ref_step or seg[0] == 0.0)

    def time_of(self, ref_step: float) -> float:
        ref0, t_0, rate = self._segment_of(ref_step)
        return t_0 + (ref_step - ref0) * rate

    def rate_at(self, ref_step: float) -> float:
        """Seconds per reference step at reference step `ref_step` (its epoch's rate)."""
        return self._segment_of(ref_step)[2]

    @property
    def current_step_seconds(self) -> float:
        """The rate of the last epoch (what a new epoch is compared with)."""
        return self.epochs[-1][1] if self.epochs else self.step_seconds

    def with_epoch(self, since: float, step_seconds: float) -> SwarmClock:
        """This clock, running at `step_seconds` from reference step `since` on."""
        if self.epochs and since <= self.epochs[-1][0]:
            raise ValueError(f"SwarmClock.with_epoch: since={since} is not after the last "
                             f"epoch's {self.epochs[-1][0]}")
        return SwarmClock(self.t0, self.step_seconds, (*self.epochs, (since, step_seconds)))


class Pacer(Protocol):
    """Where a worker stands on the swarm's schedule; asked once per own step."""

    timed: bool  # lands when results arrive (True) or at exactly tau own steps (False)

    def at_step(self, own_step: int, pause_s: float = 0.0) -> tuple[float, float]:
        """(reference step now, lead): rounds starting at or before their sum are due.
        `pause_s`: work the worker does before its next step (an evaluation), which
        delays its next boundary."""
        ...


class StepPacer:
    """The reference step is the worker's own step; no lead."""

    timed = False

    def at_step(self, own_step: int, pause_s: float = 0.0) -> tuple[float, float]:
        return float(own_step), 0.0


class TimePacer:
    """The reference step is the swarm clock's reading at this step boundary.

    `now()` is the clock the swarm agreed to read (the daemon: `time.time`; the simulator:
    its virtual clock). `clock` may be None until the swarm has agreed on one (the node
    then starts no round). The lead is the worker's own step time (less `_HAIR`): the
    median of the last `window` intervals between calls (sync overhead included, which is
    what decides when its next boundary comes; the median ignores a slow first step or a
    pause).
    """

    timed = True

    def __init__(self, now: Callable[[], float], clock: SwarmClock | None = None,
                 window: int = 9, pace_window: int = 64, pace_first: int = 16) -> None:
        self.now = now
        self.clock = clock
        self._intervals: deque[float] = deque(maxlen=window)
        self._pause = 0.0  # announced at the last boundary: not part of the step time
        # Times of the recent step boundaries, the last one included (`pace_s`).
        self._boundaries: deque[float] = deque(maxlen=pace_window + 1)
        self._pace_first = pace_first

    @property
    def step_s(self) -> float | None:
        """This worker's own step time (median of recent intervals), None before two steps."""
        if not self._intervals:
            return None
        ordered = sorted(self._intervals)
        return ordered[len(ordered) // 2]

    @property
    def pace_s(self) -> float | None:
        """Wall seconds per own step over the last `pace_window` steps, evaluations and
        waits included: how fast this worker gets through reference steps' worth of work,
        what the swarm clock should not outrun (`retune_step_seconds`). Until the window is
        full, over the steps after the first two (they carry warm-up) once there are
        `pace_first` of them, None before: a clock proposed from one node's first steps runs
        ahead of the nodes (evaluations, waits and contention come later), and waiting for
        a full window would leave it there for the run's first rounds."""
        b = self._boundaries
        if b.maxlen is None:
            return None
        first = 0 if len(b) == b.maxlen else 2
        if len(b) - 1 - first < min(self._pace_first, b.maxlen - 1) or b[-1] <= b[first]:
            return None
        return (b[-1] - b[first]) / (len(b) - 1 - first)

    def at_step(self, own_step: int, pause_s: float = 0.0) -> tuple[float, float]:
        t = self.now()
        if self._boundaries and t > (last := self._boundaries[-1]):
            self._intervals.append(t - last - self._pause)
        self._pause = pause_s
        self._boundaries.append(t)
        if self.clock is None:
            return -math.inf, 0.0
        ref = self.clock.ref_step(t)
        # In reference steps at the rate now: after a retune the start rate is not it.
        lead = ((self.step_s or 0.0) + pause_s) / self.clock.rate_at(ref)
        return ref, max(lead - _HAIR, 0.0)

    def restart(self) -> None:
        """Forget the boundaries so far (after a pause that was not a step: a re-sync)."""
        self._boundaries.clear()


def due_starts(plan: SyncPlan, next_round: Sequence[int], ref_now: float,
               lead: float = 0.0) -> list[SyncStart]:
    """The rounds to start at this boundary: for each fragment p whose round next_round[p]
    has started by ref_now + lead, that round, unless a round after the next one has
    started too: then the newest (the rounds between were missed: the worker was paused).

    A worker only one round behind takes part in that round, late, rather than skip it: its
    group waits for it in matchmaking (it is live), and a skip would leave its state a
    round behind theirs, to be fetched again. That is a joiner whose state leaves out the
    rounds in flight that counted it, or a node whose link is slower than rounds come (it
    waited for another fragment's result); the swarm's pacemaker slows the clock for it."""
    out = []
    horizon = ref_now + lead
    for p in range(plan.num_fragments):
        if not math.isfinite(horizon) or plan.start_step(p, next_round[p]) > horizon:
            continue
        # rounds_started counts starts at steps <= floor(horizon); start steps are integers.
        newest = plan.rounds_started(p, math.floor(horizon)) - 1
        out.append(SyncStart(p, newest if newest > next_round[p] + 1 else next_round[p]))
    return out


def first_round(ref_seen: float) -> float:
    """A joiner's first round (`PeerRecord.joins_from`), from `ref_seen`: the reference step
    by which every peer has read its record. Rounds from it on wait for the joiner on every
    peer, even one that starts them its lead early; rounds before it are in the state the
    joiner adopts (`rounds_before`). Peers that read the record at different moments
    still agree which rounds count it."""
    return ref_seen + JOIN_LEAD_STEPS


def rounds_before(plan: SyncPlan, joins_from: float) -> list[int]:
    """Per fragment, how many of its rounds start before reference step `joins_from`: the
    rounds a joiner whose first round that is must find landed in the state it adopts."""
    last = math.ceil(joins_from) - 1  # start steps are integers
    return [plan.rounds_started(p, last) for p in range(plan.num_fragments)]


def final_rounds(plan: SyncPlan, next_round: Sequence[int], end_step: int) -> list[SyncStart]:
    """The end-of-run sync: every fragment whose last round started before `end_step`
    (so it has trained since) gets one more round, numbered after the schedule's rounds
    up to `end_step`; fragments whose round started exactly at `end_step` are already
    fresh. Every worker derives the same list from the plan and the end step.

    A worker whose `next_round` is already past the schedule's rounds holds that final
    round: no round starts past the end, so only a state fetched from peers that had
    landed theirs can (a node paused until its peers ended, resuming while they check).
    Another round would apply the outer step once more, alone, and end it on weights
    no peer holds."""
    out = []
    for p in range(plan.num_fragments):
        started = plan.rounds_started(p, end_step)
        if started and plan.start_step(p, started - 1) == end_step:
            continue
        if next_round[p] > started:
            continue
        out.append(SyncStart(p, started))
    return out


def link_busy_seconds(result_bytes: Sequence[float], peers: int, rate_Bps: float) -> float:
    """Seconds of a link that moves `rate_Bps` each way one round of every fragment takes,
    in a swarm of `peers` nodes (this one included); `result_bytes`: each fragment's
    encoded round result. 0.0 when nothing is known.

    In a butterfly round a node moves, each way, (N-1)/N of its encoded contribution and
    as much of the reduced result: 2 (N-1)/N x bytes / rate seconds of its link. A joiner
    measures its link in its state fetch and asks the clock for room for this before its
    first round (`retune_step_seconds`); its measured round latencies take over after.
    """
    if peers < 2 or not result_bytes or not (math.isfinite(rate_Bps) and rate_Bps > 0):
        return 0.0
    return sum(2.0 * (peers - 1) / peers * b / rate_Bps for b in result_bytes)


def expected_round_seconds(call_s: float, result_bytes: Sequence[float], peers: int,
                           rate_Bps: float) -> float:
    """What a fragment round is expected to take before any round has measured it:
    `ROUND_TRIPS` DHT calls of `call_s` (what the node's DHT reads take) and the largest
    fragment's transfer (`result_bytes`: each fragment's encoded round result) over a link
    of `rate_Bps` in a swarm of `peers` nodes (`link_busy_seconds`). The first clock and
    the retunes before the first measured round leave rounds this long half a period
    (`retune_step_seconds`): a clock set by a fast node's steps alone opens rounds faster
    than long round trips close them, and groups then split and states diverge before
    the first measured retune."""
    transfer = max((link_busy_seconds([b], peers, rate_Bps) for b in result_bytes),
                   default=0.0)
    return ROUND_TRIPS * max(call_s, 0.0) + transfer


def retune_step_seconds(clock: SwarmClock, round_p90s: Sequence[float],
                        step_times: Sequence[float], sync_every: int,
                        min_round_s: float, max_round_s: float,
                        link_busy: Sequence[float] = (),
                        behind: Sequence[float] = ()) -> float | None:
    """Seconds per reference step the swarm needs now, or None to keep `clock` as it is.

    Two needs; the slower clock wins, kept within min_round_s..max_round_s per round period
    (`sync_every` reference steps):

    * links (`round_p90s`: each node's 90th-percentile round latency, matchmaking
      included): a round lands within half a round period, so nobody blocks on a result.
      `link_busy`: nodes not yet in rounds (a joiner that measured its link in its state
      fetch, `link_busy_seconds`) add the time their link takes for a round of every
      fragment to the slowest latency: the most a round can take if every fragment's
      round goes through that link at once, as a joiner's first rounds do. The clock then
      slows before its first round rather than after its rounds were late;
    * throughput (`step_times`: live nodes' wall seconds per own step, `TimePacer.pace_s`;
      empty when the clock's rate was set by hand): one reference step is one step of the
      fastest node, so a run of N reference steps trains N of its steps. A clock proposed
      from a node's first steps runs ahead of the nodes: evaluations, waits and contention
      come later.
      `behind`: each live node's reference steps minus its own steps. A pace alone keeps
      the rate but never gives back the steps a clock already ran ahead (its first rate,
      paces that are averages, the 5% band), so the steps a run trains would follow one
      node's first measurement.
      While even the node furthest along is behind, the clock runs slower than its pace
      by that lag over two round periods (at most `_CATCH_UP_MAX`). Nodes ahead of the
      clock do not speed it up past the pace.

    Without step times the clock is never made faster than it started. Hysteresis: a need
    set by throughput or by a joiner's link retunes past 5% (paces are averages over many
    steps, a link's need is one estimate); one set by latencies alone past 25% slower or
    2x faster (latencies jump with the rounds' traffic). One retune changes the rate by at
    most `RETUNE_MAX_FACTOR` either way; a need further off is met over several epochs.
    """
    lo, hi = min_round_s / sync_every, max_round_s / sync_every
    slowest, busy = max(round_p90s, default=0.0), max(link_busy, default=0.0)
    links = 2.0 * (slowest + busy) / sync_every
    pace = min(step_times) if step_times else clock.step_seconds
    if step_times and (lag := min(behind, default=0.0)) > 0:
        pace *= 1.0 + min(lag / (2.0 * sync_every), _CATCH_UP_MAX)
    now = clock.current_step_seconds
    want = min(max(links, pace, lo), hi)
    want = min(max(want, now / RETUNE_MAX_FACTOR), now * RETUNE_MAX_FACTOR)
    if (step_times and want > links) or (busy > 0 and want > now):
        return want if abs(want / now - 1.0) > 0.05 else None
    return want if want > 1.25 * now or want < 0.5 * now else None
