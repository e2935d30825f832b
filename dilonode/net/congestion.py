"""The TCP congestion control of the node's bulk connections (`network.tcp_congestion`).

A round is all-to-all: every member sends to every other at once, so each node's uplink
carries N-1 flows and its downlink takes N-1 senders. BBR (version 1, what Linux ships as
`bbr`) ignores loss and, with several flows per bottleneck, keeps sending into a full
queue: on the test bed at 10 and 20 Mbit/s it sent a fifth to two fifths of a round's
bytes twice and a round took 1.34-1.39x the line rate's time, against under 1% and
1.13-1.17x with `cubic`; at 100 Mbit/s nothing was lost and bbr's pacing was 0.026 s a
round faster (docs/reports/2026-11-29-wan-round-congestion.md). `cubic`, Linux's
default, backs off on loss; the node asks for it on its data-plane and state-sync sockets
unless told otherwise. A kernel may refuse a name: not built in, or not in
`net.ipv4.tcp_allowed_congestion_control` for a process without CAP_NET_ADMIN. The socket
then keeps the system's default, and the node says so once.
"""

from __future__ import annotations

import logging
import socket
import threading

__all__ = ["SYSTEM", "NAME_PATTERN", "apply", "current"]

log = logging.getLogger(__name__)

SYSTEM = "system"  # leave the kernel's default (net.ipv4.tcp_congestion_control)
# Linux names are at most 15 characters (TCP_CA_NAME_MAX, 16 with the NUL).
NAME_PATTERN = r"^(system|[a-z][a-z0-9_]{0,14})$"

_ALLOWED = "/proc/sys/net/ipv4/tcp_allowed_congestion_control"
_warned: set[str] = set()
_lock = threading.Lock()


def apply(sock: socket.socket | None, name: str) -> bool:
    """Ask for congestion control `name` on a TCP socket; False if the kernel refused it
    (logged once per name) or there is nothing to set (not TCP, `SYSTEM`, no socket)."""
    if sock is None or name == SYSTEM or not hasattr(socket, "TCP_CONGESTION"):
        return False
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        return False
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
    except OSError as exc:
        _refused(name, sock, exc)
        return False
    return True


def current(sock: socket.socket) -> str:
    """The congestion control a TCP socket uses."""
    raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
    return raw.split(b"\0", 1)[0].decode()


def _refused(name: str, sock: socket.socket, exc: OSError) -> None:
    with _lock:
        if name in _warned:
            return
        _warned.add(name)
    try:
        kept = current(sock)
    except OSError:
        kept = "the system's default"
    log.warning("network.tcp_congestion = %r: the kernel refused it (%s; allowed for this "
                "user: %s); these connections keep %s", name, exc.strerror or exc,
                _allowed(), kept)


def _allowed() -> str:
    try:
        with open(_ALLOWED) as f:
            return f.read().strip() or "none"
    except OSError:
        return "unknown"
