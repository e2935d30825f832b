"""How long to hold a fragment's result before merging it (tau), in the simulator: the
final loss of Streaming DiLoCo for several merge delays, paced by steps and by the swarm
clock, over several seeds.

The settings are the WAN test bed's (benchmarks/testbed/autotune.py): 4 workers, `small` preset,
seq 64, batch 2, int4, H = 30, P = 3, alpha 0.5, 600 steps. Each method is one config:

* `tau=K` (K in --taus): paced by steps, merged exactly K steps after the round started;
* `timed-tau=1`: paced by the clock, merged as soon as the result is there (what
  `fragment_sync_delay = "auto"` did before it chose a delay), rounds taking --latency
  reference steps;
* `auto`: paced by the clock with `fragment_sync_delay = "auto"` (half of H/P reference
  steps, rounded up, after the round's start, or when the result arrives if later), same latency.

With --speeds the clock-paced methods run workers of those speeds (the test bed's nodes
share 2 cores and step a few percent apart); the step-paced ones stay equal.

Runs go --jobs at a time in separate processes, one torch thread each (the same thread
count for every run: the figures repeat to the bit).

    python -m benchmarks.sim.merge_delay --seeds 0,1,2 --jobs 2 --json runs/bench/merge_delay.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.harness.args import floats, ints, names
from benchmarks.harness.results import save_rows


def config(args: argparse.Namespace, method: str, seed: int) -> dict[str, Any]:
    if method.startswith("tau="):
        diloco: dict[str, Any] = {"pacing": "steps", "fragment_sync_delay": int(method[4:])}
        latency = 0.0
    else:
        tau = "auto" if method == "auto" else int(method.removeprefix("timed-tau="))
        diloco = {"pacing": "time", "fragment_sync_delay": tau, "step_seconds": 1.0}
        latency = args.latency
    return {"seed": seed, "device": "cpu", "total_steps": args.steps,
            "eval_every": args.steps, "model": {"preset": args.preset},
            "data": {"seq_len": args.seq_len, "batch_size": args.batch_size, "seed": seed},
            "diloco": {"mode": "streaming", "sync_every": args.sync_every,
                       "num_fragments": args.fragments, "fragment_update_alpha": 0.5,
                       **diloco},
            "codec": {"name": "int4"},
            "sim": {"workers": args.workers, "latency": latency,
                    "speeds": _speeds(args) if latency else None},
            "status": {"enabled": False}}


def _speeds(args: argparse.Namespace) -> list[float] | None:
    return floats(args.speeds) if args.speeds else None


def one(job: tuple[argparse.Namespace, str, int]) -> dict[str, Any]:
    import torch

    from dilonode.config import load_config
    from dilonode.sim.training import simulate

    args, method, seed = job
    torch.set_num_threads(1)
    cfg = load_config(overrides=config(args, method, seed))
    t0 = time.perf_counter()
    r = simulate(cfg)
    if not r.workers_agree:
        raise SystemExit(f"{method} seed {seed}: workers ended with different outer weights")
    return {"method": method, "seed": seed, "tau": cfg.diloco.effective().fragment_sync_delay,
            "final_eval_loss": r.final_eval_loss, "tokens": r.tokens,
            "utilization": statistics.mean(w["utilization"] for w in r.worker_stats),
            "wall_s": round(time.perf_counter() - t0, 1)}


def table(rows: list[dict[str, Any]]) -> str:
    seeds = sorted({r["seed"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    loss = {(r["method"], r["seed"]): r["final_eval_loss"] for r in rows}
    hand = [m for m in methods if m.startswith("tau=")]
    best = {s: min(loss[m, s] for m in hand) for s in seeds} if hand else None
    head = ("| method | tau | " + " | ".join(f"seed {s}" for s in seeds)
            + " | mean | vs best hand-set tau, mean of seeds |")
    out = [head, "|" + "---|" * (len(seeds) + 4)]
    for m in methods:
        tau = next(r["tau"] for r in rows if r["method"] == m)
        vals = [loss[m, s] for s in seeds]
        rel = (f"{statistics.mean(loss[m, s] / best[s] - 1 for s in seeds) * 100:+.2f}%"
               if best else "-")
        out.append(f"| {m} | {tau} | " + " | ".join(f"{v:.4f}" for v in vals)
                   + f" | {statistics.mean(vals):.4f} | {rel} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--taus", default="1,5,9", help="step-paced merge delays")
    ap.add_argument("--timed", default="timed-tau=1,auto", help="clock-paced methods")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once (processes)")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--sync-every", type=int, default=30)
    ap.add_argument("--fragments", type=int, default=3)
    ap.add_argument("--latency", type=float, default=2.0,
                    help="clock-paced methods: reference steps from a round's last "
                    "contribution to its result")
    ap.add_argument("--speeds", default="",
                    help="clock-paced methods: each worker's speed (1 = one reference step "
                    "per step), comma-separated; empty: all equal")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    methods = [f"tau={t}" for t in names(args.taus)] + names(args.timed)
    jobs = [(args, m, s) for s in ints(args.seeds) for m in methods]
    rows = []
    with ProcessPoolExecutor(args.jobs) as pool:
        for r in pool.map(one, jobs):
            rows.append(r)
            print(f"seed {r['seed']} {r['method']} (tau {r['tau']}): loss "
                  f"{r['final_eval_loss']:.4f}, {r['wall_s']:.0f} s", flush=True)
    print()
    print(table(rows))
    save_rows(args.json, args, rows)


if __name__ == "__main__":
    main()
