"""How long a joiner's arrival held its peers' rounds back, read from a finished run's logs.

    python -m benchmarks.loopback.join_wait runs/bench/join-ra-s0/auto+slow-joiner-100 [...]

For each run directory (one `node-N/stderr.log` per node, as `benchmarks/testbed/autotune.py
--runs auto+slow-joiner` leaves them): node 0's gap between its last group without the
joiner and its first group with it (its rounds in between waited for the joiner in
matchmaking), and the median gap between its groups over the run, for scale.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

_GROUP = re.compile(r"group \S+: (?:closed with )?(\d+) member")


def group_times(log: Path) -> list[tuple[float, int]]:
    """(time, members) of every group the node formed or joined, in order."""
    out = []
    for line in log.read_text().splitlines():
        if not line.startswith("{"):
            continue
        ev = json.loads(line)
        if m := _GROUP.search(ev.get("msg", "")):
            out.append((float(ev["ts"]), int(m.group(1))))
    return out


def join_wait(run: Path, node: str = "node-0") -> tuple[float, float]:
    """(gap before the first larger group, median gap between groups), seconds."""
    groups = group_times(run / node / "stderr.log")
    if not groups:
        raise SystemExit(f"join_wait: no group lines in {run / node / 'stderr.log'}")
    size = groups[0][1]
    first = next((k for k, (_, n) in enumerate(groups) if n > size), None)
    if first is None or first == 0:
        raise SystemExit(f"join_wait: {run}: no group larger than the first ({size})")
    gaps = [b[0] - a[0] for a, b in zip(groups, groups[1:], strict=False)]
    return groups[first][0] - groups[first - 1][0], statistics.median(gaps)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (node-N/stderr.log)")
    args = ap.parse_args(argv)
    for run in args.runs:
        wait, median = join_wait(run)
        print(f"{run}: {wait:.1f} s before the first group with the joiner "
              f"(median gap between groups {median:.1f} s)")


if __name__ == "__main__":
    main(sys.argv[1:])
