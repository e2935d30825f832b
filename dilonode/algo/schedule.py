"""The Streaming DiLoCo sync plan as a pure function of the step.

Steps count completed inner steps from 1. Fragment p (of P) first syncs at step
(p + 1) * H // P and then every H steps; round r of fragment p starts at
start(p, r) = (p + 1) * H // P + r * H and its result is merged tau steps later, at
start(p, r) + tau. With P = 1 and tau = 0 this is plain DiLoCo: sync and merge every H steps.
Within one step, starts are listed before lands, so tau = 0 means "start, then merge now".
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SyncLand", "SyncPlan", "SyncStart", "auto_merge_delay"]


@dataclass(frozen=True)
class SyncStart:
    """Compute fragment's pseudo-gradient and start averaging it."""

    fragment: int
    round: int


@dataclass(frozen=True)
class SyncLand:
    """Take the averaged pseudo-gradient of (fragment, round): outer step, then merge."""

    fragment: int
    round: int


@dataclass(frozen=True)
class SyncPlan:
    """H (sync_every), P (num_fragments), tau (fragment_sync_delay)."""

    sync_every: int
    num_fragments: int
    delay: int = 0

    def __post_init__(self) -> None:
        if self.sync_every < 1:
            raise ValueError(f"diloco.sync_every = {self.sync_every}: must be >= 1")
        if not 1 <= self.num_fragments <= self.sync_every:
            raise ValueError(f"diloco.num_fragments = {self.num_fragments}: must be between 1 "
                             f"and diloco.sync_every = {self.sync_every} (one offset per step)")
        if not 0 <= self.delay < self.sync_every:
            raise ValueError(f"diloco.fragment_sync_delay = {self.delay}: must be in "
                             f"[0, sync_every = {self.sync_every})")

    def offset(self, fragment: int) -> int:
        """Step of the first sync of `fragment`."""
        return (fragment + 1) * self.sync_every // self.num_fragments

    def start_step(self, fragment: int, round: int) -> int:
        return self.offset(fragment) + round * self.sync_every

    def _round_at(self, fragment: int, step: int) -> int | None:
        o = self.offset(fragment)
        if step < o or (step - o) % self.sync_every:
            return None
        return (step - o) // self.sync_every

    def actions(self, step: int) -> list[SyncStart | SyncLand]:
        """What to do after inner step `step` has completed."""
        out: list[SyncStart | SyncLand] = []
        for p in range(self.num_fragments):
            r = self._round_at(p, step)
            if r is not None:
                out.append(SyncStart(p, r))
        for p in range(self.num_fragments):
            r = self._round_at(p, step - self.delay)
            if r is not None:
                out.append(SyncLand(p, r))
        return out

    def start_gaps(self) -> list[int]:
        """Steps from each fragment's round start to the next start of any fragment, in
        start order, the last one wrapping around to the first fragment's next round."""
        starts = sorted(self.offset(p) for p in range(self.num_fragments))
        return [b - a for a, b in zip(starts, [*starts[1:], starts[0] + self.sync_every],
                                      strict=True)]

    def rounds_started(self, fragment: int, step: int) -> int:
        """How many rounds of `fragment` have started by the end of `step`."""
        o = self.offset(fragment)
        return 0 if step < o else (step - o) // self.sync_every + 1


def auto_merge_delay(sync_every: int, num_fragments: int) -> int:
    """tau for `fragment_sync_delay = "auto"`: half the narrowest gap between two
    fragments' round starts, rounded up (5 at H = 30, P = 3). Paced by the clock, a result
    that arrives later merges when it arrives, so the delay never costs waiting and the
    merge follows the links on its own when they are slow; on fast links it waits for
    the delay. Merging about two steps in, or one step before the next fragment's round
    (H/P - 1), ended higher on the mean in the simulator; on the test bed the delay's
    effect was inside the spread between runs (docs/reports/2026-11-27-merge-delay-sim.md and
    docs/reports/2026-11-28-autotune-20mbit.md, at H = 30, P = 3)."""
    return max((min(SyncPlan(sync_every, num_fragments).start_gaps()) + 1) // 2, 1)
