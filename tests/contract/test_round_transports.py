"""One suite, two transports: the all-reduce round over MemNet and over TCP on 127.0.0.1.

The `network` fixture yields an adapter with one method, `run(spec, xs, timeout=...,
silent=..., dead=..., garbage=...)`, which runs every honest member's round and returns
their outcomes. Faulty members are modelled per transport: *silent* members are up but never
take part (MemNet: silenced; TCP: the plane listens and buffers, no round runs), *dead*
members are gone (MemNet: silenced; TCP: nothing listens on their address), *garbage*
members send an undecodable frame to everyone (MemNet: corrupted frames; TCP: a raw
connection that says hello and then sends garbage).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import pytest
import torch

from dilonode.algo.butterfly import butterfly_average
from dilonode.algo.codecs import get_codec
from dilonode.allreduce.driver import run_round
from dilonode.allreduce.memnet import Faults, MemNet
from dilonode.allreduce.round import (
    AllReduceRound,
    GroupSpec,
    RoundState,
    group_digest,
)
from dilonode.allreduce.transport import DataPlane
from dilonode.net.channel import OutboundHandshake, read_handshake_frame

GARBAGE_FRAME = b"\x00\x00\x00\x02\xc1\xc1"  # a 2-byte body that is not msgpack
MARGIN = 1.5  # seconds of slack past the round timeout on a loaded 2-core machine


@dataclass(frozen=True)
class MemberOutcome:
    state: RoundState
    digest: str | None
    result: torch.Tensor | None
    exclude: tuple[int, ...]
    reason: str
    elapsed: float


class Network(Protocol):
    name: str

    def run(self, spec: GroupSpec, xs: Sequence[torch.Tensor], *, timeout: float,
            silent: frozenset[int] = frozenset(), dead: frozenset[int] = frozenset(),
            garbage: frozenset[int] = frozenset()) -> dict[int, MemberOutcome]: ...


def _outcome(rnd: AllReduceRound, elapsed: float) -> MemberOutcome:
    done = rnd.state is RoundState.DONE
    return MemberOutcome(
        rnd.state, rnd.digest if done else None, rnd.result if done else None,
        () if done else rnd.failure.exclude, "" if done else rnd.failure.reason, elapsed)


class MemNetwork:
    name = "memnet"

    def run(self, spec: GroupSpec, xs: Sequence[torch.Tensor], *, timeout: float,
            silent: frozenset[int] = frozenset(), dead: frozenset[int] = frozenset(),
            garbage: frozenset[int] = frozenset()) -> dict[int, MemberOutcome]:
        rounds = [AllReduceRound(spec, i, x, timeout=timeout) for i, x in enumerate(xs)]
        faults = Faults()
        for i in silent | dead:
            faults.silence(i)
        for i in garbage:
            for j in range(spec.size):
                if j != i:
                    faults.corrupt(i, j, lambda msg: GARBAGE_FRAME)
        net = MemNet(rounds, faults, start=0.0)
        net.run()
        honest = set(range(spec.size)) - silent - dead - garbage
        return {i: _outcome(rounds[i], net.now) for i in honest}


class TcpNetwork:
    name = "tcp"

    def run(self, spec: GroupSpec, xs: Sequence[torch.Tensor], *, timeout: float,
            silent: frozenset[int] = frozenset(), dead: frozenset[int] = frozenset(),
            garbage: frozenset[int] = frozenset()) -> dict[int, MemberOutcome]:
        coro = self._run(spec, xs, timeout, silent, dead, garbage)
        return asyncio.run(asyncio.wait_for(coro, timeout + 30))

    async def _run(self, spec: GroupSpec, xs: Sequence[torch.Tensor], timeout: float,
                   silent: frozenset[int], dead: frozenset[int],
                   garbage: frozenset[int]) -> dict[int, MemberOutcome]:
        planes = [DataPlane(pid, spec.run_id) for pid in spec.members]
        for plane in planes:
            await plane.start()
        for i in dead:
            await planes[i].aclose()  # its port is closed: connecting there is refused
        addrs = {i: p.address for i, p in enumerate(planes)}
        honest = [i for i in range(spec.size) if i not in silent | dead | garbage]
        try:
            t0 = time.monotonic()
            tasks = {i: asyncio.create_task(self._member(planes[i], spec, i, xs[i], addrs,
                                                         timeout, t0)) for i in honest}
            await asyncio.sleep(0)  # a yield, not a wait: each task registers its round
            key = (spec.fragment, spec.round, spec.attempt)
            assert all(planes[i].is_registered(key) for i in honest)
            writers = [await _send_garbage(spec.members[i], spec.members[j], spec.run_id,
                                           addrs[j])
                       for i in garbage for j in honest]
            results = {i: await task for i, task in tasks.items()}
            for writer in writers:
                writer.close()
            return results
        finally:
            for plane in planes:
                await plane.aclose()

    @staticmethod
    async def _member(plane: DataPlane, spec: GroupSpec, i: int, x: torch.Tensor,
                      addrs: dict[int, str], timeout: float, t0: float) -> MemberOutcome:
        peers = {j: a for j, a in addrs.items() if j != i}
        out = await run_round(plane, spec, i, x, peers, timeout)
        failure = out.failure
        return MemberOutcome(out.state, out.digest, out.result,
                             failure.exclude if failure else (),
                             failure.reason if failure else "", time.monotonic() - t0)


async def _send_garbage(peer_id: str, to: str, run_id: str,
                        address: str) -> asyncio.StreamWriter:
    """Complete the handshake as `peer_id` (trust mode, like the planes), then send garbage."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 5.0)
    shake = OutboundHandshake(None, run_id, peer_id, to)
    writer.write(shake.hello_frame())
    buf = bytearray()
    while (ack := read_handshake_frame(buf)) is None:
        buf += await asyncio.wait_for(reader.read(4096), 5.0)
    writer.write(shake.on_ack(ack)[0] + GARBAGE_FRAME)
    await asyncio.wait_for(writer.drain(), 5.0)
    return writer


