"""The quality cost of bounded groups, in the simulator: 64 workers averaging in groups of 8
(`network.max_group_size = 8`, groups rotate every round) against one group of 64, at equal
tokens (same steps, same data, same H, P, tau, alpha, codec).

Variants: one group (today's behaviour); groups of 8 mixing outer states every round
(the default), every 4th round, and never (pseudo-gradients only: what averaging in
separate groups does without state mixing). The table gives the eval loss of the outer
weights at the end (after the end-of-run mixing rounds and adoption: the model the run
ends with), the loss halfway, bytes per worker, and the replicas' spread (max relative L2
distance of a worker's outer weights from the workers' mean) before the end-of-run
adoption and at its largest during the run.

    python -m benchmarks.sim.groups_quality --seeds 0 --json runs/bench/groups_quality.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.args import ints, names
from benchmarks.harness.results import save_rows
from dilonode.algo.codec_table import CODEC_NAMES
from dilonode.algo.mixing import spread
from dilonode.config import load_config
from dilonode.sim.training import simulate

# name -> network settings over the groups' (None: one group of every worker).
VARIANTS: dict[str, dict[str, Any] | None] = {
    "one-group": None, "mix-every-round": {"mix_state_every": 1},
    "mix-every-4th": {"mix_state_every": 4}, "never-mix": {"mix_state_every": 0}}


def config(args: argparse.Namespace, seed: int, net: dict[str, Any] | None):
    network = ({"max_group_size": args.workers} if net is None else
               {"max_group_size": args.group, **net})
    return load_config(overrides={
        "run_id": "groups-quality", "seed": seed, "device": "cpu",
        "total_steps": args.steps, "eval_every": args.eval_every,
        "model": {"preset": args.preset},
        "data": {"seq_len": args.seq_len, "batch_size": args.batch_size, "eval_batches": 8,
                 "seed": seed},
        "inner": {"lr": args.lr, "warmup_steps": 20},
        "diloco": {"mode": "streaming", "sync_every": args.sync_every,
                   "num_fragments": args.fragments, "fragment_sync_delay": 1,
                   "fragment_update_alpha": 0.5, "pacing": "steps"},
        "codec": {"name": args.codec},
        "network": {"final_mix_rounds": args.final_mix, **network},
        "sim": {"workers": args.workers}})


def run(args: argparse.Namespace, name: str, seed: int) -> dict[str, Any]:
    cfg = config(args, seed, VARIANTS[name])
    worst: list[float] = []

    def on_step(step: int, workers: list) -> None:
        if step % args.sync_every == 0 and step < args.steps:
            worst.append(spread([w.outer_flat() for w in workers])[0])

    t0 = time.perf_counter()
    rep = simulate(cfg, on_step=on_step)
    half = min(rep.history, key=lambda p: abs(p.step - args.steps // 2))
    row = {"variant": name, "seed": seed, "workers": args.workers, "steps": args.steps,
           "tokens": rep.tokens, "final_eval_loss": rep.final_eval_loss,
           "half_eval_loss": half.eval_loss, "bytes_per_worker": rep.bytes_sent_per_worker,
           "spread_end": rep.replica_spread, "spread_max_run": max(worst, default=0.0),
           "agree": rep.workers_agree, "wall_s": round(time.perf_counter() - t0, 1),
           "history": [(p.tokens, p.eval_loss) for p in rep.history]}
    print(f"{name:16s} seed {seed}: loss {row['final_eval_loss']:.4f} (half "
          f"{row['half_eval_loss']:.4f}), bytes/worker {row['bytes_per_worker']:.3g}, "
          f"spread end {row['spread_end']:.2e} max {row['spread_max_run']:.2e}, "
          f"{row['wall_s']:.0f}s", flush=True)
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| variant | seeds | eval loss at the end | eval loss halfway | bytes/worker | "
             "spread before adoption | largest spread in the run |",
             "|---|---|---|---|---|---|---|"]
    for name in VARIANTS:
        rs = [r for r in rows if r["variant"] == name]
        if not rs:
            continue
        loss = [r["final_eval_loss"] for r in rs]
        sd = f" ± {statistics.stdev(loss):.4f}" if len(loss) > 1 else ""
        lines.append(f"| {name} | {len(rs)} | {statistics.fmean(loss):.4f}{sd} | "
                     f"{statistics.fmean(r['half_eval_loss'] for r in rs):.4f} | "
                     f"{statistics.fmean(r['bytes_per_worker'] for r in rs):.3g} | "
                     f"{max(r['spread_end'] for r in rs):.2e} | "
                     f"{max(r['spread_max_run'] for r in rs):.2e} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--sync-every", type=int, default=30)
    ap.add_argument("--fragments", type=int, default=3)
    ap.add_argument("--final-mix", type=int, default=3)
    ap.add_argument("--eval-every", type=int, default=60)
    ap.add_argument("--preset", default="nano")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--codec", default="int4", choices=CODEC_NAMES)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = [run(args, name, seed) for seed in ints(args.seeds)
            for name in names(args.variants)]
    print(table(rows))
    save_rows(args.json, args, rows)


if __name__ == "__main__":
    main()
