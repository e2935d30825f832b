"""Peers that all went alone in the same round (each applied its own pseudo-gradient) re-sync
to ONE state: each counts its own state as a candidate, so they all pick the same one, where
picking among the others only had them swap states and stay apart. 127.0.0.1, in-process
state servers with credentials; seconds."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from dilonode.net.auth import Credentials, Identity
from dilonode.statesync.client import recover
from dilonode.statesync.keeper import min_rounds
from dilonode.statesync.server import SnapshotSource, StateServer
from dilonode.train.state import WorkerState
from tests.integration.test_join import _assert_same, _FixedWorker, _state
from tests.integration.test_state_sync_auth import CFG, DIGEST
from tests.support.waiting import wait_until_async


async def _resync_all(states: dict[str, WorkerState],
                      creds: dict[str, Credentials]) -> dict[str, WorkerState]:
    servers = {p: StateServer(SnapshotSource(_FixedWorker(s)), CFG.run_id, DIGEST,
                              CFG.statesync, auth=creds[p]) for p, s in states.items()}
    addrs = {p: await s.start() for p, s in servers.items()}
    try:
        async def one(me: str) -> WorkerState:
            local = states[me]
            got = await recover({p: a for p, a in addrs.items() if p != me}, local,
                                CFG.run_id, DIGEST, CFG.statesync,
                                min_rounds=sum(local.rounds) - 1, auth=creds[me],
                                own_candidate=True)
            return local if got is None else got.state

        ends = await asyncio.wait_for(asyncio.gather(*(one(p) for p in states)), 60)
        return dict(zip(states, ends, strict=True))
    finally:
        for s in servers.values():
            await s.aclose()


@pytest.mark.timeout(120)
def test_peers_diverged_in_the_same_round_resync_to_one_state() -> None:
    ids = sorted((Identity.generate() for _ in range(3)), key=lambda i: i.peer_id)
    creds = {i.peer_id: Credentials(i, CFG.run_id, b"resync-choice-secret") for i in ids}
    # Same round counters, different bytes: what three lone rounds leave behind.
    states = {i.peer_id: _state(seed, numel=20_000) for seed, i in enumerate(ids)}
    ends = asyncio.run(_resync_all(states, creds))
    smallest = ids[0].peer_id
    for peer, end in ends.items():
        _assert_same(end, states[smallest], f"{peer} after the re-sync")


def _lone_round_states() -> tuple[WorkerState, WorkerState, WorkerState]:
    """What the peers hold while their round on fragment 0 is in flight, what they hold
    once it landed, and what we hold after going through that round alone."""
    before = _state(0, numel=20_000)  # step 42, rounds (7, 7, 6)
    landed = dataclasses.replace(_state(5, numel=20_000), step=48, rounds=(8, 7, 6),
                                 outer_steps=(8, 7, 6))
    mine = dataclasses.replace(_state(9, numel=20_000), step=48, rounds=(8, 7, 6),
                               outer_steps=(8, 7, 6))
    return before, landed, mine


async def _resync_after_lone_round(peer_step: int, land: bool) -> tuple[Any, list[int]]:
    ids = sorted((Identity.generate() for _ in range(3)), key=lambda i: i.peer_id)
    creds = {i.peer_id: Credentials(i, CFG.run_id, b"resync-choice-secret") for i in ids}
    me, peers = ids[0].peer_id, [i.peer_id for i in ids[1:]]
    before, landed, mine = _lone_round_states()
    workers = {p: _FixedWorker(before) for p in peers}
    for w in workers.values():
        w.step = peer_step  # trained on while their round is in flight (or lagging)
    servers = {p: StateServer(SnapshotSource(workers[p]), CFG.run_id, DIGEST, CFG.statesync,
                              auth=creds[p]) for p in peers}
    addrs = {p: await s.start() for p, s in servers.items()}
    try:
        task = asyncio.create_task(recover(
            addrs, mine, CFG.run_id, DIGEST, CFG.statesync, min_rounds=sum(mine.rounds) - 1,
            auth=creds[me], own_candidate=True, wait_behind=60.0,
            wait_from_step=mine.step - 2))
        if land:
            await wait_until_async(lambda: task.done() or all(
                s.manifests_served >= 2 for s in servers.values()), 30.0, interval=0.005,
                what="two manifest passes")
            assert not task.done(), "gave up before the peers landed their round"
            for w in workers.values():
                w.state, w.step = landed, landed.step
        got = await asyncio.wait_for(task, 60)
        return got, [s.manifests_served for s in servers.values()]
    finally:
        for s in servers.values():
            await s.aclose()


@pytest.mark.timeout(120)
def test_after_a_lone_round_peers_still_landing_it_are_waited_for() -> None:
    # The peers formed the round's group without us and are past its start (step 47 >=
    # 46): once they land it, their agreed state replaces ours.
    got, _ = asyncio.run(_resync_after_lone_round(peer_step=47, land=True))
    assert got is not None
    _assert_same(got.state, _lone_round_states()[1], "after the re-sync")


@pytest.mark.timeout(120)
def test_after_a_lone_round_slower_peers_are_not_waited_for() -> None:
    # Peers that have not reached the round's start are slower, not landing it: one
    # manifest pass, and we keep our state.
    got, served = asyncio.run(_resync_after_lone_round(peer_step=44, land=False))
    assert got is None
    assert served == [1, 1]


@pytest.mark.timeout(120)
def test_the_standing_state_is_taken_even_with_fewer_rounds_than_ours() -> None:
    # At the end of a run a late joiner's lone rounds took its counters to (9, 7, 6) while
    # the swarm stands at (8, 7, 6): told whose state stands, it takes theirs anyway.
    ids = sorted((Identity.generate() for _ in range(3)), key=lambda i: i.peer_id)
    creds = {i.peer_id: Credentials(i, CFG.run_id, b"resync-choice-secret") for i in ids}
    me, peers = ids[0].peer_id, [i.peer_id for i in ids[1:]]
    _, landed, mine = _lone_round_states()
    mine = dataclasses.replace(mine, step=54, rounds=(9, 7, 6), outer_steps=(9, 7, 6))
    assert min_rounds(mine.rounds, True, ()) >= sum(landed.rounds)  # not without `prefer`

    async def main() -> Any:
        servers = [StateServer(SnapshotSource(_FixedWorker(landed)), CFG.run_id, DIGEST,
                               CFG.statesync, auth=creds[p]) for p in peers]
        addrs = {p: await s.start() for p, s in zip(peers, servers, strict=True)}
        try:
            return await asyncio.wait_for(recover(
                addrs, mine, CFG.run_id, DIGEST, CFG.statesync, auth=creds[me],
                min_rounds=min_rounds(mine.rounds, True, tuple(peers)), prefer=peers), 60)
        finally:
            for s in servers:
                await s.aclose()

    got = asyncio.run(main())
    assert got is not None
    _assert_same(got.state, landed, "after adopting the standing state")
