"""The relay between nodes behind NATs (dilonode/swarm/tunnel.py), on loopback with real p2pd
daemons: two private nodes (DHT clients, so their daemons never connect to each other, as
behind two NATs) exchange a whole round and a whole state through the bootstrap's relay,
far beyond the 128 KiB after which hivemind's own libp2p circuit relay resets a stream.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("hivemind")

from dilonode.algo.butterfly import butterfly_average  # noqa: E402
from dilonode.algo.codecs import get_codec  # noqa: E402
from dilonode.allreduce.driver import run_round  # noqa: E402
from dilonode.allreduce.round import GroupSpec, RoundState, group_digest  # noqa: E402
from dilonode.allreduce.transport import DataPlane  # noqa: E402
from dilonode.config import load_config  # noqa: E402
from dilonode.statesync.client import recover
from dilonode.statesync.server import SnapshotSource, StateServer  # noqa: E402
from dilonode.swarm import reachability as reach  # noqa: E402
from dilonode.swarm.dht import SwarmDHT  # noqa: E402
from dilonode.swarm.tunnel import Relay, Tunnel, relay_peers  # noqa: E402
from dilonode.train.state import WorkerState, config_digest  # noqa: E402

pytestmark = pytest.mark.slow
RUN, HOST = "relay-it", "127.0.0.1"
NUMEL = 1 << 19  # 2 MiB of float32 each way: 16x what a hivemind circuit carries


class _FixedWorker:
    def __init__(self, state: WorkerState) -> None:
        self.state, self.step, self.pending = state, state.step, {}

    def export_state(self, reuse: WorkerState | None = None) -> WorkerState:
        return self.state


def _inputs(seed: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))


def _private(boot: SwarmDHT) -> SwarmDHT:
    kwargs, flags = reach.dht_options("private", boot.visible_maddrs())
    return SwarmDHT(RUN, boot.visible_maddrs(), host=HOST, p2p_options=kwargs, p2pd_flags=flags)


@pytest.mark.timeout(180)
def test_two_private_nodes_average_and_sync_state_through_the_relay():
    cfg = load_config(overrides={"run_id": RUN})
    digest = config_digest(cfg)
    g = torch.Generator().manual_seed(3)
    truth = WorkerState(12, (2, 2), (2, 2), {
        f"outer.{p}.{k}": torch.randn(150_000 + p, generator=g)
        for p in range(2) for k in ("weights", "momentum")})
    with SwarmDHT(RUN, [], host=HOST) as boot, _private(boot) as da, _private(boot) as db:
        ids = (da.peer_id, db.peer_id)
        relays = relay_peers(boot.visible_maddrs())
        assert relays == [boot.peer_id]

        async def main():
            relay = await Relay.attach(boot.p2p_daemon_maddr(), RUN, lambda p: p in ids)
            tunnels = [Tunnel(d.p2p_daemon_maddr(), RUN, private=True, relays=relays,
                              private_peers=lambda: frozenset(ids)) for d in (da, db)]
            planes = [DataPlane(d.peer_id, RUN, HOST, auth=d.credentials, fallback=t.open)
                      for d, t in zip((da, db), tunnels, strict=True)]
            server = StateServer(SnapshotSource(_FixedWorker(truth)), RUN, digest,
                                 cfg.statesync, HOST, auth=db.credentials)
            sources: list[str] = []  # what the targets' admission gates counted

            def counted(accept):
                async def wrapped(reader, writer, remote):
                    sources.append(remote)
                    await accept(reader, writer, remote)
                return wrapped

            try:
                for plane, tunnel in zip(planes, tunnels, strict=True):
                    plane.stream_only = frozenset(ids)
                    await plane.start()
                    plane.accept_stream = counted(plane.accept_stream)
                    await tunnel.start(plane.accept_stream)
                await server.start()
                await tunnels[1].serve_state(counted(server.accept_stream))
                # the two daemons hold no direct connection: everything goes by the relay
                assert not await tunnels[0]._connected(db.peer_id)
                members = tuple(sorted(ids))
                by_id = {p.peer_id: p for p in planes}
                spec = GroupSpec(run_id=RUN, fragment=0, round=1, members=members,
                                 weights=(1.0, 1.0), numel=NUMEL, codec="float32",
                                 block_size=64, chunk_numel=1 << 16,
                                 group_digest=group_digest(members))
                outs = await asyncio.wait_for(asyncio.gather(*(
                    run_round(by_id[m], spec, i, _inputs(i), {1 - i: "192.0.2.1:9"},
                              timeout=60.0)
                    for i, m in enumerate(members))), 90.0)
                rec = await asyncio.wait_for(recover(
                    {db.peer_id: server.address}, None, RUN, digest, cfg.statesync,
                    auth=da.credentials, opener=tunnels[0].open_state,
                    streamed={db.peer_id}), 60.0)
                # a peer the relay does not know is refused
                relay.admitted = lambda p: False
                with pytest.raises(ConnectionError, match="refused"):
                    await tunnels[0].open(db.peer_id)
                return outs, rec, [p.stats for p in planes], dict(relay.stats), \
                    [t.stats for t in tunnels], sources
            finally:
                await server.aclose()
                for plane, tunnel in zip(planes, tunnels, strict=True):
                    await tunnel.aclose()
                    await plane.aclose()
                await relay.aclose()

        outs, rec, plane_stats, relay_stats, tunnel_stats, sources = asyncio.run(main())
        # each target counted the requester the relay named, not the relay, as the source
        assert sorted(sources) == sorted([f"libp2p:{db.peer_id} via {boot.peer_id}"]
                                         + [f"libp2p:{da.peer_id} via {boot.peer_id}"] * 2)
    want = butterfly_average([_inputs(0), _inputs(1)], (1.0, 1.0), get_codec("float32", 64))[0]
    for out in outs:
        assert out.state is RoundState.DONE, out.failure
        assert torch.equal(out.result, want)
    for stats in plane_stats:  # straight to the stream, never a dial of the black hole
        assert stats["direct_failures"] == 0 and stats["fallback_connections"] == 1, stats
        assert stats["fallback_accepts"] == 1, stats
    assert rec is not None and rec.fetched_bytes == truth.nbytes, rec
    for name, t in truth.tensors.items():
        assert torch.equal(rec.state.tensors[name], t), name
    # two data streams and one state stream were piped, several MB through the relay
    assert relay_stats["relayed"] == 3 and relay_stats["refused"] == 1, relay_stats
    assert relay_stats["bytes"] > 2 * NUMEL * 4 + truth.nbytes, relay_stats
    assert [t["relayed_out"] for t in tunnel_stats] == [2, 1]