@pytest.fixture(params=[MemNetwork, TcpNetwork], ids=lambda cls: cls.name)
def network(request: pytest.FixtureRequest) -> Iterator[Network]:
    torch.set_num_threads(1)  # oversubscribed intra-op threads are slower on 2 shared cores
    yield request.param()


def make_spec(n: int, numel: int, codec: str = "float32", *, weights: Sequence[float] = (),
              chunk_numel: int = 4096) -> GroupSpec:
    members = tuple(f"peer-{i}" for i in range(n))
    return GroupSpec(run_id="contract", fragment=3, round=11, members=members,
                     weights=tuple(weights) or (1.0,) * n, numel=numel, codec=codec,
                     block_size=64, chunk_numel=chunk_numel, group_digest=group_digest(members))


def make_inputs(n: int, numel: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=gen) * (i + 1) for i in range(n)]


def expected_mean(spec: GroupSpec, xs: Sequence[torch.Tensor]) -> torch.Tensor:
    mean, _, _ = butterfly_average(xs, spec.weights, get_codec(spec.codec, spec.block_size))
    return mean


# ---------------------------------------------------------------------- success


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("n", "weights"), [(1, ()), (2, ()), (3, (1.0, 3.0, 0.5)), (4, ())])
def test_float32_members_agree_on_the_butterfly_mean(network: Network, n: int,
                                                     weights: tuple[float, ...]) -> None:
    spec = make_spec(n, 50_001, weights=weights)
    xs = make_inputs(n, spec.numel)
    outcomes = network.run(spec, xs, timeout=20.0)
    expected = expected_mean(spec, xs)
    assert len(outcomes) == n
    for out in outcomes.values():
        assert out.state is RoundState.DONE, out.reason
        assert out.result is not None and torch.equal(out.result, expected)
    assert {out.digest for out in outcomes.values()} == {outcomes[0].digest}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 4])
def test_int4_members_agree_bitwise(network: Network, n: int) -> None:
    spec = make_spec(n, 40_000, "int4", weights=[1.0 + i for i in range(n)], chunk_numel=1024)
    xs = make_inputs(n, spec.numel, seed=1)
    outcomes = network.run(spec, xs, timeout=20.0)
    assert all(out.state is RoundState.DONE for out in outcomes.values())
    assert {out.digest for out in outcomes.values()} == {outcomes[0].digest}
    assert outcomes[0].result is not None
    assert torch.equal(outcomes[0].result, expected_mean(spec, xs))


# ---------------------------------------------------------------------- faults


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault", ["silent", "dead"])
def test_missing_peer_fails_the_others_naming_it(network: Network, fault: str) -> None:
    spec = make_spec(4, 20_000)
    timeout = 2.0
    outcomes = network.run(spec, make_inputs(4, spec.numel), timeout=timeout,
                           **{fault: frozenset({2})})
    assert set(outcomes) == {0, 1, 3}
    for out in outcomes.values():
        assert out.state is RoundState.FAILED
        assert out.result is None and out.digest is None
        assert out.exclude == (2,), out.reason
        assert out.elapsed <= timeout + MARGIN


@pytest.mark.timeout(60)
def test_garbage_sending_peer_fails_the_others_naming_it(network: Network) -> None:
    spec = make_spec(3, 20_000)
    outcomes = network.run(spec, make_inputs(3, spec.numel), timeout=5.0,
                           garbage=frozenset({1}))
    assert set(outcomes) == {0, 2}
    for out in outcomes.values():
        assert out.state is RoundState.FAILED
        assert out.exclude == (1,), out.reason
        assert out.elapsed < 5.0  # detected, not timed out
    reasons = " ".join(out.reason for out in outcomes.values())
    assert "not valid msgpack" in reasons and "peer-1" in reasons
