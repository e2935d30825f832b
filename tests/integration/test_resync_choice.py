"""Peers that all went alone in the same round (each applied its own pseudo-gradient) re-sync
to ONE state: each counts its own state as a candidate, so they all pick the same one, where
picking among the others only had them swap states and stay apart. 127.0.0.1, in-process
state servers with credentials; seconds."""

from __future__ import annotations

import asyncio

import pytest

from dilonode.auth import Credentials, Identity
from dilonode.statesync.service import SnapshotSource, StateServer, recover
from dilonode.train.state import WorkerState
from tests.integration.test_join import _assert_same, _FixedWorker, _state
from tests.integration.test_state_sync_auth import CFG, DIGEST


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
