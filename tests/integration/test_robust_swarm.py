"""Robust aggregation and bans over the real TCP data plane on 127.0.0.1: four nodes, one
contributing a x100 pseudo-gradient, in one event loop (the planes are real sockets)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch

from dilonode.algo.robust import AggregatorSpec, BanTracker
from dilonode.allreduce.retry import RoundPolicy, SwarmOutcome, SwarmRounds
from dilonode.allreduce.round import RoundState, group_digest
from dilonode.allreduce.transport import DataPlane
from dilonode.collective import FormedGroup, GroupRequest, RoundRequest, SyncKey

RUN = "robust-it"
IDS = ("node-0", "node-1", "node-2", "node-3")
NUMEL = 20_000


def _static_group(me: str, addrs: dict[str, str], asked: list[set[str]]) -> Any:
    def form(req: GroupRequest) -> FormedGroup:
        asked.append(set(req.exclude))
        members = [p for p in sorted(addrs) if p not in req.exclude or p == me]
        return FormedGroup(members, {p: addrs[p] for p in members}, [1.0] * len(members),
                           members.index(me), group_digest(members))
    return form


def _round(round_no: int) -> RoundRequest:
    return RoundRequest(SyncKey("fragment", 0, round_no))


def _local(i: int, round_no: int) -> torch.Tensor:
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(10 * round_no + i)) * 0.01
    return x * 100 if i == 3 else x


@pytest.mark.timeout(120)
def test_outlier_is_rejected_everywhere_then_banned_from_matchmaking() -> None:
    policy = RoundPolicy(codec="int8", block_size=64, chunk_numel=4096, timeout=20.0,
                         aggregator=AggregatorSpec(name="trimmed_mean", norm_bound=3.0))
    bans = {pid: BanTracker(max_rejections=1, window=60.0, ban_seconds=60.0) for pid in IDS}
    asked: dict[str, list[set[str]]] = {pid: [] for pid in IDS}

    async def main() -> tuple[list[SwarmOutcome], list[SwarmOutcome]]:
        planes = [DataPlane(pid, RUN) for pid in IDS]
        for p in planes:
            await p.start()
        try:
            addrs = {p.peer_id: p.address for p in planes}
            swarms = [SwarmRounds(p, _static_group(p.peer_id, addrs, asked[p.peer_id]),
                                  policy, bans=bans[p.peer_id]) for p in planes]
            first = await asyncio.gather(*(s.reduce(_round(0), _local(i, 0))
                                           for i, s in enumerate(swarms)))
            # Round 1: the honest nodes meet without node-3, whom they have banned.
            second = await asyncio.gather(*(s.reduce(_round(1), _local(i, 1))
                                            for i, s in enumerate(swarms[:3])))
            return list(first), list(second)
        finally:
            for p in planes:
                await p.aclose()

    first, second = asyncio.run(main())
    assert all(o.outcome.state is RoundState.DONE and not o.skipped for o in first)
    assert len({o.outcome.digest for o in first}) == 1
    assert all(o.outcome.rejected == ("node-3",) == o.outcome.convicted for o in first)
    honest = torch.stack([_local(i, 0) for i in range(3)]).mean(dim=0)
    assert float((first[0].outcome.result - honest).abs().max()) < 0.02  # the mean: ~0.25 off
    now = time.monotonic()  # SwarmRounds' default clock
    assert all(bans[pid].banned(now) == {"node-3"} for pid in IDS[:3])
    assert all(bans[pid].bans_total == 1 for pid in IDS[:3])
    assert bans["node-3"].bans_total == 0  # it does not ban itself
    assert all(o.outcome.members == IDS[:3] and not o.skipped for o in second)
    assert all(asked[pid][-1] == {"node-3"} for pid in IDS[:3])
