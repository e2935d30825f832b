"""A real swarm in bounded groups: N `dilonode run` processes on loopback (`LocalSwarm`, one
DHT per node), `network.max_group_size` = G, for `--steps` reference steps of the swarm
clock; optionally the same swarm in one group (`--baseline`).

Reports, per run: whether every node ended with identical outer weights (the summaries'
digests and the saved `outer.pt` files compared bit for bit) and the agreement check's
verdict, group sizes seen in the rounds (from the nodes' traces), rounds per fragment,
skipped and retried rounds, payload bytes sent per node, data-plane connections each node
accepted, compute utilization, the final eval loss and the wall time.

    python -m benchmarks.loopback.groups_swarm --nodes 16 --group 4 --steps 200 \
        --json runs/bench/groups_swarm.json
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.results import save_rows
from dilonode.cli.local_swarm import LocalSwarm
from dilonode.config import load_config


def run_config(args: argparse.Namespace, label: str, group: int) -> Any:
    return load_config(overrides={
        "run_id": f"groups-{label}", "seed": 0, "total_steps": args.steps,
        "eval_every": args.eval_every, "device": "cpu", "model": {"preset": "nano"},
        "data": {"seq_len": args.seq_len, "batch_size": args.batch_size, "eval_batches": 2},
        "diloco": {"mode": "streaming", "sync_every": args.sync_every,
                   "num_fragments": args.fragments, "fragment_sync_delay": 1,
                   "fragment_update_alpha": 0.5, "pacing": "time",
                   "step_seconds": args.step_seconds, "retune_clock": False},
        "codec": {"name": "int4"},
        # Many trainers on few cores drift apart by seconds: a generous window.
        "network": {"matchmaking_window": args.window, "matchmaking_timeout": 3 * args.window,
                    "allreduce_timeout": args.timeout, "max_attempts": 3,
                    "max_group_size": group, "peer_ttl": 20.0},
        "checkpoint": {"every_steps": 0, "on_exit": False},
        "status": {"enabled": False},
        "paths": {"out_dir": str(args.out / label), "trace": True},
    })


def _trace_groups(out: Path, nodes: int) -> dict[int, int]:
    """Group size -> fragment rounds landed in a group of that size (all nodes)."""
    sizes: collections.Counter[int] = collections.Counter()
    for i in range(nodes):
        path = out / f"node-{i}" / "trace.jsonl"
        if path.exists():
            for line in path.read_text().splitlines():
                ev = json.loads(line)
                if ev.get("event") == "land":
                    sizes[int(ev["group"])] += 1
    return dict(sorted(sizes.items()))


def _identical(out: Path, nodes: int) -> bool:
    states = [torch.load(out / f"node-{i}" / "outer.pt") for i in range(nodes)]
    return all(torch.equal(s[k], states[0][k]) for s in states[1:] for k in states[0])


def run(args: argparse.Namespace, label: str, group: int) -> dict[str, Any]:
    cfg = run_config(args, label, group)
    swarm = LocalSwarm(cfg, args.nodes)
    t0 = time.perf_counter()
    try:
        swarm.start()
        summaries = swarm.follow()
    finally:
        swarm.stop()
    wall = time.perf_counter() - t0
    s = [summaries[k] for k in sorted(summaries)]
    out = Path(cfg.paths.out_dir)
    row = {"run": label, "nodes": args.nodes, "max_group_size": group, "steps": args.steps,
           "finished": len(s), "exit_codes": [p.returncode for p in swarm.procs],
           "identical_outer": len({x["outer_digest"] for x in s}) == 1
           and len(s) == args.nodes and _identical(out, args.nodes),
           "agrees": [x["agreement"].get("agrees") for x in s],
           "adopted_at_end": sum(bool(x["agreement"].get("adopted")) for x in s),
           "group_sizes": _trace_groups(out, args.nodes),
           "largest_group": max(x["largest_group"] for x in s),
           "rounds_per_fragment": s[0]["rounds_per_fragment"],
           "skipped": sum(x["skipped_rounds"] for x in s),
           "retried": sum(x["retried_rounds"] for x in s),
           "bytes_sent_mean": statistics.fmean(x["bytes_sent"] for x in s),
           "steps_mean": statistics.fmean(x["steps"] for x in s),
           "utilization_mean": statistics.fmean(x["compute_utilization"] for x in s),
           "final_eval_loss": statistics.fmean(x["final_eval_loss"] for x in s),
           "wall_s": round(wall, 1)}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--sync-every", type=int, default=20)
    ap.add_argument("--fragments", type=int, default=2)
    ap.add_argument("--step-seconds", type=float, default=0.5)
    ap.add_argument("--window", type=float, default=5.0)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--baseline", action="store_true", help="also run one group of all")
    ap.add_argument("--out", type=Path, default=Path("runs/bench/groups_swarm"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = [run(args, "groups", args.group)]
    if args.baseline:
        rows.append(run(args, "one-group", args.nodes))
    print("| run | nodes | max group | group sizes (rounds landed) | identical outer | "
          "agree | skipped | retried | sent per node | utilization | eval loss | wall |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        agree = "all" if all(a is True for a in r["agrees"]) else str(r["agrees"])
        print(f"| {r['run']} | {r['nodes']} | {r['max_group_size']} | {r['group_sizes']} | "
              f"{'yes' if r['identical_outer'] else 'NO'} | {agree} | {r['skipped']} | "
              f"{r['retried']} | {r['bytes_sent_mean'] / 1e6:.2f} MB | "
              f"{r['utilization_mean'] * 100:.1f}% | {r['final_eval_loss']:.4f} | "
              f"{r['wall_s']:.0f} s |")
    save_rows(args.json, args, rows)


if __name__ == "__main__":
    main()
