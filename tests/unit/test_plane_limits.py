"""`PlaneLimits`: a node's defaults, refusal of nonsense, and a plane that reads them."""

from __future__ import annotations

import dataclasses
import socket

import pytest

from dilonode.allreduce.plane_limits import PlaneLimits
from dilonode.allreduce.transport import DataPlane
from dilonode.net import congestion
from dilonode.wire.framing import DEFAULT_MAX_FRAME_BYTES


def test_defaults_are_a_nodes():
    limits = PlaneLimits()
    assert limits.max_frame_bytes == DEFAULT_MAX_FRAME_BYTES
    assert (limits.connect_timeout, limits.pending_ttl, limits.direct_retry) == (5.0, 10.0, 600.0)
    assert limits.max_idle_inbound == 0 and limits.tcp_congestion == congestion.SYSTEM
    assert limits.tune_malloc
    with pytest.raises(dataclasses.FrozenInstanceError):
        limits.pending_ttl = 1.0  # type: ignore[misc]


@pytest.mark.parametrize("bad", [{"connect_timeout": 0.0}, {"max_frame_bytes": 0},
                                 {"pending_ttl": -1.0}, {"max_idle_inbound": -1},
                                 {"socket_buffer_bytes": -4096}])
def test_nonsense_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        PlaneLimits(**bad)


def test_a_plane_configures_its_sockets_by_its_limits():
    plane = DataPlane("node-a", "run", limits=PlaneLimits(socket_buffer_bytes=256 << 10))
    assert DataPlane("node-b", "run").limits == PlaneLimits()
    with socket.socket() as sock:
        plane._configure(sock)
        # Linux doubles the value asked for (the kernel's bookkeeping share).
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= 256 << 10
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
