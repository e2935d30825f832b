"""Where every benchmark writes its `--json` results: its arguments and its table rows."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def save_rows(path: Path | None, args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """Write {"args", "rows"} to `path` (nothing when None), creating its folder."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                "rows": rows}, indent=2))
