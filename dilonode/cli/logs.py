"""Logging setup for the CLI: readable text on a terminal, one JSON object per line otherwise.

`setup_logging(fmt)` configures the root logger and returns the format it chose ("text" when
stderr is a TTY, "json" otherwise, unless `--log-format` says). With text on a TTY,
`ProgressLine` keeps one status line at the bottom of the terminal: log records are printed
above it and it is redrawn after each, so logs and progress never garble each other.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from typing import TextIO

__all__ = ["JsonFormatter", "ProgressLine", "progress_line", "setup_logging"]

_CLEAR = "\r\x1b[K"  # carriage return + erase to end of line


# Fixed names: hivemind renames WARNING to "WARN" process-wide (logging.addLevelName) when
# it is imported, and a log shipper should not see the level's name change with it.
_LEVEL_NAMES = {logging.DEBUG: "DEBUG", logging.INFO: "INFO", logging.WARNING: "WARNING",
                logging.ERROR: "ERROR", logging.CRITICAL: "CRITICAL"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        level = _LEVEL_NAMES.get(record.levelno, record.levelname)
        out = {"ts": round(time.time(), 3), "level": level, "logger": record.name,
               "msg": record.getMessage()}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


class ProgressLine:
    """One self-overwriting line on a terminal; `update()` is throttled to `min_interval`."""

    def __init__(self, stream: TextIO, min_interval: float = 0.25) -> None:
        self.stream, self.min_interval = stream, min_interval
        self.text = ""
        self._last = float("-inf")
        self._lock = threading.Lock()

    def update(self, text: str, force: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            self.text = text
            if force or now - self._last >= self.min_interval:
                self._last = now
                self.stream.write(_CLEAR + text)
                self.stream.flush()

    def above(self, line: str) -> None:
        """Print `line` above the progress line, then redraw it."""
        with self._lock:
            self.stream.write(_CLEAR + line + "\n" + self.text)
            self.stream.flush()

    def close(self) -> None:
        """Leave the last progress text on screen and move to a fresh line."""
        with self._lock:
            if self.text:
                self.stream.write(_CLEAR + self.text + "\n")
                self.stream.flush()
            self.text = ""


class _ProgressAwareHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Text handler that prints records above the progress line when there is one."""

    progress: ProgressLine | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.progress is None or not self.progress.text:
            super().emit(record)
            return
        try:
            self.progress.above(self.format(record))
        except Exception:  # logging must never raise into the program
            self.handleError(record)


_handler: _ProgressAwareHandler | None = None


def setup_logging(fmt: str | None = None, level: int = logging.INFO) -> str:
    """Configure the root logger; `fmt` None picks text on a TTY, json otherwise."""
    global _handler
    fmt = fmt or ("text" if sys.stderr.isatty() else "json")
    handler = _ProgressAwareHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    _handler = handler
    return fmt


def progress_line(stream: TextIO | None = None) -> ProgressLine | None:
    """A `ProgressLine` on stderr when it is a terminal (None otherwise), wired to the log
    handler set up by `setup_logging` so log records print above it."""
    stream = stream or sys.stderr
    if not stream.isatty():
        return None
    line = ProgressLine(stream)
    if _handler is not None:
        _handler.progress = line
    return line
