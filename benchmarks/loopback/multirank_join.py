"""A swarm paced by the clock with nodes of 1 and 2 ranks, and a 2-rank node joining while
they train: it recovers the state from both (served by their leaders, gathered from their
ranks' slices), trains with them, and all three end on the same outer weights.

    python -m benchmarks.loopback.multirank_join --out runs/bench/multirank_join
"""

from __future__ import annotations

import argparse
import time

from dilonode.cli.local_swarm import LocalSwarm
from dilonode.config import load_config

KEYS = ("steps", "rounds_with_peers", "missed_rounds", "devices")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/bench/multirank_join")
    ap.add_argument("--steps", type=int, default=400, help="reference steps of 0.25 s")
    args = ap.parse_args()
    cfg = load_config(overrides={
        "run_id": "multirank-join", "device": "cpu", "seed": 1, "total_steps": args.steps,
        "eval_every": 50, "model": {"preset": "nano"}, "data": {"seq_len": 32, "batch_size": 4},
        "diloco": {"sync_every": 9, "num_fragments": 3, "pacing": "time",
                   "step_seconds": 0.25},
        "checkpoint": {"every_steps": 0, "on_exit": False},
        "network": {"matchmaking_window": 3.0, "matchmaking_timeout": 8.0,
                    "allreduce_timeout": 10.0, "min_peers": 2},
        "paths": {"out_dir": args.out}})
    swarm = LocalSwarm(cfg, 3)
    try:
        swarm.start_bootstrap()
        swarm.cfg_path.write_text(cfg.model_dump_json())
        swarm.start_node(0)
        swarm.start_node(1, ["--nproc", "2"])
        _wait_training(swarm)
        time.sleep(5)
        swarm.start_node(2, ["--nproc", "2"])
        summaries = swarm.follow(on_event=_print_recovery)
    finally:
        swarm.stop()
    for name, s in sorted(summaries.items()):
        print(name, s["outer_digest"][:16], "agrees" if s["agreement"].get("agrees")
              else "DISAGREES", *(f"{k}={s[k]}" for k in KEYS))


def _wait_training(swarm: LocalSwarm) -> None:
    seen: set[str] = set()
    while len(seen) < 2:
        name, ev = swarm.events.get(timeout=300)
        if ev.get("event") == "progress" and ev.get("step", 0) >= 30:
            seen.add(name)


def _print_recovery(name: str, ev: dict) -> None:
    if ev.get("event") == "recovered":
        print(name, "recovered step", ev.get("step"), "bytes from each peer",
              list((ev.get("peers") or {}).values()), "replayed", ev.get("replayed"),
              flush=True)


if __name__ == "__main__":
    main()
