"""Free TCP ports on a loopback address, for listeners a test must name before they start."""

from __future__ import annotations

import ipaddress
import socket

__all__ = ["free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on loopback `host` now; the OS may hand it out again once this returns,
    so bind it soon. Only loopback: a test never listens where another machine reaches it."""
    if not ipaddress.ip_address(host).is_loopback:
        raise ValueError(f"free_port: {host} is not a loopback address")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
