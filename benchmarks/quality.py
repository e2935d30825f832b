"""Quality benchmark: DDP vs DiLoCo (fp32) vs Streaming DiLoCo (quantized) at equal tokens.

Runs the real simulator (same Worker and algorithm code as the daemon) on the built-in
corpus with M workers and prints final eval loss on the outer weights, payload bytes sent
per worker, the reduction against DDP and the peak bytes of one sync.

    python benchmarks/quality.py --json runs/bench/quality.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict
from pathlib import Path

import torch

from dilonode.config import load_config
from dilonode.fmt import human_bytes
from dilonode.sim import SimReport, plot_histories, simulate


def run_configs(args: argparse.Namespace) -> dict[str, dict]:
    common = {
        "seed": 0, "total_steps": args.steps, "eval_every": args.eval_every, "device": "cpu",
        "model": {"preset": args.preset},
        "data": {"seq_len": args.seq_len, "batch_size": args.batch_size, "eval_batches": 16},
        "inner": {"lr": 3e-3, "warmup_steps": 20},
        "sim": {"workers": args.workers},
    }
    h = args.sync_every
    streaming = {"mode": "streaming", "sync_every": h, "num_fragments": args.fragments,
                 "fragment_sync_delay": args.tau, "fragment_update_alpha": args.alpha}
    ablations = {
        f"DiLoCo H={h} ({args.codec})": {**common, "diloco": {"mode": "diloco", "sync_every": h},
                                         "codec": {"name": args.codec}},
        f"Streaming H={h} P={args.fragments} tau={args.tau} alpha={args.alpha} (fp32)": {
            **common, "codec": {"name": "float32"}, "diloco": streaming},
        f"Streaming H={h} P={args.fragments} tau=0 alpha=0 (fp32)": {
            **common, "codec": {"name": "float32"},
            "diloco": {**streaming, "fragment_sync_delay": 0, "fragment_update_alpha": 0.0}},
    }
    if args.only_ablations:
        return {k: v for k, v in ablations.items() if args.runs is None or args.runs in k}
    main_runs = {
        "DDP (fp32)": {**common, "diloco": {"mode": "ddp"}, "codec": {"name": "float32"}},
        f"DiLoCo H={h} (fp32)": {**common, "diloco": {"mode": "diloco", "sync_every": h},
                                 "codec": {"name": "float32"}},
        f"Streaming H={h} P={args.fragments} tau={args.tau} alpha={args.alpha} ({args.codec})": {
            **common, "codec": {"name": args.codec}, "diloco": streaming},
    }
    runs = main_runs | ablations if args.ablations else main_runs
    return {k: v for k, v in runs.items() if args.runs is None or args.runs in k}


def table(results: dict[str, SimReport]) -> str:
    ddp = next((r for r in results.values() if r.mode == "ddp"), None)
    diloco = next((r for r in results.values()
                   if r.mode == "diloco" and r.codec == "float32"), None)
    head = (f"{'run':<48} {'eval loss':>9} {'vs DiLoCo':>9} {'sent/worker':>12} "
            f"{'vs DDP':>8} {'peak sync':>10} {'wall':>7}")
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        rel = f"{(r.final_eval_loss / diloco.final_eval_loss - 1) * 100:+.2f}%" if diloco else "-"
        red = f"{ddp.bytes_sent_per_worker / max(r.bytes_sent_per_worker, 1):>7.0f}x" if ddp \
            else "       -"
        lines.append(f"{name:<48} {r.final_eval_loss:>9.4f} {rel:>9} "
                     f"{human_bytes(r.bytes_sent_per_worker):>12} {red} "
                     f"{human_bytes(r.peak_sync_bytes):>10} {r.wall_s:>6.0f}s")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=400, help="inner steps per worker")
    ap.add_argument("--sync-every", type=int, default=100, help="H")
    ap.add_argument("--fragments", type=int, default=3, help="P for streaming")
    ap.add_argument("--codec", default="int4", help="streaming codec: int4 or fp4")
    ap.add_argument("--tau", type=int, default=1, help="streaming fragment_sync_delay")
    ap.add_argument("--alpha", type=float, default=0.5, help="streaming fragment_update_alpha")
    ap.add_argument("--runs", help="only the runs whose name contains this text")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--ablations", action="store_true",
                    help="also run DiLoCo with the streaming codec and Streaming in fp32")
    ap.add_argument("--only-ablations", action="store_true", help="run only the ablation rows")
    ap.add_argument("--json", type=Path, help="write figures as JSON here")
    ap.add_argument("--plot", type=Path, help="write the loss/bytes plot here (PNG)")
    args = ap.parse_args()

    results: dict[str, SimReport] = {}
    for name, cfg_dict in run_configs(args).items():
        print(f"running {name} ...", flush=True)
        results[name] = simulate(load_config(overrides=cfg_dict))
        if not results[name].workers_agree:
            raise SystemExit(f"{name}: workers ended with different outer weights")
    print()
    print(table(results))
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(),
            "cpu_threads": torch.get_num_threads(), "torch": torch.__version__,
            "args": {k: str(v) for k, v in vars(args).items()}}
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot_histories({k: r.history for k, r in results.items()}, args.plot)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(
            {"meta": meta, "runs": {k: asdict(r) for k, r in results.items()}}, indent=2))


if __name__ == "__main__":
    main()
