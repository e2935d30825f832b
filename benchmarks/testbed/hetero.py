"""Heterogeneous volunteers on the WAN test bed: 4 real nodes at 100 Mbit/s whose steps cost
1x, 1x, 2x and 4x (batch sizes b, b, 2b, 4b), run the way dilonode runs them (rounds on the
swarm clock, token-weighted means), against:

* `step-locked`: the same 4 nodes syncing after H own steps each (`diloco.pacing = "steps"`,
  how a swarm that counts steps runs them);
* `2-fast`: the 2 fast nodes alone;
* `4-fast`: 4 fast nodes.

Per node: the share of the run's rounds it averaged with peers, compute utilization
(share of wall time not blocked on the network), steps and tokens; per run: eval loss of
the outer weights against wall-clock time (each node's progress events, timestamped when
they arrive), the final eval loss, and whether every node ended with identical outer
weights (also over `--repeats` runs of the mixed swarm). Needs root (network namespaces).

    sudo .venv/bin/python -m benchmarks.testbed.hetero --repeats 10 --json runs/bench/hetero.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.args import names
from benchmarks.harness.results import save_rows
from dilonode.config import load_config
from testbed.hosts import swarm_on_testbed, unavailable_reason

# name -> (per-node batch multipliers, pacing)
VARIANTS = {
    "mixed": ((1, 1, 2, 4), "time"),
    "step-locked": ((1, 1, 2, 4), "steps"),
    "2-fast": ((1, 1), "time"),
    "4-fast": ((1, 1, 1, 1), "time"),
}


def run_config(args: argparse.Namespace, name: str, out: Path, pacing: str, steps: int) -> Any:
    return load_config(overrides={
        "run_id": f"hetero-{name}", "seed": 0, "total_steps": steps,
        "eval_every": args.eval_every, "device": "cpu",
        "model": {"preset": args.preset},
        "data": {"seq_len": args.seq_len, "batch_size": args.batch_size, "eval_batches": 4},
        "diloco": {"mode": "streaming", "sync_every": args.sync_every,
                   "num_fragments": args.fragments, "fragment_sync_delay": args.tau,
                   "fragment_update_alpha": 0.5, "pacing": pacing,
                   "step_seconds": args.step_seconds},
        "codec": {"name": "int4"},
        # The window covers nodes that drift apart on 2 shared cores (see wan.py).
        "network": {"matchmaking_window": 20.0, "matchmaking_timeout": 45.0,
                    "allreduce_timeout": 60.0, "bandwidth_mbps": args.rate,
                    "peer_ttl": 60.0},
        "status": {"enabled": False},
        "paths": {"out_dir": str(out)},
    })


def run(args: argparse.Namespace, name: str, repeat: int = 0) -> dict[str, Any]:
    mults, pacing = VARIANTS[name]
    # Paced by steps, every node runs as many steps as the slowest makes in the same time.
    steps = args.steps if pacing == "time" else args.steps // max(mults)
    out = args.out / f"{name}-{repeat}"
    cfg = run_config(args, name, out, pacing, steps)
    curve: list[tuple[float, str, float]] = []
    t0 = time.monotonic()

    def on_event(node: str, ev: dict[str, Any]) -> None:
        if ev.get("event") == "progress" and ev.get("eval_loss") is not None:
            curve.append((round(time.monotonic() - t0, 2), node, ev["eval_loss"]))

    extra = {i: ["--set", f"data.batch_size={args.batch_size * m}"]
             for i, m in enumerate(mults) if m != 1}
    with swarm_on_testbed(cfg, len(mults), args.rate) as (_bed, swarm):
        swarm.start_bootstrap()
        t0 = time.monotonic()
        swarm.start_nodes(extra)
        summaries = swarm.follow(on_event)
        codes = [p.returncode for p in swarm.procs]
    if len(summaries) != len(mults):
        raise RuntimeError(f"{name}: only {sorted(summaries)} finished (logs in {out})")
    return summarize(name, repeat, mults, [summaries[f"node-{i}"] for i in range(len(mults))],
                     codes, curve)


def summarize(name: str, repeat: int, mults: tuple[int, ...], nodes: list[dict[str, Any]],
              codes: list[int], curve: list[tuple[float, str, float]]) -> dict[str, Any]:
    total_rounds = max(sum(s["rounds_per_fragment"].values()) for s in nodes)
    per_node = [{"cost": m, "steps": s["steps"], "tokens": s["tokens"],
                 "rounds_share": s["rounds_with_peers"] / max(total_rounds, 1),
                 "utilization": s["compute_utilization"], "late": s["late_rounds"],
                 "missed": s["missed_rounds"], "diverged": s["diverged_rounds"],
                 "wall_s": s["wall_s"], "exit": c,
                 "agrees": (s.get("agreement") or {}).get("agrees")}
                for m, s, c in zip(mults, nodes, codes, strict=True)]
    fast = [n for n in per_node if n["cost"] == 1]
    return {"run": name, "repeat": repeat, "nodes": per_node, "rounds": total_rounds,
            "min_rounds_share": min(n["rounds_share"] for n in per_node),
            "fast_utilization_min": min(n["utilization"] for n in fast),
            "tokens": sum(n["tokens"] for n in per_node),
            "wall_s": max(n["wall_s"] for n in per_node),
            "final_eval_loss": statistics.mean(s["final_eval_loss"] for s in nodes),
            "identical_outer": len({s["outer_digest"] for s in nodes}) == 1,
            "exit_codes": codes, "curve": curve}


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| run | node costs | rounds | min share of rounds | fast utilization (min) "
            "| tokens | wall s | final eval loss | identical |")
    out = [head, "|" + "---|" * 9]
    for r in rows:
        out.append(f"| {r['run']} #{r['repeat']} | {','.join(str(n['cost']) for n in r['nodes'])}"
                   f" | {r['rounds']} | {r['min_rounds_share']:.0%} "
                   f"| {r['fast_utilization_min']:.1%} | {r['tokens']:,} | {r['wall_s']:.0f} "
                   f"| {r['final_eval_loss']:.4f} | {'yes' if r['identical_outer'] else 'NO'} |")
    mixed = [r for r in rows if r["run"] == "mixed"]
    if mixed:
        same = sum(r["identical_outer"] and set(r["exit_codes"]) == {0} for r in mixed)
        out.append(f"\nmixed swarm: identical final weights and exit 0 in {same} of "
                   f"{len(mixed)} runs")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=",".join(VARIANTS), help=f"of {','.join(VARIANTS)}")
    ap.add_argument("--repeats", type=int, default=1, help="runs of the mixed swarm")
    ap.add_argument("--rate", type=float, default=100.0, help="Mbit/s per node host")
    ap.add_argument("--steps", type=int, default=300, help="reference steps (time pacing)")
    ap.add_argument("--step-seconds", type=float, default=0.4,
                    help="seconds of one reference step (about a fast node's step)")
    ap.add_argument("--sync-every", type=int, default=30)
    ap.add_argument("--fragments", type=int, default=3)
    ap.add_argument("--tau", type=int, default=2)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4, help="b, the fast nodes' batch")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("runs/bench/hetero"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if (reason := unavailable_reason()) is not None:
        sys.exit(f"hetero.py: {reason}")
    rows = []
    for name in names(args.runs):
        for repeat in range(args.repeats if name == "mixed" else 1):
            rows.append(run(args, name, repeat))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "curve"}), flush=True)
    print(table(rows))
    save_rows(args.json, args, rows)


if __name__ == "__main__":
    main()
