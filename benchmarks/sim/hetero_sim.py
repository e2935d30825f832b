"""Mixed GPU speeds in the simulator: loss against wall-clock time for 16 workers whose
speeds span 10x, three ways of running them.

* `token-weighted`: rounds paced by the swarm clock (`diloco.pacing = "time"`); every worker
  contributes what it trained, the mean weighted by tokens (what dilonode does);
* `step-locked`: every worker syncs after H of its own steps (`pacing = "steps"`), so every
  round waits for the slowest worker (what a quorum that waits for everyone does);
* `drop-slow`: only the workers at least `--keep-speed` as fast as the fastest take part
  (what a swarm that excludes slow volunteers does).

All three run on the simulator's virtual clock (`sim.speeds`: a worker of speed s needs 1/s
virtual seconds per step; one reference step = 1 virtual second) for the same virtual
time (step-locked: as many steps as its slowest worker makes in that time), with the same
model, data, optimizers and H, P, tau, alpha, codec; the table gives the eval loss of the
outer weights at the end (after the end-of-run round), the virtual time that took, the
tokens trained and the fastest workers' share of time not waiting. Several seeds: mean and
spread.

    python -m benchmarks.sim.hetero_sim --seeds 0,1 --json runs/bench/hetero_sim.json \
        --plot docs/img/hetero_sim.png
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.args import ints
from benchmarks.harness.results import save_rows
from dilonode.algo.codec_table import CODEC_NAMES
from dilonode.config import load_config
from dilonode.sim.training import SimReport, simulate


def speeds(n: int, span: float) -> list[float]:
    """n speeds from 1 down to 1/span, evenly spaced on a log scale."""
    return [span ** (-i / (n - 1)) for i in range(n)] if n > 1 else [1.0]


def configs(args: argparse.Namespace, seed: int) -> dict[str, dict[str, Any]]:
    sp = speeds(args.workers, args.span)
    common = {"seed": seed, "device": "cpu", "eval_every": args.eval_every,
              "model": {"preset": args.preset},
              "data": {"seq_len": args.seq_len, "batch_size": args.batch_size,
                       "eval_batches": 8, "seed": seed},
              "inner": {"lr": args.lr, "warmup_steps": 20},
              "codec": {"name": args.codec}}
    diloco = {"mode": "streaming", "sync_every": args.sync_every,
              "num_fragments": args.fragments, "fragment_sync_delay": args.tau,
              "fragment_update_alpha": args.alpha}
    fast = [s for s in sp if s >= args.keep_speed]
    locked_steps = max(int(args.time * min(sp)), 2 * args.sync_every)
    return {
        "token-weighted": {**common, "total_steps": args.time,
                           "diloco": {**diloco, "pacing": "time"},
                           "sim": {"workers": len(sp), "speeds": sp, "latency": args.latency}},
        "step-locked": {**common, "total_steps": locked_steps,
                        "diloco": {**diloco, "pacing": "steps"},
                        "sim": {"workers": len(sp), "speeds": sp, "latency": args.latency}},
        "drop-slow": {**common, "total_steps": args.time,
                      "diloco": {**diloco, "pacing": "time"},
                      "sim": {"workers": len(fast), "speeds": fast, "latency": args.latency}},
    }


def row(name: str, seed: int, r: SimReport) -> dict[str, Any]:
    fast = [w for w in r.worker_stats if w["steps"] == max(x["steps"] for x in r.worker_stats)]
    return {"method": name, "seed": seed, "workers": r.workers, "virtual_s": r.virtual_s,
            "final_eval_loss": r.final_eval_loss,
            "tokens": r.tokens, "agree": r.workers_agree,
            "fast_utilization": statistics.mean(w["utilization"] for w in fast),
            "rounds_each": [w["rounds"] for w in r.worker_stats],
            "missed": sum(w["missed"] for w in r.worker_stats), "wall_s": r.wall_s,
            "history": [(p.virtual_s, p.eval_loss, p.tokens) for p in r.history]}


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'method':<16} {'workers':>7} {'final loss':>16} {'tokens':>12} "
            f"{'fast util':>9} {'virtual s':>9}")
    out = [head, "-" * len(head)]
    for method in dict.fromkeys(r["method"] for r in rows):
        rs = [r for r in rows if r["method"] == method]
        losses = [r["final_eval_loss"] for r in rs]
        spread = f" ± {statistics.stdev(losses):.3f}" if len(losses) > 1 else ""
        out.append(f"{method:<16} {rs[0]['workers']:>7} "
                   f"{statistics.mean(losses):>9.4f}{spread:>7} "
                   f"{statistics.mean(r['tokens'] for r in rs):>12,.0f} "
                   f"{statistics.mean(r['fast_utilization'] for r in rs):>9.1%} "
                   f"{statistics.mean(r['virtual_s'] for r in rs):>9.0f}")
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for method in dict.fromkeys(r["method"] for r in rows):
        for i, r in enumerate(x for x in rows if x["method"] == method):
            t, loss, _ = zip(*r["history"], strict=True)
            ax.plot(t, loss, label=method if i == 0 else None,
                    color={"token-weighted": "C0", "step-locked": "C1",
                           "drop-slow": "C2"}[method], alpha=0.8)
    ax.set(xlabel="virtual wall-clock (reference steps)", ylabel="eval loss (outer weights)",
           title="16 workers, speeds spanning 10x")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--span", type=float, default=10.0, help="fastest / slowest speed")
    ap.add_argument("--keep-speed", type=float, default=0.5,
                    help="drop-slow keeps workers at least this fast (fastest = 1)")
    ap.add_argument("--time", type=int, default=600, help="virtual seconds (reference steps)")
    ap.add_argument("--sync-every", type=int, default=30)
    ap.add_argument("--fragments", type=int, default=3)
    ap.add_argument("--tau", type=int, default=1)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--codec", default="int4", choices=CODEC_NAMES)
    ap.add_argument("--latency", type=float, default=0.5, help="virtual s per round")
    ap.add_argument("--preset", default="nano")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for seed in ints(args.seeds):
        for name, cfg in configs(args, seed).items():
            t0 = time.perf_counter()
            report = simulate(load_config(overrides=cfg))
            rows.append(row(name, seed, report))
            print(f"seed {seed} {name}: loss {report.final_eval_loss:.4f} at "
                  f"{report.virtual_s:.0f} virtual s, "
                  f"{report.tokens:,} tokens, {time.perf_counter() - t0:.0f} s", flush=True)
            if not report.workers_agree:
                raise SystemExit(f"{name}: workers ended with different outer weights")
    print()
    print(table(rows))
    save_rows(args.json, args, rows)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
