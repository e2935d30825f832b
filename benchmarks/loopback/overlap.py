"""Overlap benchmark: share of wall time the training thread spends computing while fragment
syncs run in the background, for real nodes (`dilonode swarm`) on loopback.

Utilization is the share of each node's wall time its training thread was not blocked waiting
for a sync result (the wait inside `land`); the stricter "step share" counts only `train_step`
(so pseudo-gradient extraction, outer steps and merges count against it). Evaluation is off.

    python -m benchmarks.loopback.overlap --nodes 3 --json runs/bench/overlap.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.harness.args import ints
from benchmarks.harness.results import save_rows
from dilonode.algo.codec_table import CODEC_NAMES
from dilonode.cli.local_swarm import LocalSwarm
from dilonode.config import load_config


def run(args: argparse.Namespace, tau: int, out: Path) -> dict:
    cfg = load_config(overrides={
        "run_id": f"overlap-tau{tau}", "seed": 0, "total_steps": args.steps,
        "eval_every": 10**9, "device": "cpu",
        "model": {"preset": args.preset},
        "data": {"seq_len": args.seq_len, "batch_size": args.batch_size},
        "diloco": {"mode": "streaming", "sync_every": args.sync_every,
                   "num_fragments": args.fragments, "fragment_sync_delay": tau,
                   "fragment_update_alpha": 0.5},
        "codec": {"name": args.codec},
        "network": {"matchmaking_window": 5.0, "matchmaking_timeout": 15.0,
                    "allreduce_timeout": 20.0},
        "paths": {"out_dir": str(out / f"tau{tau}")},
    })
    swarm = LocalSwarm(cfg, args.nodes)
    try:
        swarm.start()
        summaries = swarm.follow()
    finally:
        swarm.stop()
    utils = [s["compute_utilization"] for s in summaries.values()]
    shares = [s["step_share"] for s in summaries.values()]
    return {"tau": tau, "nodes": len(summaries), "utilization_min": min(utils),
            "utilization_mean": sum(utils) / len(utils),
            "step_share_mean": sum(shares) / len(shares),
            "sync_wait_s_max": max(s["sync_wait_s"] for s in summaries.values()),
            "skipped_rounds": sum(s["skipped_rounds"] for s in summaries.values()),
            "rounds": summaries[min(summaries)]["rounds_per_fragment"],
            "identical_outer": len({s["outer_digest"] for s in summaries.values()}) == 1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--sync-every", type=int, default=30)
    ap.add_argument("--fragments", type=int, default=3)
    ap.add_argument("--taus", default="1,5", help="comma-separated overlap delays to test")
    ap.add_argument("--codec", default="int4", choices=CODEC_NAMES)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("runs/bench/overlap"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = []
    for tau in ints(args.taus):
        t0 = time.perf_counter()
        rows.append(run(args, tau, args.out) | {"wall_s": round(time.perf_counter() - t0, 1)})
    print(f"{'tau':>4} {'nodes':>5} {'util min':>9} {'util mean':>9} {'step share':>10} "
          f"{'max wait':>8} {'skipped':>7} {'identical':>9} {'wall':>7}")
    for r in rows:
        print(f"{r['tau']:>4} {r['nodes']:>5} {r['utilization_min'] * 100:>8.1f}% "
              f"{r['utilization_mean'] * 100:>8.1f}% {r['step_share_mean'] * 100:>9.1f}% "
              f"{r['sync_wait_s_max']:>7.2f}s {r['skipped_rounds']:>7} "
              f"{str(r['identical_outer']):>9} {r['wall_s']:>6.0f}s")
    save_rows(args.json, args, rows)


if __name__ == "__main__":
    main()
