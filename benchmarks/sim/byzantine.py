"""Byzantine benchmark: 4 workers, one of them malicious, plain mean vs robust aggregators.

Runs the real simulator (same Worker, LocalGroup and robust aggregation code as the daemon)
on the built-in corpus. Worker 3 misbehaves through `simulate(..., tamper=...)`, which
rewrites its pseudo-gradient before it is averaged; the algorithm itself is untouched.
Attacks: x100 scaled, sign-flipped, random noise (Gaussian, 10x the contribution's RMS),
NaN. For each aggregator it prints the final eval loss of the outer weights (worker 0) and
its change against the honest run with the same aggregator and against the honest plain
mean.

    python -m benchmarks.sim.byzantine --json runs/bench/byzantine.json
"""

from __future__ import annotations

import argparse
import math
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.harness.args import names
from benchmarks.harness.results import write_json
from dilonode.algo.codec_table import CODEC_NAMES
from dilonode.collective import SyncKey
from dilonode.config import load_config
from dilonode.sim.training import SimReport, Tamper, simulate

MALICIOUS = 3


def _noise(flat: torch.Tensor, key: SyncKey) -> torch.Tensor:
    gen = torch.Generator().manual_seed(hash((key.fragment, key.round)) & 0xFFFF_FFFF)
    rms = float(flat.pow(2).mean().sqrt())
    return torch.randn(flat.shape, generator=gen) * (10 * rms)


ATTACKS: dict[str, Callable[[torch.Tensor, SyncKey], torch.Tensor] | None] = {
    "honest": None,
    "x100": lambda flat, key: flat * 100,
    "sign-flip": lambda flat, key: -flat,
    "noise": _noise,
    "nan": lambda flat, key: torch.full_like(flat, float("nan")),
}

AGGREGATORS: dict[str, dict[str, object]] = {
    "mean": {"name": "mean"},
    "mean+norm<=3x": {"name": "mean", "norm_bound": 3.0},
    "trimmed_mean": {"name": "trimmed_mean", "trim": 1},
    "centered_clip": {"name": "centered_clip", "clip_tau": 1.0, "clip_iters": 3},
}


def tamper_for(attack: str) -> Tamper | None:
    fn = ATTACKS[attack]
    if fn is None:
        return None

    def tamper(worker: int, key: SyncKey, flat: torch.Tensor) -> torch.Tensor:
        return fn(flat, key) if worker == MALICIOUS else flat

    return tamper


def run_one(args: argparse.Namespace, aggregator: str, attack: str) -> SimReport | None:
    """One simulated run; None when training diverged (every contribution NaN/Inf)."""
    cfg = load_config(overrides={
        "seed": 0, "total_steps": args.steps, "eval_every": args.steps, "device": "cpu",
        "model": {"preset": args.preset},
        "data": {"seq_len": args.seq_len, "batch_size": args.batch_size, "eval_batches": 16},
        "inner": {"lr": 3e-3, "warmup_steps": 20},
        "diloco": {"mode": "streaming", "sync_every": args.sync_every, "num_fragments": 3,
                   "fragment_sync_delay": 1, "fragment_update_alpha": 0.5},
        "codec": {"name": args.codec},
        "aggregator": AGGREGATORS[aggregator],
        "sim": {"workers": 4},
    })
    try:
        return simulate(cfg, tamper=tamper_for(attack))
    except ValueError as exc:
        print(f"{aggregator:<15} {attack:<10} diverged: {exc}", flush=True)
        return None


def table(losses: dict[str, dict[str, float]]) -> str:
    base = losses["mean"]["honest"]
    head = f"{'aggregator':<15} {'attack':<10} {'eval loss':>9} {'vs own honest':>13} " \
           f"{'vs honest mean':>14}"
    lines = [head, "-" * len(head)]
    for agg, per_attack in losses.items():
        own = per_attack.get("honest")
        for attack, loss in per_attack.items():
            if not math.isfinite(loss):
                lines.append(f"{agg:<15} {attack:<10} {'diverged':>9} {'-':>13} {'-':>14}")
                continue
            rel_own = f"{(loss / own - 1) * 100:+.2f}%" if own else "-"
            rel_base = f"{(loss / base - 1) * 100:+.2f}%"
            lines.append(f"{agg:<15} {attack:<10} {loss:>9.4f} {rel_own:>13} {rel_base:>14}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150, help="inner steps per worker")
    ap.add_argument("--sync-every", type=int, default=25, help="H")
    ap.add_argument("--preset", default="nano")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--codec", default="int8", choices=CODEC_NAMES)
    ap.add_argument("--aggregators", default=",".join(AGGREGATORS))
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    aggregators = names(args.aggregators)
    attacks = names(args.attacks)
    if "mean" not in aggregators or "honest" not in attacks:
        ap.error("--aggregators must include mean and --attacks honest (the baseline)")
    losses: dict[str, dict[str, float]] = {}
    t0 = time.perf_counter()
    for agg in aggregators:
        for attack in attacks:
            rep = run_one(args, agg, attack)
            losses.setdefault(agg, {})[attack] = rep.final_eval_loss if rep else math.inf
            if rep is None:
                continue
            print(f"{agg:<15} {attack:<10} loss {rep.final_eval_loss:.4f} "
                  f"agree={rep.workers_agree} ({rep.wall_s:.0f}s)", flush=True)
    print(table(losses))
    print(f"total {time.perf_counter() - t0:.0f}s on {platform.machine()} "
          f"torch {torch.__version__}")
    shown = {agg: {a: (x if math.isfinite(x) else None) for a, x in per.items()}
             for agg, per in losses.items()}  # None: diverged
    write_json(args.json, {"args": vars(args), "eval_loss": shown})


if __name__ == "__main__":
    main()
