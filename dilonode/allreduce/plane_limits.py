"""The numbers and switches of a `DataPlane` (`transport.py`), and its keyword arguments.

`PlaneLimits` groups what bounds the plane's memory, connections and waits; its defaults
suit a node, and tests and benchmarks change the few they need
(`DataPlane(peer, run, limits=PlaneLimits(pending_ttl=0.1))`). The plane's dependencies
(credentials, the fallback path, the admission gate) stay keyword arguments of their own;
`PlaneOptions` types the lot for a caller that hands them on (`NetworkCollective`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TypedDict

from dilonode.net import congestion
from dilonode.net.admission import Gate
from dilonode.net.auth import Credentials
from dilonode.net.channel import StreamOpener
from dilonode.wire.framing import DEFAULT_MAX_FRAME_BYTES

__all__ = ["PlaneLimits", "PlaneOptions"]


@dataclass(frozen=True)
class PlaneLimits:
    """Bounds and switches of one `DataPlane`; every field has a node's default."""

    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    """Largest frame accepted from a peer (header and body); a bigger one is a peer error."""
    connect_timeout: float = 5.0
    """Seconds for one connection attempt, and for an accepted connection to complete
    its handshake."""
    pending_ttl: float = 10.0
    """Seconds frames for a round nobody registered yet are kept (peers start a round a
    few ms apart); then they are dropped and logged."""
    max_pending_frames: int = 100_000
    """Frames kept for one unregistered round."""
    max_pending_keys: int = 64
    """Unregistered rounds frames are kept for."""
    max_pending_bytes: int = 512 << 20
    """Bytes of frames kept for all unregistered rounds together."""
    max_queued_bytes: int = 512 << 20
    """Bytes of frames waiting in registered inboxes above which the plane stops reading
    its sockets; reading resumes at half."""
    socket_buffer_bytes: int = 4 << 20
    """Send and receive buffer bytes every connection aims for (`dilonode.net.sockbuf`:
    forced, set or autotuned, whichever reaches furthest); 0 leaves the kernel's autotuning."""
    max_idle_inbound: int = 0
    """Open accepted connections above which idle ones of peers with no round here close
    (and a sender forgets closed connection objects past as many peers); 0: no bound."""
    idle_close_s: float = 30.0
    """Seconds without a byte read after which such a connection counts as idle."""
    direct_retry: float = 600.0
    """With a fallback: seconds after a failed direct dial during which a peer gets the
    fallback stream without a dial first."""
    tcp_congestion: str = congestion.SYSTEM
    """Congestion control of the plane's connections (`congestion.apply`); "system"
    leaves the kernel's default."""
    tune_malloc: bool = True
    """`start()` calls `tune_allocator()` (process-wide; off for a process that must give
    freed memory back to the kernel at once)."""

    def __post_init__(self) -> None:
        if self.max_frame_bytes <= 0 or self.connect_timeout <= 0:
            raise ValueError(f"PlaneLimits: max_frame_bytes = {self.max_frame_bytes} and "
                             f"connect_timeout = {self.connect_timeout} must be > 0")
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, str) and value < 0:
                raise ValueError(f"PlaneLimits: {f.name} = {value} must be >= 0")


class PlaneOptions(TypedDict, total=False):
    """The keyword arguments of `DataPlane` besides its address, for a caller that builds
    them in one place and hands them on."""

    limits: PlaneLimits
    auth: Credentials | None
    fallback: StreamOpener | None
    gate: Gate | None
