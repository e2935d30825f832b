"""The TCP all-reduce end to end on 127.0.0.1: separate OS processes, a peer SIGKILLed mid-
round and the retry that excludes it, Hello rejection, and `NetworkCollective` in threads.

Child processes are started with multiprocessing "spawn" and driven over a Pipe: each child
starts a `DataPlane`, reports its address, receives one command and reports its outcome.
Every wait has a deadline; synchronization is on pipes and events, never on sleeping.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import msgpack
import pytest
import torch

from dilonode import PROTOCOL_VERSION
from dilonode.algo.butterfly import butterfly_average
from dilonode.algo.codecs import get_codec
from dilonode.allreduce.driver import run_round
from dilonode.allreduce.network_collective import NetworkCollective
from dilonode.allreduce.plane_limits import PlaneLimits
from dilonode.allreduce.retry import RoundPolicy, SwarmRounds
from dilonode.allreduce.round import (
    AllReduceRound,
    GroupSpec,
    Send,
    group_digest,
    result_digest,
)
from dilonode.allreduce.transport import DataPlane
from dilonode.collective import FormedGroup, GroupRequest, RoundRequest, SyncKey
from dilonode.net.channel import InboundChannel
from dilonode.wire.framing import encode_frame
from dilonode.wire.messages import Hello
from tests.support.waiting import wait_until_async

RUN = "tcp-it"
NUMEL = 60_000
CODEC = "int8"
IDS = ("node-0", "node-1", "node-2")
WAIT = 45.0  # deadline for any one cross-process wait


def _inputs(index: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 + index))


def _static_group(me: str, addrs: dict[str, str]) -> Any:
    """form_group over a fixed peer list: everyone not excluded, in a fixed order."""
    def form(req: GroupRequest) -> FormedGroup:
        members = [p for p in sorted(addrs) if p not in req.exclude or p == me]
        return FormedGroup(members, {p: addrs[p] for p in members}, [1.0] * len(members),
                           members.index(me), group_digest(members))
    return form


def _spec(members: tuple[str, ...], attempt: int = 0) -> GroupSpec:
    return GroupSpec(run_id=RUN, fragment=0, round=5, members=members,
                     weights=(1.0,) * len(members), numel=NUMEL, codec=CODEC, block_size=64,
                     chunk_numel=4096, attempt=attempt, group_digest=group_digest(members))


# ---------------------------------------------------------------------- child processes


def _child(index: int, conn: Connection, started: Any) -> None:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(_child_main(index, conn, started))


async def _child_main(index: int, conn: Connection, started: Any) -> None:
    plane = DataPlane(IDS[index], RUN)
    await plane.start()
    conn.send(plane.address)
    loop = asyncio.get_running_loop()
    if not await loop.run_in_executor(None, conn.poll, WAIT):
        return
    command, addrs, timeout = conn.recv()
    try:
        if command == "round":
            conn.send(await _one_round(plane, index, addrs, timeout))
        elif command == "swarm":
            conn.send(await _swarm(plane, index, addrs, timeout))
        elif command == "victim":
            await _victim(plane, index, addrs, timeout, started)
    finally:
        await plane.aclose()


async def _one_round(plane: DataPlane, index: int, addrs: dict[str, str],
                     timeout: float) -> dict[str, Any]:
    peers = {i: addrs[p] for i, p in enumerate(IDS) if i != index}
    out = await run_round(plane, _spec(IDS), index, _inputs(index), peers, timeout)
    return {"state": out.state.value, "digest": out.digest, "stats": plane.stats}


async def _swarm(plane: DataPlane, index: int, addrs: dict[str, str],
                 timeout: float) -> dict[str, Any]:
    policy = RoundPolicy(codec=CODEC, block_size=64, chunk_numel=4096, timeout=timeout)
    swarm = SwarmRounds(plane, _static_group(IDS[index], addrs), policy)
    result = await swarm.reduce(RoundRequest(SyncKey("fragment", 0, 5)), _inputs(index))
    return {"attempts": [(a.state.value, a.excluded_peers, a.duration, a.members)
                         for a in result.attempts],
            "state": result.outcome.state.value, "digest": result.outcome.digest,
            "skipped": result.skipped, "excluded": dict(result.excluded)}


async def _victim(plane: DataPlane, index: int, addrs: dict[str, str], timeout: float,
                  started: Any) -> None:
    """Join the round, send only the first chunk to each owner, then hang until killed."""
    spec = _spec(IDS)
    rnd = AllReduceRound(spec, index, _inputs(index), timeout=timeout)
    plane.register((spec.fragment, spec.round, spec.attempt), spec.members)
    sends = [a for a in rnd.start(asyncio.get_running_loop().time()) if isinstance(a, Send)]
    first = [a for a in sends if a.msg.type == "contribution" and a.msg.chunk == 0]
    assert first and len(first) < len(sends)
    await asyncio.gather(*(plane.send(IDS[a.to], addrs[IDS[a.to]], a.frame) for a in first))
    started.set()
    await asyncio.Event().wait()


class _Cluster:
    """Three spawned node processes with their pipes."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.started = ctx.Event()
        pipes = [ctx.Pipe() for _ in IDS]
        self.conns = [parent for parent, _ in pipes]
        self.procs = [ctx.Process(target=_child, args=(i, child, self.started), daemon=True)
                      for i, (_, child) in enumerate(pipes)]
        for proc in self.procs:
            proc.start()
        self.addrs = {IDS[i]: self.recv(i) for i in range(len(IDS))}

    def recv(self, i: int) -> Any:
        assert self.conns[i].poll(WAIT), f"node {i} did not answer within {WAIT}s"
        return self.conns[i].recv()

    def close(self) -> None:
        for proc in self.procs:
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)


