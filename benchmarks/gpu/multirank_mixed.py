"""A swarm of a 1-rank node on a GPU and a 2-rank node on the CPU: both must end with the
same outer weights and pass the end-of-run agreement.

    python -m benchmarks.gpu.multirank_mixed --out runs/bench/multirank_mixed   # needs CUDA

Without CUDA (`--cpu`) both nodes run on the CPU: the same swarm, as a dry run.
"""

from __future__ import annotations

import argparse

from dilonode.cli.local_swarm import LocalSwarm
from dilonode.config import load_config


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/bench/multirank_mixed")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--cpu", action="store_true", help="no GPU: node 0 on the CPU too")
    args = ap.parse_args()
    cfg = load_config(overrides={
        "run_id": "multirank-mixed", "seed": 2, "total_steps": args.steps, "eval_every": 20,
        "model": {"preset": args.preset}, "data": {"seq_len": 64, "batch_size": 4},
        "diloco": {"sync_every": 10, "num_fragments": 3, "pacing": "steps"},
        "codec": {"name": "int4"}, "checkpoint": {"every_steps": 0, "on_exit": False},
        "network": {"matchmaking_window": 20.0, "matchmaking_timeout": 40.0},
        "paths": {"out_dir": args.out}})
    swarm = LocalSwarm(cfg, 2)
    try:
        swarm.start_bootstrap()
        swarm.start_nodes({0: ["--set", f"device={'cpu' if args.cpu else 'cuda'}"],
                           1: ["--nproc", "2", "--set", "device=cpu"]})
        summaries = swarm.follow()
    finally:
        swarm.stop()
    for name, s in sorted(summaries.items()):
        print(name, s["devices"], s["outer_digest"][:16], s["agreement"].get("line", ""))
    digests = {s["outer_digest"] for s in summaries.values()}
    agree = len(summaries) == 2 and len(digests) == 1 and all(
        s["agreement"].get("agrees") for s in summaries.values())
    print("agreement" if agree else "NO AGREEMENT")
    return 0 if agree else 1


if __name__ == "__main__":
    raise SystemExit(main())
