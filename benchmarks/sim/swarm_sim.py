"""Bounded groups at scale: a swarm of up to 1,000 nodes in one process
(`dilonode/sim/swarm_scale.py`:
the grouping rule, real `AllReduceRound`s over the in-memory network, state mixing, churn).

Scenarios (each with every seed in `--seeds`):

* `mixing`: no churn, no training, replicas start far apart (`init_spread` 1: each is as
  far from the mean as the mean is from zero); the spread after each of ceil(log2 N)
  rounds. Target: within 1% of the mean after log2(N) rounds.
* `training`: no churn, synthetic pseudo-gradients (a direction shared by the round plus
  per-node noise of the same size), replicas start equal; the spread they drift to with
  states mixed every round, every 4th round, and never.
* `churn`: 5% of the nodes leave and 5% join per simulated minute (30 s round periods),
  training as above; round latency against two timeouts, spread, bytes.
* `scale`: 64, 250 and 1,000 nodes: bytes, data-plane peers and DHT registrations read
  per node and round. Target: independent of the swarm size. `one-group`: 64 nodes in one
  group (no bound), for reference. `payload`: 64 nodes, 65,536 values, mixing every round
  against never: what a state round costs once frame headers do not count.

    python -m benchmarks.sim.swarm_sim --seeds 0,1,2 --json runs/bench/swarm_sim.json
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.args import ints, names
from benchmarks.harness.results import save_rows
from dilonode.sim.swarm_scale import SwarmSimConfig, run_swarm, summarize


def _row(scenario: str, cfg: SwarmSimConfig, seed: int, wall: float,
         stats: list[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"scenario": scenario, "seed": seed, "nodes": cfg.nodes,
                           "max_group_size": cfg.max_group_size, "mix_every": cfg.mix_every,
                           "churn_per_min": cfg.churn_per_min, "numel": cfg.numel,
                           "update_scale": cfg.update_scale, "wall_s": round(wall, 1)}
    out.update(summarize(stats))
    out["spread_by_round"] = [s.spread_max for s in stats]
    out["latency_max_by_round"] = [s.latency_max for s in stats]
    out["rounds_to_1pct"] = next((s.round + 1 for s in stats if s.spread_max < 0.01), None)
    return out


def _run(scenario: str, cfg: SwarmSimConfig, seed: int) -> dict[str, Any]:
    cfg = dataclasses.replace(cfg, seed=seed)
    t0 = time.perf_counter()
    stats = run_swarm(cfg)
    row = _row(scenario, cfg, seed, time.perf_counter() - t0, stats)
    print(f"{scenario:9s} seed {seed} N={cfg.nodes} mix/{cfg.mix_every}: spread "
          f"{row['spread_max_last']:.2e}, bytes/node {row['bytes_per_node_mean']:.0f}, "
          f"peers<= {row['peers_per_node_max']}, reads {row['reads_per_node_mean']:.1f}, "
          f"latency p50 {row['latency_p50']:.2f}s max {row['latency_max']:.1f}s, "
          f"failed {row['failed_attempts']}, {row['wall_s']:.0f}s", flush=True)
    return row


def scenarios(args: argparse.Namespace) -> list[tuple[str, SwarmSimConfig]]:
    base = SwarmSimConfig(nodes=args.nodes, max_group_size=args.max_group_size,
                          numel=args.numel, update_scale=args.update_scale,
                          timeout_s=args.timeout)
    n = args.nodes
    out = [("mixing", dataclasses.replace(base, rounds=math.ceil(math.log2(n)),
                                          init_spread=1.0, update_scale=0.0))]
    for every in (1, 4, 0):
        out.append(("training", dataclasses.replace(base, nodes=args.training_nodes,
                                                    rounds=args.rounds, mix_every=every)))
    out.append(("churn", dataclasses.replace(base, rounds=args.rounds, churn_per_min=0.05)))
    for size in (64, 250):
        out.append(("scale", dataclasses.replace(base, nodes=size, rounds=4)))
    # References: one group of 64 (no bound), and the payload of a mixing round against a
    # pseudo-gradient round on a vector large enough for frame headers not to count.
    out.append(("one-group", dataclasses.replace(base, nodes=64, max_group_size=64,
                                                 rounds=4)))
    for every in (1, 0):
        out.append(("payload", dataclasses.replace(base, nodes=64, rounds=2, numel=65536,
                                                   mix_every=every)))
    return [(name, cfg) for name, cfg in out if name in args.only]


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one line per scenario and size (means over seeds; worst where it says)."""
    keys: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        keys.setdefault((r["scenario"], r["nodes"], r["mix_every"], r["max_group_size"],
                         r["numel"]), []).append(r)
    lines = ["| scenario | nodes | max group | values | mix every | seeds | "
             "spread after last round (worst) | rounds to 1% | bytes/node/round | "
             "peers/node (max) | reads/node | latency p50 / max (s) | failed attempts |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (name, nodes, every, group, numel), rs in keys.items():
        to1 = [r["rounds_to_1pct"] for r in rs]
        lines.append(
            f"| {name} | {nodes} | {group} | {numel} | {every or 'never'} | {len(rs)} | "
            f"{max(r['spread_max_last'] for r in rs):.2e} | "
            f"{max(to1) if None not in to1 else '-'} | "
            f"{statistics.fmean(r['bytes_per_node_mean'] for r in rs):,.0f} | "
            f"{max(r['peers_per_node_max'] for r in rs)} | "
            f"{statistics.fmean(r['reads_per_node_mean'] for r in rs):.1f} | "
            f"{statistics.median(r['latency_p50'] for r in rs):.2f} / "
            f"{max(r['latency_max'] for r in rs):.1f} | "
            f"{sum(r['failed_attempts'] for r in rs)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--training-nodes", type=int, default=250,
                    help="swarm size of the mix-every comparison")
    ap.add_argument("--max-group-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--numel", type=int, default=1024)
    ap.add_argument("--update-scale", type=float, default=1e-3)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--only", default="mixing,training,churn,scale,one-group,payload")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.only = set(names(args.only))
    rows = [_run(name, cfg, seed) for name, cfg in scenarios(args)
            for seed in ints(args.seeds)]
    print(table(rows))
    save_rows(args.json, args, rows)


if __name__ == "__main__":
    main()
