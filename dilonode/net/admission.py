"""Admission control for the node's listening ports: who may hold a connection, and how many.

go-libp2p's resource manager and bitcoind's connection limits are the references. Every
accepted TCP connection costs a file descriptor, and a node that runs out of them fails in
places far from the listener (its DHT process, p2pd, checkpoints). So each listening port
(data plane, state sync, status) has a `Gate` with three caps (`Limits`):

* `max_open`: connections held at once on that port, authenticated or not;
* `max_pending`: of those, connections that have not finished their handshake (the status
  port, which has no authentication, counts them until their first request);
* `max_pending_per_source`: pending connections from one source address.

A connection over a cap is refused at once (closed before anything is read). When the
pending cap is reached, a newcomer from a lighter source evicts the oldest pending
connection of the heaviest one (bitcoind's idea: a flood from a few addresses cannot lock
out everyone else). Pending connections are closed by their listener's handshake deadline.

`limits_for(nofile)` sizes the caps from the open-files limit, leaving a reserve for the
DHT pipes, p2pd, outgoing connections and checkpoints; `raise_nofile_limit()` raises the
soft limit to the hard one first (the node calls it before its DHT process forks, so that
process and p2pd inherit it). Counters of refused and closed connections by reason, per
port, feed /metrics (`Admission.snapshot()`), and every peer-caused line goes through the
gate's `PeerLog`, so a flood writes a bounded number of lines.

Pure bookkeeping: no sockets; the listeners (`dilonode.net.listener`) call `admit`,
`established` and `release`, and give each ticket the function that closes its connection.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from dilonode.net.peer_log import PeerLog

if TYPE_CHECKING:
    from dilonode.config import AdmissionConfig

__all__ = ["CLOSED", "REFUSED", "Admission", "Gate", "Limits", "Ticket", "current_nofile",
           "limits_for", "raise_nofile_limit"]

log = logging.getLogger(__name__)

# Why a connection was refused before anything was read from it.
REFUSED = {
    "port_full": "connections refused: the port's cap is reached",
    "source_full": "connections refused: too many unauthenticated ones from that address",
    "fd_limit": "accept pauses: out of file descriptors",
}
# Why we closed a connection we had accepted.
CLOSED = {
    "handshake_timeout": "connections closed with no handshake in time",
    "unauthorized": "connections refused in the handshake",
    "malformed": "connections closed for malformed data",
    "oversized": "connections closed for an oversized request",
    "evicted": "unauthenticated connections evicted to admit another address",
    "idle": "idle connections closed",
    "abandoned": "handshakes abandoned by the peer",
}
_PHRASES = {**REFUSED, **CLOSED, "dropped_frames": "drops of frames for rounds not registered"}

_RESERVE_MIN = 256  # descriptors left to everything but the listeners, at least
_OPEN_MAX = 4096  # per port: beyond this, more connections only cost memory
_PENDING_MAX = 256  # per port: handshakes take milliseconds; a swarm never needs more


@dataclass(frozen=True)
class Limits:
    """Caps of one listening port (see the module docstring)."""

    max_open: int = 1024
    max_pending: int = 128
    max_pending_per_source: int = 32

    def __post_init__(self) -> None:
        if not 1 <= self.max_pending_per_source <= self.max_pending <= self.max_open:
            raise ValueError(f"admission limits: need 1 <= max_pending_per_source <= "
                             f"max_pending <= max_open, got {self}")


def limits_for(nofile: int, *, listeners: int = 3, reserve: int = 0,
               per_source: int = 32) -> Limits:
    """Caps per port for a process allowed `nofile` open files, shared by `listeners`.

    `reserve` (0: a quarter of the limit, at least 256) stays free for everything else
    the node opens; each port gets an equal share of the rest, half of it at most for
    connections still in their handshake, so proven peers always find room.
    """
    reserve = reserve or max(_RESERVE_MIN, nofile // 4)
    share = max(4, (max(nofile - reserve, 0)) // max(listeners, 1))
    max_open = min(share, _OPEN_MAX)
    max_pending = max(2, min(max_open // 2, _PENDING_MAX))
    return Limits(max_open, max_pending, max(1, min(per_source, max_pending)))


_UNLIMITED = 1 << 20  # what an infinite limit is sized as


def current_nofile() -> int:
    """The soft open-files limit (65536 where `resource` is missing)."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return 1 << 16
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return _UNLIMITED if soft == resource.RLIM_INFINITY else int(soft)


