"""Where every benchmark writes its `--json` results (and any text report beside them).

`save_rows` writes the common shape, the benchmark's arguments and its table rows; a
benchmark whose results are another document (several tables, an environment, runs to
resume from) writes it with `write_json`. Both create the folder and write nothing for a
path of None (the option not given).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

__all__ = ["save_rows", "write_json", "write_text"]


def write_text(path: Path | None, text: str) -> None:
    """Write `text` and a final newline to `path` (nothing when None), creating its folder."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.rstrip("\n") + "\n")


def write_json(path: Path | None, doc: Any) -> None:
    """Write `doc` as indented JSON to `path` (nothing when None). Values JSON cannot hold
    (paths, sets) are written as their str(): a long run must not fail at its last line."""
    write_text(path, json.dumps(doc, indent=2, default=str))


def save_rows(path: Path | None, args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """Write {"args", "rows"} to `path` (nothing when None), the arguments as strings."""
    write_json(path, {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows})
