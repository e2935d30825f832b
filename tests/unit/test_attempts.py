"""A round's failed attempts are typed values (`AttemptFailure`: no group formed, or the
round failed, with a one-line reason), the attempts a round took are counted from them,
and a matchmaker's `GroupNotFormed` blame leaves the blamed peer out of the next attempt.
Fake matchmaking and rounds, no sockets."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import torch

from dilonode.allreduce import retry
from dilonode.allreduce.driver import RoundOutcome
from dilonode.allreduce.retry import AttemptFailure, RoundPolicy, SwarmRounds
from dilonode.allreduce.round import RoundFailure, RoundState, group_digest
from dilonode.collective import FormedGroup, GroupNotFormed, GroupRequest, RoundRequest, SyncKey

ME, LEADER, OTHER = "peer-a", "peer-l", "peer-b"
ROUND = RoundRequest(SyncKey("fragment", 0, 3))


def _rounds(monkeypatch: Any, asked: list[set[str]], fail_rounds: set[int]) -> SwarmRounds:
    """Attempt 0 forms no group (its leader never closed it); the attempts in `fail_rounds`
    form one whose round fails; the others succeed."""

    def form(req: GroupRequest) -> FormedGroup:
        asked.append(set(req.exclude))
        if req.attempt == 0:
            raise GroupNotFormed(f"no roster from leader {LEADER}\nwithin 2.0s", blame=LEADER)
        members = [ME, OTHER]
        return FormedGroup(members, {p: f"127.0.0.1:{9000 + i}" for i, p in enumerate(members)},
                           [1.0, 1.0], 0, group_digest(members))

    async def run_round(plane: Any, spec: Any, my_index: int, local: torch.Tensor,
                        *_: Any, **__: Any) -> RoundOutcome:
        if spec.attempt in fail_rounds:
            return RoundOutcome(RoundState.FAILED, None, None,
                                RoundFailure("timed out", culprits=(1,)), 0, 0, 0, 0, 1.0,
                                members=spec.members, attempt=spec.attempt)
        return RoundOutcome(RoundState.DONE, local.clone(), "digest", None, 0, 0, 0, 0, 1.0,
                            members=spec.members, attempt=spec.attempt)

    monkeypatch.setattr(retry, "run_round", run_round)
    plane = SimpleNamespace(peer_id=ME, run_id="attempts-unit")
    return SwarmRounds(plane, form, RoundPolicy(codec="float32", max_attempts=3))  # type: ignore[arg-type]


def test_failed_attempts_are_typed_and_counted(monkeypatch):
    asked: list[set[str]] = []
    got = asyncio.run(_rounds(monkeypatch, asked, {1}).reduce(ROUND, torch.ones(8)))
    assert got.outcome.state is RoundState.DONE and not got.skipped
    assert got.failures == (
        AttemptFailure(0, "no_group", f"no roster from leader {LEADER} within 2.0s"),
        AttemptFailure(1, "round_failed", "timed out"))
    assert [f.line() for f in got.failures] == [
        f"attempt 0: no group: no roster from leader {LEADER} within 2.0s",
        "attempt 1: timed out"]
    assert got.tries == 3  # one formation without a round, two rounds run
    # The blamed leader is left out from the next attempt on, the failed round's culprit
    # after it.
    assert asked == [set(), {LEADER}, {LEADER, OTHER}]


def test_a_round_with_no_successful_attempt_counts_every_one(monkeypatch):
    got = asyncio.run(_rounds(monkeypatch, [], {1, 2}).reduce(ROUND, torch.ones(8)))
    assert got.skipped and got.tries == 3
    assert [f.kind for f in got.failures] == ["no_group", "round_failed", "round_failed"]
