"""A node joins a run in progress and recovers the outer state from its peers (127.0.0.1).

* Three real `dilonode run` processes: two train, a third joins mid-run, fetches the state
  from both, adopts it bit for bit and then takes part in rounds (its outer state equals
  theirs again at a later common step, which only happens if it averaged with them).
* State servers in this process, one behind a proxy that cuts the connection mid-transfer:
  the joiner re-requests the missing chunks from the others and still gets the exact state.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest
import torch

from dilonode.algo.pacing import rounds_before
from dilonode.algo.schedule import SyncPlan
from dilonode.config import load_config
from dilonode.statesync.client import recover
from dilonode.statesync.server import SnapshotSource, StateServer
from dilonode.train.checkpoint import latest_checkpoints, load_checkpoint
from dilonode.train.state import WorkerState, config_digest
from tests.support.config import nano_config
from tests.support.swarm import nodes_by_hand

BASE = {
    "run_id": "join-test", "seed": 5, "eval_every": 6, "total_steps": 100000,
    "codec": {"name": "float32"},
    "network": {"matchmaking_window": 4.0, "matchmaking_timeout": 10.0,
                "allreduce_timeout": 10.0, "max_attempts": 2},
    "checkpoint": {"every_steps": 1, "keep": 1000, "on_exit": False},
    "statesync": {"chunk_bytes": 4096},
}


def _checkpoints(node_dir: Path) -> dict[int, Path]:
    return {int(p.stem.split("-")[1]): p for p in latest_checkpoints(node_dir / "ckpt")}


def _load(path: Path, cfg) -> WorkerState:
    return load_checkpoint(path, cfg.run_id, config_digest(cfg))


def _assert_same(a: WorkerState, b: WorkerState, what: str) -> None:
    assert (a.rounds, a.outer_steps) == (b.rounds, b.outer_steps), what
    for name, t in a.tensors.items():
        assert torch.equal(t, b.tensors[name]), f"{what}: {name} differs"


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_joiner_recovers_state_and_contributes(tmp_path):
    pytest.importorskip("hivemind")
    cfg = nano_config(tmp_path, **BASE)
    with nodes_by_hand(cfg) as swarm:
        procs = [swarm.start(i, "--set", "network.min_peers=2") for i in range(2)]
        # Two rounds of every fragment landed: the state is then labelled step 13 or later
        # (paced by the clock a node's own step says nothing of its rounds).
        procs[0].wait_for("progress", 180, until=lambda ev: len(ev["rounds"]) == 3
                          and min(ev["rounds"].values()) >= 2)
        procs.append(swarm.start(2))
        rec = procs[2].wait_for("recovered", 120)
        # Until the joiner has landed two rounds of every fragment (its counts start at its
        # own start): its state then sits 12 reference steps past the one it adopted. Its
        # own step count said less: in one run of four, 12 own steps ended with the three
        # nodes' last common state 4 steps past the adopted one (23, then 27).
        procs[2].wait_for("progress", 120, until=lambda ev: len(ev["rounds"]) == 3
                          and min(ev["rounds"].values()) >= 2)
        for p in procs:
            p.proc.send_signal(signal.SIGTERM)
        summaries = [p.wait_for("summary", 60) for p in procs]
        assert [p.proc.wait(timeout=30) for p in procs] == [0, 0, 0]
    joined_at = rec["step"]
    assert joined_at >= 12, rec
    # The joiner named its first round on the swarm clock (`PeerRecord.joins_from`): the
    # state it adopted holds every round that starts before it.
    named = [json.loads(line)["msg"] for line in (tmp_path / "n2.log").read_text().splitlines()
             if "our first round is reference step" in line]
    assert len(named) == 1, named
    joins_from = float(named[0].split("reference step ")[1].split()[0])
    a = cfg.diloco.effective()
    needed = rounds_before(SyncPlan(a.sync_every, a.num_fragments, a.fragment_sync_delay),
                           joins_from)
    # chunks came from both peers at once
    assert len(rec["peers"]) == 2 and all(n > 0 for n in rec["peers"].values()), rec
    assert rec["bytes"] == sum(rec["peers"].values()) > 0
    ckpts = [_checkpoints(p.out) for p in procs]
    # adoption point: the joiner's state at `joined_at` is the peers' state, bit for bit
    adopted = _load(ckpts[2][joined_at], cfg)
    assert all(have >= need for have, need in zip(adopted.rounds, needed, strict=True)), \
        (adopted.rounds, needed)
    peer_same = [_load(path, cfg) for path in ckpts[0].values()
                 if _load(path, cfg).rounds == adopted.rounds]
    assert peer_same, "no peer checkpoint with the adopted round counters"
    _assert_same(adopted, peer_same[0], "adopted state vs peer")
    # contribution: at a later step all three hold the same outer state again
    common = sorted(set(ckpts[0]) & set(ckpts[1]) & set(ckpts[2]))
    later = [s for s in common if s >= joined_at + 6]
    assert later, f"no common checkpoint step after {joined_at + 6}: {common[-5:]}"
    states = [_load(c[later[-1]], cfg) for c in ckpts]
    assert all(r > a for r, a in zip(states[2].rounds, adopted.rounds, strict=True))
    _assert_same(states[2], states[0], "joiner vs node-0 after joining")
    _assert_same(states[1], states[0], "node-1 vs node-0")
    joiner = summaries[2]
    assert joiner["skipped_rounds"] == 0, joiner["dropped_peers"]
    assert all(n >= 1 for n in joiner["rounds_per_fragment"].values()), joiner


# ----------------------------------------------------------------- resumable fetch


class _FixedWorker:
    def __init__(self, state: WorkerState) -> None:
        self.state, self.step, self.pending = state, state.step, {}

    def export_state(self, reuse: WorkerState | None = None) -> WorkerState:
        return self.state


def _state(seed: int, numel: int = 40_000) -> WorkerState:
    g = torch.Generator().manual_seed(seed)
    tensors = {f"outer.{p}.{k}": torch.randn(numel + p, generator=g)
               for p in range(3) for k in ("weights", "momentum")}
    return WorkerState(42, (7, 7, 6), (7, 7, 6), tensors)


async def _cutting_proxy(target: str, cut_after: int) -> tuple[asyncio.Server, str]:
    """A TCP proxy to `target` that aborts the connection after `cut_after` bytes back."""
    host, port = target.rsplit(":", 1)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection(host, int(port))

        async def upstream() -> None:
            while data := await reader.read(1 << 16):
                up_w.write(data)

        task = asyncio.create_task(upstream())
        sent = 0
        while data := await up_r.read(1 << 16):
            writer.write(data[:max(cut_after - sent, 0)])
            sent += len(data)
            if sent >= cut_after:
                break
        task.cancel()
        writer.transport.abort()  # the peer "dies" mid-transfer
        up_w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


@pytest.mark.timeout(60)
def test_fetch_resumes_when_a_peer_dies_mid_transfer(caplog):
    cfg = load_config(overrides={"statesync": {"chunk_bytes": 4096, "request_timeout": 5.0,
                                               "snapshot_wait": 1.0}})
    digest, truth = config_digest(cfg), _state(1)
    total = truth.nbytes

    async def main():
        names = ["dying", "b", "c"]
        servers = [StateServer(SnapshotSource(_FixedWorker(truth)), cfg.run_id, digest,
                               cfg.statesync, peer_id=name) for name in names]
        addrs = [await s.start() for s in servers]
        proxy, cut_addr = await _cutting_proxy(addrs[0], cut_after=total // 6)
        try:
            peers = {"dying": cut_addr, "b": addrs[1], "c": addrs[2]}
            return await asyncio.wait_for(recover(peers, None, cfg.run_id, digest,
                                                  cfg.statesync, peer_id="joiner"), 30)
        finally:
            proxy.close()
            for s in servers:
                await s.aclose()

    rec = asyncio.run(main())
    assert rec is not None
    _assert_same(rec.state, truth, "recovered vs served")
    assert rec.state.step == truth.step
    assert 0 < rec.sources["dying"] < total // 6, rec.sources  # some chunks, then it died
    assert rec.sources["b"] > 0 and rec.sources["c"] > 0
    assert rec.fetched_bytes == total == sum(rec.sources.values())
    assert any("dropping peer dying" in r.getMessage() for r in caplog.records)
