"""`network.tcp_congestion`: the data plane and the state server send with the congestion
control the config names (127.0.0.1); "auto" picks by the handshake's round trip; a name
the kernel refuses leaves the socket on the system's default with one warning, and the
config refuses a malformed name."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest

from dilonode.allreduce.plane_limits import PlaneLimits
from dilonode.allreduce.transport import DataPlane
from dilonode.config import ConfigError, load_config
from dilonode.net import congestion
from dilonode.statesync.server import SnapshotSource, StateServer
from tests.integration.test_join import _FixedWorker, _state
from tests.integration.test_tcp_allreduce import IDS, RUN, _frames, _spec
from tests.support.waiting import wait_until_async

# Built into every Linux kernel and always in tcp_allowed_congestion_control, so any user
# may set it; the box's default (cubic or bbr) is something else.
RENO = "reno"

pytestmark = pytest.mark.skipif(not hasattr(socket, "TCP_CONGESTION"),
                                reason="TCP_CONGESTION is Linux-only")
T = TypeVar("T")


def _run(loop: str, main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run `main()` on asyncio's loop or on uvloop, the daemon's (whose transports hand out
    socket stand-ins rather than `socket.socket` objects)."""
    factory: Any = None
    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main())


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname(), timeout=5)
        accepted, _ = server.accept()
        try:
            yield client, accepted
        finally:
            client.close()
            accepted.close()


def test_apply_sets_the_named_congestion_control(pair) -> None:
    client, _ = pair
    assert congestion.apply(client, RENO)
    assert congestion.current(client) == RENO


def test_system_leaves_the_socket_alone(pair) -> None:
    client, _ = pair
    before = congestion.current(client)
    assert not congestion.apply(client, congestion.SYSTEM)
    assert congestion.current(client) == before


def test_a_refused_name_keeps_the_default_and_warns_once(pair, caplog) -> None:
    client, accepted = pair
    before = congestion.current(client)
    with caplog.at_level(logging.WARNING, logger="dilonode.net.congestion"):
        assert not congestion.apply(client, "nosuchcc")
        assert not congestion.apply(accepted, "nosuchcc")
    assert congestion.current(client) == before
    lines = [r.getMessage() for r in caplog.records if "nosuchcc" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "refused" in lines[0] and f"keep {before}" in lines[0]


def test_a_non_tcp_socket_is_left_alone() -> None:
    a, b = socket.socketpair()
    with a, b:
        assert not congestion.apply(a, RENO)


@pytest.mark.parametrize("bad", ["Cubic", "bbr v2", "", "a" * 16])
def test_the_config_refuses_a_malformed_name(bad) -> None:
    with pytest.raises(ConfigError, match="network.tcp_congestion"):
        load_config(overrides={"network": {"tcp_congestion": bad}})


def test_the_default_is_auto() -> None:
    assert load_config().network.tcp_congestion == congestion.AUTO


def test_auto_picks_bbr_from_the_threshold_round_trip_on_and_cubic_below() -> None:
    limit = congestion.AUTO_BBR_RTT_S
    assert congestion.pick(limit) == congestion.pick(0.3) == "bbr"
    assert congestion.pick(limit * 0.99) == congestion.pick(50e-6) == "cubic"
    assert congestion.pick(None) == congestion.SYSTEM


def test_auto_on_loopback_measures_a_short_handshake_and_asks_for_cubic(pair) -> None:
    client, accepted = pair
    for sock in (client, accepted):
        rtt = congestion.handshake_rtt(sock)
        assert rtt is not None and 0 < rtt < congestion.AUTO_BBR_RTT_S
        assert congestion.pick(rtt) == "cubic"
        if "cubic" in (congestion.settable() or ()):  # else the kernel refuses it, as above
            assert congestion.apply(sock, congestion.AUTO)
            assert congestion.current(sock) == "cubic"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_data_plane_connections_use_it_on_both_ends(loop: str) -> None:
    spec = _spec(IDS)

    async def main() -> tuple[str, str]:
        reno = PlaneLimits(tcp_congestion=RENO)
        async with DataPlane(IDS[0], RUN, limits=reno) as a, \
                DataPlane(IDS[1], RUN, limits=reno) as b:
            frame = [s for s in _frames(spec, 1) if s.to == 0][0].frame
            await b.send(IDS[0], a.address, frame)
            await wait_until_async(lambda: a.stats["frames_in"] == 1, 10.0, interval=0.005,
                                   what="the frame in")
            inbound = next(iter(a._inbound)).transport
            writer = b._outbound[IDS[0]].writer
            assert inbound is not None and writer is not None
            return (congestion.current(inbound.get_extra_info("socket")),
                    congestion.current(writer.get_extra_info("socket")))

    assert _run(loop, main) == (RENO, RENO)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_state_server_connections_use_it(loop: str) -> None:
    cfg = load_config()

    async def main() -> str:
        server = StateServer(SnapshotSource(_FixedWorker(_state(1, numel=64))), cfg.run_id,
                             "digest", cfg.statesync, peer_id="server",
                             tcp_congestion=RENO)
        host, port = (await server.start()).rsplit(":", 1)
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 5)
            await wait_until_async(lambda: bool(server._conns), 10.0, interval=0.005,
                                   what="the connection accepted")
            accepted = next(iter(server._conns.values()))
            name = congestion.current(accepted.get_extra_info("socket"))
            writer.close()
            return name
        finally:
            await server.aclose()

    assert _run(loop, main) == RENO