def raise_nofile_limit() -> int:
    """Raise the soft open-files limit to the hard limit; returns the soft limit now in
    force (that of before when the system refuses, or where `resource` is missing)."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return current_nofile()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return _UNLIMITED
    # macOS reports an infinite hard limit but refuses a soft limit above OPEN_MAX.
    for target in (hard, _UNLIMITED, 10240):
        if target == resource.RLIM_INFINITY or target <= soft:
            continue
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            continue
        log.info("open-files limit raised from %d to %d", soft, target)
        return target
    return soft


class Ticket:
    """One admitted connection; `close` (set by its listener) closes it when evicted."""

    __slots__ = ("close", "pending", "released", "source")

    def __init__(self, source: str) -> None:
        self.source = source
        self.pending = True
        self.released = False
        self.close: Callable[[], None] | None = None


class Gate:
    """Admission of one listening port; used on its event loop only."""

    def __init__(self, port: str, limits: Limits, peer_log: PeerLog) -> None:
        self.port, self.limits, self.log = port, limits, peer_log
        self.refused: dict[str, int] = dict.fromkeys(REFUSED, 0)
        self.closed: dict[str, int] = dict.fromkeys(CLOSED, 0)
        self.open = 0
        self.pending = 0
        # source -> its pending tickets, oldest first (a dict as an ordered set)
        self._pending: dict[str, dict[Ticket, None]] = {}

    def admit(self, source: str) -> Ticket | None:
        """A ticket for a new connection from `source`, or None (refused, counted and
        logged): the caller closes the connection at once."""
        lim = self.limits
        mine = len(self._pending.get(source, ()))
        refusal = None
        if self.open >= lim.max_open:
            refusal = ("port_full", f"{lim.max_open} connections open")
        elif mine >= lim.max_pending_per_source:
            refusal = ("source_full", f"{mine} unauthenticated connections from it already")
        elif self.pending >= lim.max_pending and not self._evict_for(source, mine):
            refusal = ("port_full", f"{lim.max_pending} unauthenticated connections open")
        if refusal is not None:
            reason, why = refusal
            self._refuse(reason, source, f"{self.port} port: refused a connection from "
                         f"{source}: {why}")
            return None
        ticket = Ticket(source)
        self._pending.setdefault(source, {})[ticket] = None
        self.pending += 1
        self.open += 1
        return ticket

    def established(self, ticket: Ticket) -> None:
        """The connection passed its handshake: it no longer counts as pending."""
        if ticket.pending and not ticket.released:
            self._unpend(ticket)

    def release(self, ticket: Ticket, reason: str | None = None) -> None:
        """The connection is closed (`reason`: why we closed it, counted). Idempotent."""
        if ticket.released:
            return
        ticket.released = True
        if ticket.pending:
            self._unpend(ticket)
        self.open -= 1
        if reason is not None:
            self.closed[reason] = self.closed.get(reason, 0) + 1

    def closing(self, ticket: Ticket | None, reason: str, text: str, *, key: str = "",
                source: str = "?") -> None:
        """We close a connection for `reason`: count it and log `text` through the
        aggregator (`text` names the peer; peer-derived parts already capped). `source`
        is used when there is no ticket."""
        source = ticket.source if ticket is not None else source
        if ticket is not None:
            self.release(ticket, reason)
        else:
            self.closed[reason] = self.closed.get(reason, 0) + 1
        self.log.event(reason, source, text, key=key)

    def refuse_counted(self, reason: str, source: str, text: str) -> None:
        """Count and log a refusal decided outside `admit` (an accept that failed)."""
        self._refuse(reason, source, text)

    def snapshot(self) -> dict[str, object]:
        return {"refused": self.refused.copy(), "closed": self.closed.copy(),
                "open": self.open, "pending": self.pending, "limits": asdict(self.limits)}

    # -- internals -------------------------------------------------------------------------
    def _refuse(self, reason: str, source: str, text: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        self.log.event(reason, source, text)

    def _unpend(self, ticket: Ticket) -> None:
        ticket.pending = False
        self.pending -= 1
        mine = self._pending.get(ticket.source)
        if mine is not None:
            mine.pop(ticket, None)
            if not mine:
                del self._pending[ticket.source]

    def _evict_for(self, source: str, mine: int) -> bool:
        """Make room for a newcomer from `source` (holding `mine` pending connections) by
        closing the oldest pending connection of the heaviest source, if that one holds
        at least two more than `source` would after admission; True if room was made."""
        heavy = max(self._pending, key=lambda s: len(self._pending[s]), default=None)
        if heavy is None or len(self._pending[heavy]) < mine + 2:
            return False
        victim = next((t for t in self._pending[heavy] if t.close is not None), None)
        if victim is None or victim.close is None:
            return False
        close = victim.close
        self.closing(victim, "evicted", f"{self.port} port: evicted an unauthenticated "
                     f"connection from {heavy} to admit one from {source}")
        close()
        return True


class Admission:
    """The gates of one node's listening ports, with shared limits and log settings.

    `limits` applies to gates created after `configure`; `interval` is the summary period
    of their `PeerLog`s. No I/O; the clock is injected.
    """

    def __init__(self, limits: Limits | None = None, *, interval: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits or Limits()
        self.interval, self.clock = interval, clock
        self.nofile: int | None = None  # the open-files limit the caps were sized from
        self._gates: dict[str, Gate] = {}

    def configure(self, limits: Limits, nofile: int | None = None) -> None:
        self.limits, self.nofile = limits, nofile
        for gate in self._gates.values():
            gate.limits = limits

    def setup(self, cfg: AdmissionConfig) -> Limits:
        """At node start, before the DHT process forks (it and p2pd inherit the limit):
        raise the open-files limit (`cfg.raise_nofile`) and size the caps from it, with
        the config's explicit caps taking precedence."""
        nofile = raise_nofile_limit() if cfg.raise_nofile else current_nofile()
        limits = limits_for(nofile, reserve=cfg.fd_reserve,
                            per_source=cfg.max_pending_per_source)
        max_open = cfg.max_open or limits.max_open
        max_pending = min(cfg.max_pending or limits.max_pending, max_open)
        limits = replace(limits, max_open=max_open, max_pending=max_pending,
                         max_pending_per_source=min(cfg.max_pending_per_source, max_pending))
        self.configure(limits, nofile)
        log.info("admission: %d open files allowed; per port at most %d connections, %d in "
                 "their handshake, %d of those from one address", nofile, limits.max_open,
                 limits.max_pending, limits.max_pending_per_source)
        return limits

    def gate(self, port: str, logger: logging.Logger | None = None) -> Gate:
        """The gate of `port` ("data", "state", "status"), created on first use."""
        gate = self._gates.get(port)
        if gate is None:
            peer_log = PeerLog(logger or log, f"{port} port", interval=self.interval,
                               phrases=_PHRASES, clock=self.clock)
            gate = self._gates[port] = Gate(port, self.limits, peer_log)
        return gate

    def snapshot(self) -> dict[str, object]:
        """Counters per port and of the peer logs, as plain JSON-ready values."""
        gates = list(self._gates.items())
        logs = [g.log for _, g in gates]
        return {"ports": {name: g.snapshot() for name, g in gates}, "nofile": self.nofile,
                "log": {"lines": sum(x.lines for x in logs),
                        "folded": sum(x.folded for x in logs),
                        "truncated": sum(x.truncated for x in logs)}}
