"""Rotating groups meet new peers every round: a data plane with `max_idle_inbound` closes
idle connections of peers it has no round with (receiver side, so the sender neither fails
anything nor looks dead), and the sender's next frame simply reconnects."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from dilonode.allreduce.plane_limits import PlaneLimits
from dilonode.allreduce.transport import DataPlane, _Outbound
from tests.integration.test_tcp_allreduce import IDS, RUN, _frames, _spec
from tests.support.waiting import wait_until_async


def _until(cond: Callable[[], object], what: str) -> Awaitable[object]:
    """`wait_until_async` for the data plane's counters, which move within milliseconds."""
    return wait_until_async(cond, 10.0, interval=0.005, what=what)


Planes = tuple[DataPlane, DataPlane, DataPlane, list, list]


@contextlib.asynccontextmanager
async def _three_planes() -> AsyncIterator[Planes]:
    """a (keeps at most one idle inbound connection), b and c, and b's and c's frames for a."""
    spec = _spec(IDS)
    async with DataPlane(IDS[0], RUN, limits=PlaneLimits(
            pending_ttl=0.1, max_idle_inbound=1, idle_close_s=0.0)) as a, \
            DataPlane(IDS[1], RUN) as b, DataPlane(IDS[2], RUN) as c:
        yield (a, b, c, [s for s in _frames(spec, 1) if s.to == 0],
               [s for s in _frames(spec, 2) if s.to == 0])


async def _close_bs_idle_connection(planes: Planes) -> None:
    a, b, c, from_b, from_c = planes
    await b.send(IDS[0], a.address, from_b[0].frame)
    await _until(lambda: a.stats["dropped_frames"] == 1, "b's frame dropped")  # b has no round
    await c.send(IDS[0], a.address, from_c[0].frame)  # a second peer connects
    await _until(lambda: a.stats["idle_closed"] == 1, "b's idle connection closed")


@pytest.mark.timeout(30)
def test_idle_connections_beyond_the_bound_close_and_reopen_on_demand() -> None:
    async def main() -> tuple[dict[str, int], dict[str, float], int]:
        async with _three_planes() as planes:
            a, b, _, from_b, _ = planes
            await _close_bs_idle_connection(planes)
            await _until(lambda: len(a._inbound) == 1, "one inbound connection")
            await b.send(IDS[0], a.address, from_b[1].frame)  # b reconnects quietly
            await _until(lambda: a.stats["frames_in"] == 3, "b's second frame in")
            return dict(a.stats), dict(a.gone), b.stats["send_failures"]

    stats, gone, failures = asyncio.run(main())
    assert stats["idle_closed"] == 1 and stats["connections_in"] == 3
    assert gone == {} and failures == 0  # nobody was taken for dead, nothing was lost


@pytest.mark.timeout(30)
def test_peers_with_a_round_here_are_never_closed() -> None:
    spec = _spec(IDS)

    async def main() -> int:
        async with DataPlane(IDS[0], RUN, limits=PlaneLimits(
                max_idle_inbound=1, idle_close_s=0.0)) as a, \
                DataPlane(IDS[1], RUN) as b, DataPlane(IDS[2], RUN) as c:
            a.register((0, 5, 0), spec.members)
            await b.send(IDS[0], a.address, [s for s in _frames(spec, 1) if s.to == 0][0].frame)
            await c.send(IDS[0], a.address, [s for s in _frames(spec, 2) if s.to == 0][0].frame)
            await _until(lambda: a.stats["frames_in"] == 2, "both frames in")
            return a.stats["idle_closed"]  # decided when c's connection was proven

    assert asyncio.run(main()) == 0


@pytest.mark.timeout(30)
def test_a_frame_written_before_the_sender_learns_of_the_close_still_arrives(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Over a WAN the sender learns of the receiver's idle close half a round trip late;
    a frame it writes in that window must not vanish into a socket the receiver dropped."""
    late = asyncio.Event()  # set: the sender's watch may see the close
    watch = _Outbound._watch

    async def late_watch(self: _Outbound, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        await late.wait()
        await watch(self, reader, writer)

    monkeypatch.setattr(_Outbound, "_watch", late_watch)

    async def main() -> tuple[dict[str, int], dict[str, float], int]:
        async with _three_planes() as planes:
            a, b, _, from_b, _ = planes
            await _close_bs_idle_connection(planes)
            await b.send(IDS[0], a.address, from_b[1].frame)  # b has not seen the close
            await _until(lambda: a.stats["frames_in"] == 3, "b's frame after the close in")
            late.set()
            await _until(lambda: len(a._inbound) == 1, "b's old connection gone")
            await b.send(IDS[0], a.address, from_b[2].frame)  # on a new connection
            await _until(lambda: a.stats["frames_in"] == 4, "b's next frame in")
            return dict(a.stats), dict(a.gone), b.stats["send_failures"]

    stats, gone, failures = asyncio.run(main())
    assert stats["idle_closed"] == 1 and stats["connections_in"] == 3
    assert gone == {} and failures == 0