@pytest.fixture
def cluster() -> Iterator[_Cluster]:
    c = _Cluster()
    try:
        yield c
    finally:
        c.close()


def _expected(indices: list[int]) -> str:
    mean, _, _ = butterfly_average([_inputs(i) for i in indices], [1.0] * len(indices),
                                   get_codec(CODEC, 64))
    return result_digest(mean, _spec(tuple(IDS[i] for i in indices)))


# ---------------------------------------------------------------------- tests


@pytest.mark.timeout(60)
def test_three_processes_agree(cluster: _Cluster) -> None:
    for conn in cluster.conns:
        conn.send(("round", cluster.addrs, 20.0))
    outs = [cluster.recv(i) for i in range(3)]
    assert [o["state"] for o in outs] == ["done"] * 3
    assert {o["digest"] for o in outs} == {_expected([0, 1, 2])}
    assert all(o["stats"]["rejected_connections"] == 0 for o in outs)


@pytest.mark.timeout(60)
def test_killed_peer_is_named_and_the_retry_completes_without_it(cluster: _Cluster) -> None:
    timeout = 15.0
    cluster.conns[2].send(("victim", cluster.addrs, timeout))
    for i in (0, 1):
        cluster.conns[i].send(("swarm", cluster.addrs, timeout))
    assert cluster.started.wait(WAIT), "victim never sent its first contributions"
    os.kill(cluster.procs[2].pid, signal.SIGKILL)
    outs = [cluster.recv(i) for i in (0, 1)]
    for out in outs:
        (state0, excluded0, duration0, members0), (state1, _, _, members1) = out["attempts"]
        assert (state0, excluded0, members0) == ("failed", ("node-2",), IDS)
        assert duration0 < timeout  # the lost connection is noticed, not waited out
        assert (state1, members1) == ("done", ("node-0", "node-1"))
        assert out["state"] == "done" and not out["skipped"]
        assert list(out["excluded"]) == ["node-2"]
    assert {o["digest"] for o in outs} == {_expected([0, 1])}


async def _raw_hello(plane: DataPlane, body: bytes) -> bytes:
    host, port = plane.address.rsplit(":", 1)
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 5.0)
    writer.write(len(body).to_bytes(4, "big") + body)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 5.0)  # b"" once the plane closes it
    finally:
        writer.close()


