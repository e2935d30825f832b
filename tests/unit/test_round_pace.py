"""`SwarmOutcome.pace_s`: the round time the swarm's clock is paced by. A round slowed by
other peers' faults (a killed member's failed attempt, a matchmaking window spent on an
expected peer that never came) must not slow the clock: a churn run's clock went from
0.17 s to 2.65 s a reference step on such rounds. Nor must a fault of ours (an Abort
naming us: our payload or our connection), or a round with no successful attempt. And
`SwarmOutcome.forming_s`: the seconds its attempts spent forming groups. Fake
matchmaking, rounds and clock: each attempt's matchmaking takes 0.5 s, a failed attempt
5 s, a good one 1 s."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dilonode.allreduce import retry
from dilonode.allreduce.driver import RoundOutcome
from dilonode.allreduce.retry import RoundPolicy, SwarmRounds
from dilonode.allreduce.round import RoundFailure, RoundState, group_digest
from dilonode.collective import FormedGroup, GroupRequest, RoundRequest, SyncKey

ME, OTHER = "peer-a", "peer-b"


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _reduce(monkeypatch: pytest.MonkeyPatch, failures: dict[int, str],
            missing: tuple[str, ...] = (), attempts: int = 3) -> tuple[Any, float]:
    """Run one round; `failures`: attempt -> the member its failure names."""
    clock = _Clock()

    def form(req: GroupRequest) -> FormedGroup:
        clock.t += 0.5
        members = [ME, OTHER]
        return FormedGroup(members, {p: f"127.0.0.1:{9000 + i}" for i, p in enumerate(members)},
                           [1.0, 1.0], 0, group_digest(members), missing=missing)

    async def run_round(plane: Any, spec: Any, my_index: int, local: torch.Tensor,
                        peers: Any, timeout: float, clock_: Any, **_: Any) -> RoundOutcome:
        if (blamed := failures.get(spec.attempt)) is not None:
            clock.t += 5.0
            failure = RoundFailure("timed out", culprits=(spec.members.index(blamed),))
            return RoundOutcome(RoundState.FAILED, None, None, failure, 0, 0, 0, 0, 5.0,
                                members=spec.members, attempt=spec.attempt)
        clock.t += 1.0
        return RoundOutcome(RoundState.DONE, local.clone(), "digest", None, 0, 0, 0, 0, 1.0,
                            members=spec.members, attempt=spec.attempt)

    monkeypatch.setattr(retry, "run_round", run_round)
    plane = SimpleNamespace(peer_id=ME, run_id="pace-unit")
    rounds = SwarmRounds(plane, form, RoundPolicy(codec="float32", max_attempts=attempts),
                         clock=clock)
    start = clock.t
    got = asyncio.run(rounds.reduce(RoundRequest(SyncKey("fragment", 0, 3)), torch.ones(16)))
    return got, clock.t - start


def test_a_clean_round_is_paced_by_its_matchmaking_and_transfer(monkeypatch):
    got, _ = _reduce(monkeypatch, {})
    assert got.pace_s == pytest.approx(1.5)


def test_a_retry_after_a_peer_failed_paces_by_the_retry_alone(monkeypatch):
    got, total = _reduce(monkeypatch, {0: OTHER})
    assert total == pytest.approx(7.0)
    assert got.pace_s == pytest.approx(1.5)


def test_a_round_that_waited_on_a_missing_peer_does_not_pace_the_clock(monkeypatch):
    got, _ = _reduce(monkeypatch, {}, missing=("peer-dead",))
    assert got.outcome.state is RoundState.DONE and got.pace_s is None


def test_a_retry_after_a_fault_of_ours_paces_by_the_retry_alone(monkeypatch):
    got, total = _reduce(monkeypatch, {0: ME})
    assert total == pytest.approx(7.0)
    assert got.pace_s == pytest.approx(1.5)


def test_a_skipped_round_does_not_pace_the_clock(monkeypatch):
    for blamed in (OTHER, ME):
        got, _ = _reduce(monkeypatch, {0: blamed, 1: OTHER}, attempts=2)
        assert got.skipped and got.pace_s is None


def test_forming_time_counts_every_attempts_matchmaking_and_nothing_else(monkeypatch):
    got, total = _reduce(monkeypatch, {0: OTHER})
    assert total == pytest.approx(7.0) and got.forming_s == pytest.approx(1.0)
    got, _ = _reduce(monkeypatch, {0: OTHER, 1: OTHER}, attempts=2)
    assert got.skipped and got.forming_s == pytest.approx(1.0)
