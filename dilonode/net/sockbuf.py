"""Socket buffers sized to the bandwidth-delay product, within what the kernel allows.

A TCP flow carries at most one window per round trip, and its window is bounded by the
sender's SO_SNDBUF and the receiver's SO_RCVBUF, so a link of B bit/s and round trip T
needs buffers of about B T / 8 bytes (1 Gbit/s at 500 ms: 62.5 MB). Linux gives three ways
to a buffer, each with its own ceiling:

* `setsockopt(SO_SNDBUF / SO_RCVBUF, n)` reserves 2 min(n, net.core.{w,r}mem_max) and turns
  that direction's autotuning off;
* `SO_SNDBUFFORCE / SO_RCVBUFFORCE` do the same past the core ceiling, with CAP_NET_ADMIN;
* setting nothing leaves autotuning, which grows the buffer as the flow needs up to
  net.ipv4.tcp_{w,r}mem[2] (per network namespace), often above the core ceiling.

`choose` picks, per direction, the way that reaches furthest towards the size asked for;
`apply` carries it out on a socket. The arithmetic is pure; only `apply` and `limits`
touch the kernel.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

__all__ = ["AUTOTUNE", "BufferPlan", "KernelLimits", "apply", "bdp_bytes", "choose", "limits"]

AUTOTUNE = 0
"""A `BufferPlan` size that leaves the kernel's autotuning."""

# The round trip "auto" plans for: intercontinental paths stay under it.
DEFAULT_PLAN_RTT_S = 0.5
# Headroom over one BDP: a window of exactly one BDP stalls on every ack hiccup.
_HEADROOM = 2.0
_MIN_BYTES = 4 << 20
# 119 MiB buffers stalled a 1 Gbit/s round on the test bed; 64 MiB covers 1 Gbit/s x 500 ms.
_MAX_BYTES = 64 << 20

_SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)
_SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)


def bdp_bytes(rate_mbps: float, rtt_s: float = DEFAULT_PLAN_RTT_S) -> int:
    """Buffer bytes for a link of `rate_mbps` and round trip `rtt_s`: the product with
    headroom, between 4 MiB and 64 MiB."""
    if rate_mbps <= 0 or rtt_s <= 0:
        raise ValueError(f"bdp_bytes: rate_mbps = {rate_mbps} and rtt_s = {rtt_s} must be > 0")
    want = int(_HEADROOM * rate_mbps * 1e6 * rtt_s / 8)
    return max(_MIN_BYTES, min(_MAX_BYTES, want))


@dataclass(frozen=True)
class BufferPlan:
    """What to ask of the kernel for one direction: `size` bytes (AUTOTUNE: nothing),
    by the forcing option when `force`."""

    size: int
    force: bool = False


def choose(want: int, core_max: int, tcp_max: int, privileged: bool) -> BufferPlan:
    """The way to reach `want` bytes of buffer for one direction, given the core ceiling
    (net.core.{w,r}mem_max), autotuning's (net.ipv4.tcp_{w,r}mem[2]) and whether the
    process may force past the core one. The kernel reserves twice a setsockopt value
    (half for its bookkeeping), so an explicit `n` gives about `n` of window."""
    if want < 0:
        raise ValueError(f"choose: want = {want} must be >= 0")
    if want == AUTOTUNE:
        return BufferPlan(AUTOTUNE)
    if privileged:
        return BufferPlan(want, force=True)
    explicit = min(want, core_max)
    # Autotuning's ceiling counts the whole reservation, as the doubled explicit value does.
    if tcp_max >= 2 * explicit:
        return BufferPlan(AUTOTUNE)
    return BufferPlan(explicit)


@dataclass(frozen=True)
class KernelLimits:
    """This network namespace's buffer ceilings."""

    wmem_max: int
    rmem_max: int
    tcp_wmem_max: int
    tcp_rmem_max: int


def _read_int(path: str, field: int = 0) -> int:
    try:
        return int(Path(path).read_text().split()[field])
    except (OSError, ValueError, IndexError):
        return 0


def limits() -> KernelLimits:
    """The ceilings from /proc/sys (0 for any that cannot be read)."""
    return KernelLimits(wmem_max=_read_int("/proc/sys/net/core/wmem_max"),
                        rmem_max=_read_int("/proc/sys/net/core/rmem_max"),
                        tcp_wmem_max=_read_int("/proc/sys/net/ipv4/tcp_wmem", 2),
                        tcp_rmem_max=_read_int("/proc/sys/net/ipv4/tcp_rmem", 2))


def _set(sock: socket.socket, plan: BufferPlan, plain: int, forced: int) -> bool:
    """Carry out `plan`; False if the kernel refused the forcing option (nothing set)."""
    if plan.size == AUTOTUNE:
        return True
    try:
        sock.setsockopt(socket.SOL_SOCKET, forced if plan.force else plain, plan.size)
    except PermissionError:
        return False
    return True


def apply(sock: socket.socket, want: int, kernel: KernelLimits) -> None:
    """Give `sock` buffers of about `want` bytes each way: forced where the process may
    (CAP_NET_ADMIN), else the better of the plain option and autotuning (`choose`)."""
    for core, tcp, plain, forced in ((kernel.wmem_max, kernel.tcp_wmem_max, socket.SO_SNDBUF,
                                      _SO_SNDBUFFORCE),
                                     (kernel.rmem_max, kernel.tcp_rmem_max, socket.SO_RCVBUF,
                                      _SO_RCVBUFFORCE)):
        if not _set(sock, choose(want, core, tcp, privileged=True), plain, forced):
            _set(sock, choose(want, core, tcp, privileged=False), plain, forced)