@pytest.mark.timeout(30)
def test_wrong_run_or_version_hello_is_rejected(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> dict[str, int]:
        async with DataPlane("node-a", RUN) as plane:
            wrong_run = encode_frame(Hello(run_id="other-run", peer_id="node-b"))[4:]
            assert await _raw_hello(plane, wrong_run) == b""
            wrong_version = msgpack.packb({"type": "hello", "version": PROTOCOL_VERSION + 1,
                                           "run_id": RUN, "peer_id": "node-c"})
            assert await _raw_hello(plane, wrong_version) == b""
            not_hello = msgpack.packb({"type": "abort", "version": PROTOCOL_VERSION})
            assert await _raw_hello(plane, not_hello) == b""
            return dict(plane.stats)

    with caplog.at_level(logging.WARNING, logger="dilonode.allreduce.transport"):
        stats = asyncio.run(main())
    assert stats["rejected_hellos"] == stats["rejected_connections"] == 3
    lines = [r.getMessage() for r in caplog.records]
    assert all("\n" not in line for line in lines)
    # The first refusal from an address in full, the others from it in one summary line
    # (dilonode.net.peer_log.PeerLog: a peer cannot inflate the log).
    assert len(lines) == 2, lines
    assert "hello message for run 'other-run', expected 'tcp-it'" in lines[0]
    assert "data port: 2 more connections closed for malformed data from 1 address" in lines[1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("reuse", [False, True])
def test_network_collective_in_threads_returns_identical_means(reuse: bool) -> None:
    """With `reuse_results`, two rounds of one fragment write one buffer (as the daemon
    runs it: each result is used before that fragment's next round starts), and results
    carry the encoded values the daemon serves to joiners (`keep_encoded`)."""
    torch.set_num_threads(1)
    policy = RoundPolicy(codec="int4", block_size=64, chunk_numel=2048, timeout=20.0)
    addrs: dict[str, str] = {}
    nodes = [NetworkCollective(pid, RUN, _static_group(pid, addrs), policy,
                               reuse_results=reuse, keep_encoded=reuse) for pid in IDS]
    results: dict[tuple[int, int], Any] = {}
    buffers: dict[tuple[int, int], int] = {}
    try:
        for pid, node in zip(IDS, nodes, strict=True):
            addrs[pid] = node.start()
        flats = {(i, r): torch.randn(NUMEL) for i in range(3) for r in range(2)}

        def train(i: int) -> None:
            for r in range(2):  # two syncs reuse the same connections
                fragment = 0 if reuse else r
                pending = nodes[i].begin(RoundRequest(SyncKey("fragment", fragment, r)),
                                         flats[(i, r)])
                got = pending.wait(timeout=WAIT)
                buffers[(i, r)] = got.mean.data_ptr()
                results[(i, r)] = dataclasses.replace(got, mean=got.mean.clone())

        threads = [threading.Thread(target=train, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT + 5)
    finally:
        for node in nodes:
            node.close()
    codec = get_codec("int4", 64)
    for r in range(2):
        expected, _, _ = butterfly_average([flats[(i, r)] for i in range(3)], [1.0] * 3, codec)
        for i in range(3):
            res = results[(i, r)]
            assert torch.equal(res.mean, expected)
            rep = res.report
            assert rep.group_size == 3 and rep.dropped == () and not rep.skipped
            assert rep.payload_bytes_sent > 0
            if reuse:  # decoded again, the kept bytes are the result, the same on everyone
                assert res.encoded is not None and torch.equal(res.encoded.decode(), expected)
                assert res.encoded.blob() == results[(0, r)].encoded.blob()
            else:
                assert res.encoded is None
    assert all(node.plane.stats["connections_out"] == 2 for node in nodes)
    for i in range(3):
        assert (buffers[(i, 0)] == buffers[(i, 1)]) is reuse


# ---------------------------------------------------------------------- in-process details


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
@pytest.mark.parametrize("codec", ["float32", "int4"])
def test_large_frames_are_read_into_their_bodies(loop_kind: str, codec: str) -> None:
    """Frames of 64 KiB and more are read by the event loop straight into the buffer their
    payload keeps (`bytes_in_direct`), on either event loop, and the round is exact."""
    numel = 700_001
    chunk = {"float32": 65_536, "int4": 262_144}[codec]  # frames of 256 and 144 KiB
    flats = [torch.randn(numel) for _ in IDS]
    members = tuple(IDS)

    async def main() -> list[Any]:
        planes = [DataPlane(pid, RUN) for pid in IDS]
        for plane in planes:
            await plane.start()
        spec = GroupSpec(run_id=RUN, fragment=0, round=1, members=members,
                         weights=(1.0,) * 3, numel=numel, codec=codec, block_size=64,
                         chunk_numel=chunk, group_digest=group_digest(members))
        try:
            outs = await asyncio.gather(*(
                run_round(plane, spec, i, flats[i],
                          {j: p.address for j, p in enumerate(planes) if j != i}, 30.0)
                for i, plane in enumerate(planes)))
            return [(out, dict(plane.stats)) for out, plane in zip(outs, planes, strict=True)]
        finally:
            for plane in planes:
                await plane.aclose()

    if loop_kind == "uvloop":
        import uvloop
        got = uvloop.run(main())
    else:
        got = asyncio.run(main())
    expected, _, _ = butterfly_average(flats, [1.0] * 3, get_codec(codec, 64))
    for out, stats in got:
        assert out.state.value == "done" and torch.equal(out.result, expected)
        assert out.digest == got[0][0].digest
        # All but the first read of each body (64 KiB, with the header) goes direct: 3/4 of
        # a 256 KiB frame, over a third of a 132-144 KiB one.
        share = {"float32": 0.6, "int4": 0.3}[codec]
        assert stats["bytes_in_direct"] > share * stats["bytes_in"]


def _frames(spec: GroupSpec, sender: int) -> list[Send]:
    rnd = AllReduceRound(spec, sender, _inputs(sender), timeout=10.0)
    return [a for a in rnd.start(0.0) if isinstance(a, Send)]


@pytest.mark.timeout(30)
def test_early_frames_wait_for_their_round_and_expire(caplog: pytest.LogCaptureFixture) -> None:
    spec = _spec(IDS[:2])

    async def main() -> tuple[int, int, dict[str, int]]:
        async with DataPlane(IDS[0], RUN, limits=PlaneLimits(pending_ttl=0.3)) as a, \
                DataPlane(IDS[1], RUN) as b:
            sends = [s for s in _frames(spec, 1) if s.to == 0]
            await asyncio.gather(*(b.send(IDS[0], a.address, s.frame) for s in sends))
            await wait_until_async(lambda: a.stats["frames_in"] == len(sends), 10.0,
                                   interval=0.005, what="every early frame in")
            early = len(a.register((0, 5, 0), spec.members))  # delivered on registration
            a.unregister((0, 5, 0))
            late = _spec(IDS[:2], attempt=1)  # nobody registers attempt 1 in time
            await asyncio.gather(*(b.send(IDS[0], a.address, s.frame)
                                   for s in _frames(late, 1) if s.to == 0))
            await wait_until_async(lambda: a.stats["dropped_frames"] == len(sends), 10.0,
                                   interval=0.005, what="every late frame dropped")
            return early, len(sends), dict(a.stats)

    with caplog.at_level(logging.WARNING, logger="dilonode.allreduce.transport"):
        early, sent, stats = asyncio.run(main())
    assert early == sent and stats["late_frames"] == 0
    assert any("no round registered in time" in r.getMessage() for r in caplog.records)


@pytest.mark.timeout(30)
def test_a_peer_that_hangs_up_is_marked_gone_until_it_connects_again() -> None:
    """Matchmaking stops expecting a peer whose connection closed (a SIGKILLed peer's DHT
    record outlives it); a peer that connects again is cleared."""
    spec = _spec(IDS[:2])

    async def main() -> tuple[set[str], set[str], set[str]]:
        async with DataPlane(IDS[0], RUN) as a:
            sends = [s for s in _frames(spec, 1) if s.to == 0]
            b = DataPlane(IDS[1], RUN)
            await b.start()
            await b.send(IDS[0], a.address, sends[0].frame)
            await wait_until_async(lambda: a.stats["frames_in"] == 1, 10.0, interval=0.005,
                                   what="the first frame in")
            connected = set(a.gone)
            await b.aclose()  # the peer's process ends: its connections close
            await wait_until_async(lambda: IDS[1] in a.gone, 10.0, interval=0.005,
                                   what="the peer marked gone")
            hung_up = set(a.gone)
            async with DataPlane(IDS[1], RUN) as again:
                await again.send(IDS[0], a.address, sends[1].frame)
                await wait_until_async(lambda: a.stats["frames_in"] == 2, 10.0,
                                       interval=0.005, what="the second frame in")
                await wait_until_async(lambda: IDS[1] not in a.gone, 10.0, interval=0.005,
                                       what="the peer no longer gone")
                back = set(a.gone)
        return connected, hung_up, back

    connected, hung_up, back = asyncio.run(main())
    assert connected == set() and hung_up == {IDS[1]} and back == set()


@pytest.mark.timeout(30)
def test_all_attempts_failing_keeps_the_own_quantized_value() -> None:
    async def main() -> Any:
        async with DataPlane(IDS[0], RUN) as plane:
            dead = DataPlane(IDS[1], RUN)
            await dead.start()
            await dead.aclose()  # nothing listens there any more

            def form(req: GroupRequest) -> FormedGroup:  # ignores exclude on purpose
                return FormedGroup(IDS[:2], [plane.address, dead.address], [1.0, 1.0], 0,
                                   group_digest(IDS[:2]))

            policy = RoundPolicy(codec="int4", chunk_numel=4096, timeout=5.0, max_attempts=2)
            return await SwarmRounds(plane, form, policy).reduce(
                RoundRequest(SyncKey("fragment", 0, 5)), _inputs(0))

    out = asyncio.run(main())
    codec = get_codec("int4", 64)
    assert out.skipped and out.outcome.members == (IDS[0],)
    assert [a.state.value for a in out.attempts] == ["failed", "failed"]
    assert all(a.duration < 5.0 for a in out.attempts)  # refused connections, no timeouts
    assert torch.equal(out.outcome.result, codec.decode(*codec.encode(_inputs(0))))
    assert list(out.excluded) == [IDS[1]] and len(out.failures) == 2


@pytest.mark.timeout(30)
def test_aclose_is_bounded_when_the_peer_stops_reading() -> None:
    async def main() -> float:
        accepted: list[asyncio.StreamWriter] = []

        async def never_read(reader: asyncio.StreamReader,
                             writer: asyncio.StreamWriter) -> None:
            # Completes the handshake (trust mode, like the plane), then never reads again.
            channel = InboundChannel(None, RUN, "stuck", max_frame_bytes=1 << 30)
            while not channel.outgoing:
                data = await asyncio.wait_for(reader.read(4096), 5.0)
                if not data:
                    return
                assert not list(channel.feed(data))
            writer.write(b"".join(channel.outgoing))
            accepted.append(writer)

        server = await asyncio.start_server(never_read, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        plane = DataPlane(IDS[0], RUN)
        await plane.start()
        frame = encode_frame(Hello(run_id=RUN, peer_id="x"))[:4] + bytes(8 << 20)
        futs = [plane.send("stuck", f"127.0.0.1:{port}", frame) for _ in range(16)]
        await wait_until_async(lambda: accepted and plane.stats["frames_out"] > 0, 10.0,
                               interval=0.005, what="a connection accepted and a frame out")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await plane.aclose(grace=0.5)
        elapsed = loop.time() - t0
        assert all(f.done() for f in futs)
        for w in accepted:
            w.close()
        server.close()
        return elapsed

    assert asyncio.run(main()) < 2.0
