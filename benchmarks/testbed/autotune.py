"""The overlap chosen from measured links (`fragment_sync_delay = "auto"`, the swarm clock
retuned by its pacemaker) against hand-tuned tau, on the WAN test bed.

4 nodes at each link rate run Streaming DiLoCo (int4) three ways in turn:

* `auto`: the default config with `fragment_sync_delay = "auto"` (paced by the swarm
  clock: a result merges half of H/P reference steps, rounded up, after its round
  started, or when it arrives if later, and the clock slows if rounds take more than
  half a round period on any node);
* `tau=5`, `tau=8`: paced by steps with a hand-set overlap (what docs/operations.md told
  users to size by hand: tau x step time > round latency);
* `timed-tau=K` (only when named in --runs, K = 1, 8 or 9): paced by the clock, merging
  no earlier than K reference steps after a round started (K = 1: as soon as the result
  is there, what `auto` did before it chose a delay; K = 9: H/P - 1 at H = 30, P = 3, what
  it chose before half the gap).

Plus `auto+slow-joiner`: the auto run with a fifth node on a 10 Mbit/s link joining
mid-run. Per run: compute utilization (share of wall time not blocked on the network;
mean and worst node), round latency, rounds per fragment, the clock's retunings, final
eval loss (the nodes' own, on 1,024 tokens, and node-0's saved outer weights on the whole
eval split, `reeval.py`, which "vs best hand-tuned" compares) and agreement. Needs root
(network namespaces).

    sudo .venv/bin/python -m benchmarks.testbed.autotune --rates 100,20 --steps 600 \
        --json runs/bench/autotune.json
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.args import floats, names
from benchmarks.harness.options import add_tcp_congestion, tcp_congestion
from benchmarks.harness.results import save_rows
from benchmarks.testbed.reeval import eval_run
from dilonode.config import load_config
from testbed.hosts import swarm_on_testbed, unavailable_reason

VARIANTS = {
    "auto": {"pacing": "time", "fragment_sync_delay": "auto"},
    "tau=5": {"pacing": "steps", "fragment_sync_delay": 5},
    "tau=8": {"pacing": "steps", "fragment_sync_delay": 8},
    "auto+slow-joiner": {"pacing": "time", "fragment_sync_delay": "auto"},
    # Paced by the clock as auto, but a result merges no earlier than 8 steps after its
    # round started: separates the merge delay from the pacing.
    "timed-tau=8": {"pacing": "time", "fragment_sync_delay": 8},
    "timed-tau=1": {"pacing": "time", "fragment_sync_delay": 1},
    "timed-tau=9": {"pacing": "time", "fragment_sync_delay": 9},
}


def run_config(args: argparse.Namespace, name: str, rate: float, out: Path) -> Any:
    return load_config(overrides={
        "run_id": f"auto-{rate:g}-{name.replace('=', '').replace('+', '-')}", "seed": args.seed,
        # Progress events come at evaluations: the slow joiner starts on them.
        "total_steps": args.steps, "eval_every": args.eval_every, "device": "cpu",
        "model": {"preset": args.preset},
        "data": {"seq_len": args.seq_len, "batch_size": args.batch_size},
        "diloco": {"mode": "streaming", "sync_every": args.sync_every,
                   "num_fragments": args.fragments, "fragment_update_alpha": 0.5,
                   **VARIANTS[name]},
        "codec": {"name": "int4"},
        "network": {"matchmaking_window": 20.0, "matchmaking_timeout": 45.0,
                    "allreduce_timeout": 60.0, "bandwidth_mbps": rate, "peer_ttl": 60.0,
                    **tcp_congestion(args)},
        "status": {"enabled": False},
        "paths": {"out_dir": str(out)},
    })


def run(args: argparse.Namespace, name: str, rate: float) -> dict[str, Any]:
    out = args.out / f"{name}-{rate:g}"
    cfg = run_config(args, name, rate, out)
    joiner = name.endswith("slow-joiner")
    t0 = time.perf_counter()
    with swarm_on_testbed(cfg, args.nodes, rate, hosts=args.nodes + joiner) as (bed, swarm):
        if joiner:
            bed.set_rate(f"node-{args.nodes}", args.joiner_rate)
        swarm.start()
        if joiner:
            _join_midway(swarm, args)
        training: dict[str, float] = {}  # utilization at the last progress event

        def on_event(node: str, ev: dict[str, Any]) -> None:
            if ev.get("event") == "progress":
                training[node] = ev["utilization"]

        summaries = swarm.follow(on_event)
    wall = time.perf_counter() - t0
    # The swarm's figures are the initial nodes'; the joiner's own are reported apart.
    nodes = [summaries[f"node-{i}"] for i in range(args.nodes) if f"node-{i}" in summaries]
    retunes = sum(_retunes(out / n) for n in summaries)
    row = summarize(name, rate, nodes, retunes) | {"wall_s": round(wall, 1)}
    # The nodes evaluate 1,024 tokens; the final weights on the whole eval split tell two
    # runs apart more surely (benchmarks/testbed/reeval.py).
    row["final_loss_split"] = eval_run(out) if (out / "node-0" / "outer.pt").exists() else None
    # Before the end-of-run rounds of every fragment, which a short
    # benchmark run weighs far more than a real one.
    during = [training[f"node-{i}"] for i in range(args.nodes) if f"node-{i}" in training]
    row["utilization_training"] = statistics.mean(during) if during else None
    if joiner:  # did it get the state in time and take part, or say why not
        mine = summaries.get(f"node-{args.nodes}")
        row["joiner"] = ({"finished": True, "steps": mine["steps"],
                          "rounds": mine["rounds_per_fragment"],
                          "utilization": mine["compute_utilization"],
                          "same_outer": mine["outer_digest"] == nodes[0]["outer_digest"]}
                         if mine else
                         {"finished": False, "why": _last_error(out / f"node-{args.nodes}")})
    return row


def _last_error(node_dir: Path) -> str:
    log = node_dir / "stderr.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return next((ln for ln in reversed(lines) if ln.startswith("dilonode:")), "no summary")


def _join_midway(swarm: Any, args: argparse.Namespace) -> None:
    """Start the slow node once the swarm's clock has passed a third of the run; the other
    events read meanwhile go back for `follow()`."""
    deadline = time.monotonic() + 600
    seen = []
    try:
        while True:
            name, ev = swarm.events.get(timeout=max(deadline - time.monotonic(), 0.1))
            if ev.get("event") == "progress" and ev.get("progress", 0) >= args.steps // 3:
                break
            seen.append((name, ev))
    except queue.Empty:
        raise SystemExit("autotune: the swarm sent no progress past a third of the run "
                         "within 600 s") from None
    finally:
        for item in seen:
            swarm.events.put(item)
    swarm.n += 1  # follow() waits for it too
    swarm.start_node(args.nodes, ["--set", "network.min_peers=1"])


def _retunes(node_dir: Path) -> int:
    log = node_dir / "stderr.log"
    return sum("swarm clock: one reference step" in line for line in log.read_text()
               .splitlines()) if log.exists() else 0


def summarize(name: str, rate: float, nodes: list[dict[str, Any]],
              retunes: int) -> dict[str, Any]:
    utils = [s["compute_utilization"] for s in nodes]
    lat = [v["mean"] for s in nodes for v in s["round_latency_s"].values()]
    return {"run": name, "rate_mbit": rate, "nodes": len(nodes),
            "utilization_mean": statistics.mean(utils), "utilization_min": min(utils),
            "latency_mean_s": statistics.mean(lat) if lat else None,
            "rounds": nodes[0]["rounds_per_fragment"], "clock_retunes": retunes,
            "late_rounds": sum(s.get("late_rounds", 0) for s in nodes),
            "final_eval_loss": statistics.mean(s["final_eval_loss"] for s in nodes),
            # Paced by the clock a node trains the steps it fits in the run's reference
            # steps: compare losses knowing the tokens behind them.
            "steps_mean": statistics.mean(s["steps"] for s in nodes),
            "tokens_mean": statistics.mean(s["tokens"] for s in nodes),
            # Each node's time blocked on results, nearly all of it at the end of the run.
            "sync_wait_s": sorted(s["sync_wait_s"] for s in nodes),
            "identical_outer": len({s["outer_digest"] for s in nodes}) == 1}


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| link | run | utilization mean (min) | while training | round latency | "
            "late rounds | clock retunes | steps per node | final eval loss (nodes) | "
            "loss, whole eval split | vs best hand-tuned | agree | wall |")
    out = [head, "|" + "---|" * 13]
    for r in rows:
        same_rate = [x for x in rows if x["rate_mbit"] == r["rate_mbit"]]
        # One metric for every run compared: the whole split if each has it.
        key = ("final_loss_split" if all(x.get("final_loss_split") for x in same_rate)
               else "final_eval_loss")
        hand = [x[key] for x in same_rate if x["run"].startswith("tau")]
        rel = f"{(r[key] / min(hand) - 1) * 100:+.2f}%" if hand else "-"
        split = f"{r['final_loss_split']:.4f}" if r.get("final_loss_split") else "-"
        out.append(f"| {r['rate_mbit']:g} Mbit/s | {r['run']} | {r['utilization_mean']:.1%} "
                   f"({r['utilization_min']:.1%}) | {r['utilization_training'] or 0:.1%} "
                   f"| {r['latency_mean_s'] or 0:.2f} s "
                   f"| {r['late_rounds']} | {r['clock_retunes']} | {r['steps_mean']:.0f} "
                   f"| {r['final_eval_loss']:.4f} | {split} | {rel} "
                   f"| {'yes' if r['identical_outer'] else 'NO'} | {r['wall_s']:.0f} s |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="100,20")
    ap.add_argument("--runs", default="auto,tau=5,tau=8,auto+slow-joiner")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0, help="model init and data order")
    ap.add_argument("--joiner-rate", type=float, default=10.0)
    ap.add_argument("--steps", type=int, default=270)
    ap.add_argument("--sync-every", type=int, default=30)
    ap.add_argument("--fragments", type=int, default=3)
    ap.add_argument("--preset", default="small")  # as benchmarks/testbed/wan.py: network-bound
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=30, help="also the progress events' "
                    "interval, on which the slow joiner starts")
    add_tcp_congestion(ap)
    ap.add_argument("--out", type=Path, default=Path("runs/bench/autotune"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if (reason := unavailable_reason()) is not None:
        sys.exit(f"autotune.py: {reason}")
    rows = []
    for rate in floats(args.rates):
        for name in names(args.runs):
            if name == "auto+slow-joiner" and rate != max(floats(args.rates)):
                continue  # the joiner case once, at the fastest rate
            rows.append(run(args, name, rate))
            print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    for r in rows:
        if "joiner" in r:
            print(f"joiner on {args.joiner_rate:g} Mbit/s, swarm on {r['rate_mbit']:g} Mbit/s: "
                  f"{json.dumps(r['joiner'])}")
    save_rows(args.json, args, rows)


if __name__ == "__main__":
    main()
