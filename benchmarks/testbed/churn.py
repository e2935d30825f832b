"""Churn benchmark: 4 nodes on the WAN test bed; every K seconds one is SIGKILLed and a new
one joins (recovering the state from its peers), for several minutes; against the same run
without churn. Reports rounds completed, stalls, bytes and the final eval loss. Needs root.

    sudo .venv/bin/python -m benchmarks.testbed.churn --period 30 --json runs/bench/churn.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.results import save_rows
from dilonode.config import load_config
from testbed.churn import ChurnPlan, ChurnResult, run_churn
from testbed.hosts import unavailable_reason


def run_config(args: argparse.Namespace, label: str) -> Any:
    return load_config(overrides={
        "run_id": f"churn-{label}", "seed": 0, "total_steps": args.steps,
        "eval_every": args.progress_every, "device": "cpu",
        "model": {"preset": args.preset},
        "data": {"seq_len": args.seq_len, "batch_size": args.batch_size, "eval_batches": 2},
        "diloco": {"mode": "streaming", "sync_every": args.sync_every, "num_fragments": 3,
                   "fragment_sync_delay": 1, "fragment_update_alpha": 0.5},
        "codec": {"name": "int4"},
        # As in tests/integration/test_churn.py: short-lived records so a dead peer stops
        # being expected soon, a window that outlasts the drift of 4 trainers on 2 cores.
        "network": {"matchmaking_window": 8.0, "matchmaking_timeout": 20.0,
                    "allreduce_timeout": args.timeout, "max_attempts": 3, "peer_ttl": 8.0,
                    "bandwidth_mbps": args.rate},
        "status": {"enabled": False},
        "paths": {"out_dir": str(args.out / label)},
    })


def summarize(label: str, res: ChurnResult, wall: float) -> dict[str, Any]:
    surv = res.survivors()
    joiners = [res.nodes[k[2]] for k in res.kills]
    recovered = [j.recovered for j in joiners if j.recovered]
    top = max(surv.values(), key=lambda s: sum(s["rounds_per_fragment"].values()))
    return {
        "run": label, "kills": len(res.kills), "survivors": len(surv),
        "steps": top["steps"], "rounds_per_fragment": top["rounds_per_fragment"],
        "identical_outer": len({s["outer_digest"] for s in surv.values()}) == 1,
        "final_eval_loss": statistics.mean(s["final_eval_loss"] for s in surv.values()),
        "max_step_gap_s": res.max_step_gap_s(),
        "fragment_gap_s": res.fragment_gaps_s(),
        "periods_without_advance": sum(any(n == 0 for n in p.values())
                                       for p in res.advances_per_period()),
        "skipped_rounds": sum(s["skipped_rounds"] for s in surv.values()),
        "bytes_sent_survivors_mean": statistics.mean(s["bytes_sent"] for s in surv.values()),
        "bytes_sent_all_nodes": sum(t.bytes_sent for t in res.nodes.values()),
        "joiners_recovered": f"{len(recovered)}/{len(joiners)}",
        "recovery_s": [round(r["seconds"], 2) for r in recovered],
        "recovery_bytes": [r["bytes"] for r in recovered],
        "wall_s": round(wall, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--period", type=float, default=30.0, help="K: seconds between kills")
    ap.add_argument("--cycles", type=int, default=6, help="kill/join pairs at most")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--last-kill-frac", type=float, default=0.75,
                    help="no kill after this share of the steps (joiners need time to count)")
    ap.add_argument("--rate", type=float, default=50.0, help="Mbit/s per host")
    ap.add_argument("--timeout", type=float, default=10.0, help="network.allreduce_timeout")
    ap.add_argument("--sync-every", type=int, default=30)
    ap.add_argument("--progress-every", type=int, default=5, help="eval/progress interval")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--no-baseline", action="store_true", help="skip the run without churn")
    ap.add_argument("--out", type=Path, default=Path("runs/bench/churn"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if (reason := unavailable_reason()) is not None:
        sys.exit(f"churn.py: {reason}")
    runs = [("churn", args.cycles)] + ([] if args.no_baseline else [("no-churn", 0)])
    rows = []
    for label, cycles in runs:
        plan = ChurnPlan(nodes=4, period_s=args.period, cycles=cycles,
                         last_kill_step=int(args.steps * args.last_kill_frac),
                         deadline_s=3600)
        t0 = time.perf_counter()
        res = run_churn(run_config(args, label), plan, args.rate)
        rows.append(summarize(label, res, time.perf_counter() - t0))
        print(json.dumps(rows[-1]), flush=True)
    print("| run | kills | joiners recovered | rounds per fragment (longest-lived survivor, "
          "since it started) | skipped | longest step "
          "stall | longest fragment gap | agree | final eval loss | sent per survivor | wall |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        gaps = ", ".join(f"{k}: {v:.1f}" for k, v in r["fragment_gap_s"].items())
        print(f"| {r['run']} | {r['kills']} | {r['joiners_recovered']} "
              f"| {r['rounds_per_fragment']} | {r['skipped_rounds']} "
              f"| {r['max_step_gap_s']:.1f} s | {gaps} s "
              f"| {'yes' if r['identical_outer'] else 'NO'} | {r['final_eval_loss']:.4f} "
              f"| {r['bytes_sent_survivors_mean'] / 1e6:.2f} MB | {r['wall_s']:.0f} s |")
    save_rows(args.json, args, rows)


if __name__ == "__main__":
    main()
