"""Socket buffers from the bandwidth-delay product (dilonode/net/sockbuf.py)."""

from __future__ import annotations

import socket

import pytest

from dilonode.config import NetworkConfig
from dilonode.net import sockbuf
from dilonode.net.sockbuf import AUTOTUNE, BufferPlan, KernelLimits


def test_the_product_has_headroom_and_bounds():
    # 200 Mbit/s x 500 ms = 12.5 MB, twice over.
    assert sockbuf.bdp_bytes(200, 0.5) == 25_000_000
    assert sockbuf.bdp_bytes(100) == 12_500_000
    assert sockbuf.bdp_bytes(1000) == 64 << 20
    assert sockbuf.bdp_bytes(1, 0.01) == 4 << 20
    assert sockbuf.bdp_bytes(100_000, 1.0) == 64 << 20
    with pytest.raises(ValueError, match="rate_mbps"):
        sockbuf.bdp_bytes(0)


@pytest.mark.parametrize(("want", "core", "tcp", "privileged", "plan"), [
    (0, 4 << 20, 32 << 20, True, BufferPlan(AUTOTUNE)),
    (64 << 20, 4 << 20, 32 << 20, True, BufferPlan(64 << 20, force=True)),
    # Autotuning reaches 32 MiB, the doubled core ceiling only 8 MiB.
    (64 << 20, 4 << 20, 32 << 20, False, BufferPlan(AUTOTUNE)),
    # Autotuning stops at 4 MiB: the explicit value, reserved twice, goes further.
    (64 << 20, 4 << 20, 4 << 20, False, BufferPlan(4 << 20)),
    (1 << 20, 4 << 20, 1 << 20, False, BufferPlan(1 << 20)),
])
def test_the_way_that_reaches_furthest_is_chosen(want, core, tcp, privileged, plan):
    assert sockbuf.choose(want, core, tcp, privileged) == plan


def test_apply_sets_what_it_chose():
    kernel = KernelLimits(wmem_max=1 << 20, rmem_max=1 << 20, tcp_wmem_max=1 << 20,
                          tcp_rmem_max=1 << 30)
    with socket.socket() as sock:
        sockbuf.apply(sock, 2 << 20, kernel)
        send = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        # Forced to 2 MiB with CAP_NET_ADMIN, else the 1 MiB core ceiling; doubled either way.
        assert send in (4 << 20, 2 << 20)


def test_the_config_takes_auto_or_bytes():
    assert NetworkConfig().socket_buffer_bytes == "auto"
    assert NetworkConfig(socket_buffer_bytes=0).socket_buffer_bytes == 0
    with pytest.raises(ValueError, match="auto"):
        NetworkConfig(socket_buffer_bytes="big")
