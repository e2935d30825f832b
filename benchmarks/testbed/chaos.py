"""Chaos matrix: for each supervised part of a node (DHT process, p2pd, data
listener, state-sync server, status server) a kill -9 and a 30 s stop mid-run, in a swarm of
3 nodes on loopback; and a 2|2 network partition of 30 s on the WAN test bed (4 nodes at
100 Mbit/s), then healed, with the DHT re-merge on and, as a control, off.

Per case: time to heal, rounds lost (rounds not averaged by all nodes, from the injection to
the next case), the other nodes' extra waiting on the network, and the invariant (every node
either ends with exit 0 and the same outer weights as the others that did, or exits non-zero
with a one-line reason). Faults of one kind share a swarm, one at a time: the next is
injected `--gap` seconds after the previous one ended. Needs root (ss -K, iptables, network
namespaces).

    sudo .venv/bin/python -m benchmarks.testbed.chaos --json runs/bench/chaos.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.args import names
from benchmarks.harness.results import save_rows
from dilonode.config import RunConfig, load_config
from testbed.chaos import Fault, run_chaos
from testbed.hosts import Testbed, unavailable_reason

PARTS = ("dht", "p2pd", "data", "state", "status")


def run_config(args: argparse.Namespace, label: str, steps: int, **extra: Any) -> RunConfig:
    return load_config(overrides={
        "run_id": f"chaos-{label}", "seed": 0, "total_steps": steps, "eval_every": 5,
        "device": "cpu", "model": {"preset": args.preset},
        "data": {"seq_len": args.seq_len, "batch_size": args.batch_size, "eval_batches": 1},
        "diloco": {"mode": "streaming", "sync_every": args.sync_every, "num_fragments": 3,
                   "fragment_sync_delay": 1, "fragment_update_alpha": 0.5},
        "network": {"matchmaking_window": 3.0, "matchmaking_timeout": 8.0,
                    "allreduce_timeout": args.timeout, "max_attempts": 3, "peer_ttl": 6.0,
                    **extra.pop("network", {})},
        "supervise": {"check_interval": 1.0, "check_timeout": 3.0, **extra.pop("supervise", {})},
        **extra,
    })


def cases(kind: str, spacing: int, seconds: float) -> list[Fault]:
    """One fault per part, on nodes 0, 1, 2, 0, 1, `spacing` steps apart."""
    return [Fault(i % 3, part, kind, at_step=20 + i * spacing, seconds=seconds)  # type: ignore[arg-type]
            for i, part in enumerate(PARTS)]


def loopback_run(args: argparse.Namespace, kind: str) -> list[dict[str, Any]]:
    spacing = args.kill_spacing if kind == "kill" else args.stop_spacing
    faults = cases(kind, spacing, args.stop_s)
    # steps enough for the last fault to come (they wait for each other) and heal
    cfg = run_config(args, kind, faults[-1].at_step + (3 if kind == "kill" else 2) * spacing)
    res = run_chaos(cfg, 3, faults, args.out / kind, deadline_s=args.deadline,
                    gap_s=args.gap)
    return rows_of(kind, res)


def partition_run(args: argparse.Namespace, remerge: bool) -> list[dict[str, Any]]:
    label = "partition" if remerge else "partition-no-remerge"
    hosts = ["bootstrap", *(f"node-{i}" for i in range(4))]
    cut = Fault(0, "partition", "stop", at_step=args.partition_step, seconds=args.stop_s,
                sides=(("bootstrap", "node-0", "node-1"), ("node-2", "node-3")))
    cfg = run_config(args, label, args.partition_step + args.after_partition,
                     network={"bandwidth_mbps": 100.0}, supervise={"remerge": remerge})
    with Testbed(hosts, rate_mbit=100, rates={"bootstrap": None}) as bed:
        res = run_chaos(cfg, 4, [cut], args.out / label, bed=bed, deadline_s=args.deadline)
    return rows_of(label, res)


def rows_of(run: str, res: Any) -> list[dict[str, Any]]:
    ends = {n: (e.returncode, (e.summary or {}).get("outer_digest", "")[:12])
            for n, e in res.nodes.items()}
    base = {"run": run, "invariant_held": not res.violations(), "violations": res.violations(),
            "exits": {n: rc for n, (rc, _) in ends.items()},
            "identical_outer": len({d for rc, d in ends.values() if rc == 0}) == 1,
            "timeout_s": res.timeout_s, "wall_s": round(res.wall_s, 1)}
    return [{**base, **row} for row in res.per_fault()]


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| run | case | heal | rounds lost | others' extra wait (bound: 1 timeout) | "
           "ran on | exits | one model | invariant |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        heal = "never" if r["heal_s"] is None else f"{r['heal_s']:.1f} s"
        if r.get("dht_merge_s") is not None:
            heal += f" (DHT: {r['dht_merge_s']:.1f} s)"
        wait = r["others_excess_wait_s"]
        out.append(f"| {r['run']} | {r['fault']} | {heal} | {r['rounds_lost']} | "
                   f"{wait:.1f} s ({'ok' if wait <= r['timeout_s'] else 'OVER'}) | "
                   f"{r['ran_on_s']} s | {sorted(r['exits'].values())} | "
                   f"{'yes' if r['identical_outer'] else 'NO'} | "
                   f"{'held' if r['invariant_held'] else 'BROKEN'} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="kill,stop,partition,partition-no-remerge",
                    help="comma-separated: kill, stop, partition, partition-no-remerge")
    ap.add_argument("--stop-s", type=float, default=30.0, help="length of a stop/partition")
    # At about 4 steps/s (tiny model, 3 nodes, 2 shared cores): 15 s and 45 s.
    ap.add_argument("--kill-spacing", type=int, default=60, help="steps between kills (at least)")
    ap.add_argument("--stop-spacing", type=int, default=180, help="steps between stops (at least)")
    ap.add_argument("--gap", type=float, default=10.0,
                    help="seconds from the end of one fault to the next")
    ap.add_argument("--partition-step", type=int, default=60)
    ap.add_argument("--after-partition", type=int, default=300,
                    help="steps after the partition starts")
    ap.add_argument("--timeout", type=float, default=8.0, help="network.allreduce_timeout")
    ap.add_argument("--sync-every", type=int, default=12)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--deadline", type=float, default=900.0, help="seconds per run at most")
    ap.add_argument("--out", type=Path, default=Path("runs/bench/chaos"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if (reason := unavailable_reason(partitions=True)) is not None:
        sys.exit(f"chaos.py: {reason}")
    rows: list[dict[str, Any]] = []
    for run in names(args.runs):
        t0 = time.perf_counter()
        if run in ("kill", "stop"):
            got = loopback_run(args, run)
        else:
            got = partition_run(args, remerge=run == "partition")
        rows += got
        print(json.dumps({"run": run, "seconds": round(time.perf_counter() - t0, 1),
                          "rows": got}, default=str), flush=True)
    print(table(rows))
    save_rows(args.json, args, rows)


if __name__ == "__main__":
    main()
