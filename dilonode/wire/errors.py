"""The two error families of the wire protocol and the all-reduce state machine.

`RemoteProtocolError` means a peer sent something wrong: the caller logs it, counts it and
drops that peer from the round; it must never crash the daemon. `LocalProtocolError` means
our own code broke an invariant (a bug, or an API misused by the driver), so it is allowed to
propagate. The split follows h11, where the same distinction decides who is to blame.
"""

from __future__ import annotations

__all__ = ["LocalProtocolError", "RemoteProtocolError", "one_line"]

_REASON_MAX = 512


def one_line(text: str, limit: int = _REASON_MAX) -> str:
    """Collapse `text` to one printable line of at most `limit` characters.

    Reasons often quote peer data; a peer must not be able to inject newlines or megabytes
    into our logs.
    """
    flat = " ".join(str(text).split())
    flat = "".join(ch if ch.isprintable() else "?" for ch in flat)
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


class RemoteProtocolError(ValueError):
    """A peer violated the protocol; `reason` is one line saying what was wrong.

    `culprit` is the member index of the peer to blame when the layer raising the error
    knows it (the round does; the frame decoder does not, its caller knows the connection).
    """

    def __init__(self, reason: str, *, culprit: int | None = None) -> None:
        self.reason = one_line(reason)
        self.culprit = culprit
        super().__init__(self.reason)


class LocalProtocolError(RuntimeError):
    """We broke our own invariant or the driver misused the API; this is a bug here."""
