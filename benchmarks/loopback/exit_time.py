"""How long a node's process takes to end once it has said it is done: a lone node on
loopback (nano model, a few steps) runs `python -m dilonode.cli run --log-format json`, and
this times its `summary` event to the process's exit, --runs times.

    .venv/bin/python -m benchmarks.loopback.exit_time --runs 3

What comes after the summary is the node closing its parts, then the process exit (with
`exiting.exit_without_finalizing`, no interpreter teardown).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dilonode.cli.local_swarm import LocalSwarm
from dilonode.config import load_config

__all__ = ["main"]


def one_exit(tmp: Path) -> float:
    """Seconds from the node's summary event to its exit."""
    cfg = load_config(overrides={
        "run_id": "exit-time", "total_steps": 4, "device": "cpu", "model": {"preset": "nano"},
        "data": {"seq_len": 32, "batch_size": 4, "eval_batches": 1},
        "network": {"matchmaking_window": 1.0}, "paths": {"out_dir": str(tmp)}})
    cfg_path = tmp / "cfg.json"
    cfg_path.write_text(cfg.model_dump_json())
    swarm = LocalSwarm(cfg, 0)
    try:
        maddrs = swarm.start_bootstrap()
        with (tmp / "node.log").open("w") as log:
            node = subprocess.Popen(
                [sys.executable, "-m", "dilonode.cli", "run", "--config", str(cfg_path),
                 "--out", str(tmp / "node"), "--log-format", "json", "--initial-peers",
                 *maddrs], stdout=subprocess.PIPE, stderr=log, text=True)
            said = None
            assert node.stdout is not None
            for line in node.stdout:
                if json.loads(line).get("event") == "summary":
                    said = time.monotonic()
            node.wait(timeout=60)
            ended = time.monotonic()
        if node.returncode != 0 or said is None:
            raise SystemExit(f"exit_time: the node failed (exit {node.returncode}); see "
                             f"{tmp / 'node.log'}")
        return ended - said
    finally:
        swarm.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            print(f"summary to exit: {one_exit(Path(tmp)):.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
