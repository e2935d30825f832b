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

A long round trip turns that around. Loss-based cubic grows its window once a round trip,
and a lost packet halves it: through 100 ms of one-way delay with 0.1% of packets lost on
each end, a 20 Mbit/s round took 5.26 s with cubic and 1.08 s with bbr (6.77x against
1.39x the line rate; docs/reports/2026-12-04-congestion-rtt.md). So "auto", the default,
picks per connection from the round trip its handshake measured (`pick`): bbr from
`AUTO_BBR_RTT_S` on, cubic below.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading

__all__ = ["AUTO", "AUTO_BBR_RTT_S", "NAME_PATTERN", "SYSTEM", "apply", "current",
           "handshake_rtt", "pick", "settable"]

log = logging.getLogger(__name__)

SYSTEM = "system"  # leave the kernel's default (net.ipv4.tcp_congestion_control)
AUTO = "auto"  # per connection, from its handshake's round trip (`pick`)
# Where "auto" switches to bbr. On the test bed at 20 Mbit/s with 0.1% loss, 5 ms one-way
# (10 ms round trip) is the last delay at which cubic kept up (0.883 s against bbr's
# 0.849 s a round); from 20 ms one-way it fell behind (1.29 s against 0.88 s). On a clean
# link with no delay cubic is the faster one (docs/reports/2026-11-29-wan-round-congestion.md).
AUTO_BBR_RTT_S = 0.020
# Linux names are at most 15 characters (TCP_CA_NAME_MAX, 16 with the NUL).
NAME_PATTERN = r"^(system|[a-z][a-z0-9_]{0,14})$"
# struct tcp_info (linux/tcp.h): 8 bytes of u8 fields and bitfields, then u32s; tcpi_rtt,
# the smoothed round trip in microseconds, is the 16th of those.
_TCPI_RTT_OFFSET = 8 + 15 * 4
_TCP_INFO_BYTES = 104

_ALLOWED = "/proc/sys/net/ipv4/tcp_allowed_congestion_control"
_AVAILABLE = "/proc/sys/net/ipv4/tcp_available_congestion_control"
_warned: set[str] = set()
_lock = threading.Lock()


def apply(sock: socket.socket | None, name: str) -> bool:
    """Ask for congestion control `name` on a connected TCP socket (`AUTO`: `pick`'s for its
    round trip); False if the kernel refused it (logged once per name) or there is nothing
    to set (not TCP, `SYSTEM`, no socket, a round trip the kernel does not say)."""
    if sock is None or name == SYSTEM or not hasattr(socket, "TCP_CONGESTION"):
        return False
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        return False
    if name == AUTO:
        name = pick(handshake_rtt(sock))
        if name == SYSTEM:
            return False
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
    except OSError as exc:
        _refused(name, sock, exc)
        return False
    return True


def handshake_rtt(sock: socket.socket) -> float | None:
    """The kernel's smoothed round trip of a connected TCP socket, in seconds (just after
    connecting or accepting: its handshake's); None where the kernel does not say."""
    opt = getattr(socket, "TCP_INFO", None)
    if opt is None:
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, opt, _TCP_INFO_BYTES)
    except OSError:
        return None
    if len(raw) < _TCPI_RTT_OFFSET + 4:
        return None
    (rtt_us,) = struct.unpack_from("=I", raw, _TCPI_RTT_OFFSET)
    return rtt_us / 1e6 if rtt_us else None


def pick(rtt: float | None) -> str:
    """What "auto" asks for on a connection whose round trip is `rtt` seconds: bbr from
    `AUTO_BBR_RTT_S` on, cubic below, the system's default when it is unknown."""
    if rtt is None:
        return SYSTEM
    return "bbr" if rtt >= AUTO_BBR_RTT_S else "cubic"


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
    log.warning("network.tcp_congestion = %r: the kernel refused it (%s; this process may "
                "set: %s); these connections keep %s", name, exc.strerror or exc,
                _allowed(), kept)


def settable() -> set[str] | None:
    """The names this process may ask for: any the kernel has when it runs as root (which
    holds CAP_NET_ADMIN), else `net.ipv4.tcp_allowed_congestion_control`; None where /proc
    does not say."""
    path = _AVAILABLE if os.geteuid() == 0 else _ALLOWED
    try:
        with open(path) as f:
            return set(f.read().split())
    except OSError:
        return None


def _allowed() -> str:
    names = settable()
    return "unknown" if names is None else " ".join(sorted(names)) or "none"
