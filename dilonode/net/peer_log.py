"""Log lines caused by peers, bounded whatever the peers send and however fast.

Every listener (data plane, state sync, status) logs what a peer makes it do: a refused
handshake, a malformed frame or request, an idle connection it closed, a connection it
refused. Two tools keep those lines small and few:

* `cap(text, limit)` turns peer-derived text (a reason quoting a frame, a claimed peer id)
  into one printable line of at most `limit` characters plus a note of the original length.
* `PeerLog` writes the first event of each (reason, source, key) in full and folds the rest
  into one summary line per reason per `interval`, e.g.

      data port: 1,874 connections closed with no handshake in time from 1 address
      in the last 60 s

  Full lines are also limited to `full_per_interval` per reason per interval (a flood from
  many addresses is folded too), so a `PeerLog` writes at most `full_per_interval + 1`
  lines per reason per interval, whatever the input rate.

Pure apart from the injected logger; the clock is injected. Nothing fires on its own: the
owner calls `flush()` now and then (the listeners' accept loops do) so that a burst's
summary is written even when no event follows it, and `flush(force=True)` when it closes.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

__all__ = ["CAP", "PeerLog", "cap"]

CAP = 200  # characters of peer-derived text in one log line
_LINE_MAX = 512  # a whole line, our own words included
_SOURCES_COUNTED = 10_000  # distinct addresses counted per summary ("10,000+" beyond)


def cap(text: object, limit: int = CAP) -> str:
    """`text` as one printable line of at most `limit` characters (plus a length note).

    Only a prefix of `text` is looked at, so a megabyte of garbage costs no more than a
    short string; newlines and control characters cannot reach the log.
    """
    s = str(text)
    head = s[: limit * 2]
    flat = "".join(ch if ch.isprintable() else "?" for ch in " ".join(head.split()))
    if len(s) == len(head) and len(flat) <= limit:
        return flat
    return f"{flat[:limit]}... ({len(s):,} chars)"


@dataclass
class _Window:
    """One reason's current interval: full lines written, events folded, their sources."""

    start: float
    full: int = 0
    folded: int = 0
    sources: set[str] = field(default_factory=set)


class PeerLog:
    """Aggregates peer-caused log events; see the module docstring.

    `what` starts every summary line ("data port"); `phrases` maps a reason to the words of its
    summary ("connections closed with no handshake in time"), the reason itself otherwise.
    `remember` bounds the (reason, source, key) triples already logged in full (least
    recently seen forgotten first: forgetting only costs one more full line, still within
    the per-interval bound).
    """

    def __init__(self, logger: logging.Logger, what: str, *, interval: float = 60.0,
                 full_per_interval: int = 5, remember: int = 4096,
                 phrases: Mapping[str, str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval <= 0 or full_per_interval < 0 or remember < 1:
            raise ValueError("PeerLog: interval > 0, full_per_interval >= 0, remember >= 1")
        self.logger, self.what = logger, what
        self.interval, self.full_per_interval = interval, full_per_interval
        self.remember, self.phrases, self.clock = remember, dict(phrases or {}), clock
        self._seen: OrderedDict[tuple[str, str, str], None] = OrderedDict()
        self._windows: dict[str, _Window] = {}
        self.lines = 0  # lines written
        self.folded = 0  # events counted in a summary instead of a line of their own
        self.truncated = 0  # peer-derived texts cut by `cap`

    def cap(self, text: object, limit: int = CAP) -> str:
        """`cap(text, limit)`, counting the texts that had to be cut."""
        out = cap(text, limit)
        if len(out) > limit:
            self.truncated += 1
        return out

    def event(self, reason: str, source: str, text: str, *, key: str = "",
              level: int = logging.WARNING) -> bool:
        """Record one event caused by `source` (an address); True when it was written in
        full. `text` is the whole line, naming the peer (peer-derived parts already capped);
        `key` tells apart events from one source that deserve a line each (the peer id a
        connection claimed), within the per-interval bound."""
        now = self.clock()
        self._flush_due(now)
        window = self._windows.get(reason)
        if window is None:
            window = self._windows[reason] = _Window(now)
        if self._first(reason, source, key) and window.full < self.full_per_interval:
            window.full += 1
            self._write(level, text)
            return True
        window.folded += 1
        self.folded += 1
        if len(window.sources) < _SOURCES_COUNTED:
            window.sources.add(source)
        return False

    def flush(self, force: bool = False) -> int:
        """Write the summaries whose interval is over (all of them with `force`); returns
        how many lines that wrote."""
        return self._flush_due(self.clock(), force)

    def _first(self, reason: str, source: str, key: str) -> bool:
        triple = (reason, source, key)
        if triple in self._seen:
            self._seen.move_to_end(triple)
            return False
        self._seen[triple] = None
        if len(self._seen) > self.remember:
            self._seen.popitem(last=False)
        return True

    def _flush_due(self, now: float, force: bool = False) -> int:
        written = 0
        for reason, window in list(self._windows.items()):
            if not force and now - window.start < self.interval:
                continue
            del self._windows[reason]
            if window.folded:
                self._write(logging.WARNING, self._summary(reason, window, now))
                written += 1
        return written

    def _summary(self, reason: str, window: _Window, now: float) -> str:
        n = len(window.sources)
        where = f"{n:,}{'+' if n >= _SOURCES_COUNTED else ''} address{'es' if n != 1 else ''}"
        phrase = self.phrases.get(reason, reason)
        return (f"{self.what}: {window.folded:,} more {phrase} from {where} in the last "
                f"{max(now - window.start, 0.0):.0f} s")

    def _write(self, level: int, line: str) -> None:
        self.lines += 1
        if len(line) > _LINE_MAX:  # a caller forgot to cap something: cut it here
            self.truncated += 1
            line = line[:_LINE_MAX - 3] + "..."
        self.logger.log(level, "%s", line)
