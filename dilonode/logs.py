"""Logging setup for the CLI: readable text on a terminal, one JSON object per line otherwise."""

from __future__ import annotations

import json
import logging
import sys
import time

__all__ = ["setup_logging"]


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(time.time(), 3), "level": record.levelname, "logger": record.name,
               "msg": record.getMessage()}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(fmt: str | None = None, level: int = logging.INFO) -> str:
    """Configure the root logger; `fmt` None picks text on a TTY, json otherwise."""
    fmt = fmt or ("text" if sys.stderr.isatty() else "json")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    return fmt
