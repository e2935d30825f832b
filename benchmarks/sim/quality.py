"""Quality benchmark: DDP vs DiLoCo vs Streaming DiLoCo and its codecs at equal tokens, over seeds.

Runs the real simulator (`dilonode.sim.training.simulate`: the same Worker and algorithm code as the
daemon) on the built-in corpus with M workers. Every run ends with the final sync of every
fragment (`diloco.final_sync`), and its loss is that of the *outer* weights on the held-out
split. A row is a method: DDP, DiLoCo fp32, or Streaming DiLoCo with a codec of the codec
table, optionally sparse (rand-k: shared positions; top-k: each node's largest values with
their positions; the percentage is the share of values kept) and error feedback, named
`s-<codec>[-rand<percent>|-top<percent>][-ef]-a<alpha>` (`--methods`; the groups `quality`,
the default: fp32, int4 and fp4 with alpha 0.5 and 0, and `frontier`: int4 and below, each
rand-k and top-k density, with and without error feedback).

The inner lr, one of three ways:

1. `--sweep LR,LR,...`: the sweep rows (`--sweep-rows`; default DDP, DiLoCo fp32 and
   Streaming fp32 alpha 0.5) run at every inner lr with seed 0, and the lr where the
   reference row (`--pick-row`, default DiLoCo fp32, the reference of the quality target)
   ends lowest is used for *every* row.
2. `--lrs LR,LR,...`: every row runs at every lr with its first seed and keeps its own best.
3. Neither: `--lr` for every row.

Every row then runs with its seeds (`--seeds N` or `--seed-list`: model init and data
streams; the eval batches are the same for all), reusing the sweep's runs.

Prints the sweep and a table (mean, sample std and range over seeds; the loss relative to
DiLoCo fp32 of the same seed; bits per value; payload bytes each worker sent, the ratio to
DDP, the peak bytes of one sync) and the targets. `--json` is rewritten after every finished
run, and `--resume` reuses the runs in it whose settings match, so an interrupted benchmark
continues where it stopped; `--no-run` summarizes what it holds and lists what is missing.

    nice -n 10 python -m benchmarks.sim.quality --sweep 1.875e-4,3.75e-4,7.5e-4,1.5e-3,3e-3,6e-3 \
        --seeds 3 --jobs 2 --json runs/bench/quality.json --plot docs/img/quality.png --resume
    nice -n 10 python -m benchmarks.sim.quality --methods frontier --lr 3.75e-4 --seeds 3 \
        --jobs 2 --json runs/bench/frontier.json --resume
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from benchmarks.harness.args import floats, ints, names
from benchmarks.harness.methods import (
    QUALITY,
    codec_overrides,
    diloco_overrides,
    frontier_rows,
    label,
    row,
)
from benchmarks.harness.results import write_json

REFERENCE = "diloco-fp32"
TARGET_REL = 0.02  # within 2% of DiLoCo fp32, mean over seeds
TARGET_WORST = 0.03  # and no seed worse than 3%
TARGET_RATIO = 400.0  # the quality report: at least 400x fewer bytes than DDP
FRONTIER_RATIO = 1000.0  # the frontier: at least 1,000x (reaching for 3,000x)

Job = tuple[str, float, int]  # (row key, inner lr, seed)


def overrides(args: argparse.Namespace, key: str, lr: float, seed: int) -> dict[str, Any]:
    """The `load_config` overrides of one run. Codec options a row does not use are left
    out, so runs recorded before those options existed still match on `--resume`."""
    r = row(key)
    diloco: dict[str, Any] = {"mode": r.mode, "sync_every": args.sync_every}
    if r.mode == "streaming":
        diloco |= {"num_fragments": args.fragments, "fragment_sync_delay": args.tau,
                   "fragment_update_alpha": r.alpha}
        diloco |= diloco_overrides(r)
    codec = codec_overrides(r, args.block_size)
    return {
        "seed": seed, "total_steps": args.steps, "eval_every": args.eval_every, "device": "cpu",
        "model": {"preset": args.preset},
        "data": {"seq_len": args.seq_len, "batch_size": args.batch_size,
                 "eval_batches": args.eval_batches, "seed": seed},
        "inner": {"lr": lr, "warmup_steps": args.warmup},
        "sim": {"workers": args.workers},
        "diloco": diloco,
        "codec": codec,
    }


def _init_process(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def _simulate(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """One run (top level so a process pool can call it); returns the SimReport as a dict."""
    from dilonode.config import load_config
    from dilonode.sim.training import simulate

    cpu0 = time.process_time()
    report = asdict(simulate(load_config(overrides=cfg_dict)))
    return report | {"cpu_s": time.process_time() - cpu0}


def _key(job: Job) -> str:
    row, lr, seed = job
    return f"{row}|lr={lr:g}|seed={seed}"


class Runner:
    """Runs jobs (in a process pool with `jobs` > 1), keeping every finished run in
    `self.runs` and in the JSON file after each one."""

    def __init__(self, args: argparse.Namespace, save: Callable[[], None]) -> None:
        self.args, self.save = args, save
        self.runs: dict[str, dict[str, Any]] = {}
        if args.resume and args.json and args.json.exists():
            self.runs = json.loads(args.json.read_text()).get("runs", {})

    def run(self, jobs: list[Job]) -> None:
        todo = []
        for job in dict.fromkeys(jobs):
            cfg = overrides(self.args, *job)
            if self.runs.get(_key(job), {}).get("config") != cfg:
                todo.append((job, cfg))
        if not todo:
            return
        if self.args.no_run:
            print(f"--no-run: {len(todo)} runs not run: "
                  + ", ".join(_key(job) for job, _ in todo), flush=True)
            return
        if self.args.jobs <= 1:
            _init_process(self.args.threads)
            for job, cfg in todo:
                self._started(job)
                self._finished(job, cfg, _simulate(cfg))
            return
        with ProcessPoolExecutor(self.args.jobs, mp_context=get_context("spawn"),
                                 initializer=_init_process,
                                 initargs=(self.args.threads,)) as pool:
            pending: dict[Future[dict[str, Any]], tuple[Job, dict[str, Any]]] = {}
            for job, cfg in todo:
                pending[pool.submit(_simulate, cfg)] = (job, cfg)
            print(f"[{time.strftime('%H:%M:%S')}] {len(todo)} runs queued, "
                  f"{self.args.jobs} at a time", flush=True)
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    job, cfg = pending.pop(fut)
                    self._finished(job, cfg, fut.result())

    def _started(self, job: Job) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] run {_key(job)}", flush=True)

    def _finished(self, job: Job, cfg: dict[str, Any], report: dict[str, Any]) -> None:
        if not report["workers_agree"]:
            raise SystemExit(f"{_key(job)}: workers ended with different outer weights")
        self.runs[_key(job)] = {"row": job[0], "lr": job[1], "seed": job[2], "config": cfg,
                                "load_avg": os.getloadavg(), "report": report}
        print(f"[{time.strftime('%H:%M:%S')}] done {_key(job)}: eval loss "
              f"{report['final_eval_loss']:.4f}, {report['wall_s']:.0f} s "
              f"({report['cpu_s']:.0f} CPU s), load average {os.getloadavg()[0]:.1f}",
              flush=True)
        self.save()

    def report(self, row: str, lr: float, seed: int) -> dict[str, Any]:
        return self.runs[_key((row, lr, seed))]["report"]

    def has(self, row: str, lr: float, seed: int) -> bool:
        """A finished run with exactly these settings (the JSON may hold other ones)."""
        run = self.runs.get(_key((row, lr, seed)))
        return run is not None and run.get("config") == overrides(self.args, row, lr, seed)


def pick_lr(runner: Runner, args: argparse.Namespace) -> float:
    """The swept lr at which the `--pick-row` row's seed-0 run ends lowest."""
    return min(args.sweep, key=lambda lr: runner.report(args.pick_row, lr, 0)["final_eval_loss"])


def own_lrs(runner: Runner, args: argparse.Namespace) -> dict[str, float]:
    """`--lrs`: each row's own lr, the one of `args.lrs` at which its first seed ends lowest
    (among the runs there are, with `--no-run`)."""
    out = {}
    seed = args.seed_list[0]
    for key in args.rows:
        done = [lr for lr in args.lrs if runner.has(key, lr, seed)]
        out[key] = min(done, key=lambda lr, k=key: runner.report(k, lr, seed)["final_eval_loss"]
                       ) if done else args.lrs[0]
    return out


def sweep_table(runner: Runner, args: argparse.Namespace, picked: float) -> str:
    head = f"{'inner lr':>9} " + " ".join(f"{label(r)[:26]:>26}" for r in args.sweep_rows)
    lines = [head, "-" * len(head)]
    best = {r: min(args.sweep, key=lambda lr, r=r: runner.report(r, lr, 0)["final_eval_loss"])
            for r in args.sweep_rows}
    for lr in args.sweep:
        cells = []
        for r in args.sweep_rows:
            loss = runner.report(r, lr, 0)["final_eval_loss"]
            cells.append(f"{loss:.4f}{' (best)' if best[r] == lr else '':7}".rjust(26))
        mark = "  <- picked" if lr == picked else ""
        lines.append(f"{lr:>9g} " + " ".join(cells) + mark)
    return "\n".join(lines)


def bits_per_value(key: str, block_size: int) -> float:
    """Bits one value of a fragment costs on the wire: the codec's exact encoded size of
    2**20 values (scales included) over 2**20; a rand-k row encodes only the values its
    sparse round sends (`sparse_numel`; positions are drawn alike by every member, so they
    do not travel); a top-k row is its codec's size (positions and values of each chunk)."""
    from dilonode.algo.codecs import get_codec

    r, n = row(key), 1 << 20
    sent = n
    if r.density is not None and r.sparsity == "topk":
        from dilonode.algo.topk_codec import topk_name

        return get_codec(topk_name(r.codec, r.density), block_size).encoded_size(n) * 8 / n
    if r.density is not None:
        from dilonode.algo.sparse import sparse_numel

        sent = sparse_numel(n, r.density)
    return get_codec(r.codec, block_size).encoded_size(sent) * 8 / n


def summarize(runner: Runner, args: argparse.Namespace,
              lr_of: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Per row, over the seeds that ran: the loss, its relation to DiLoCo fp32 (same seed,
    at DiLoCo's lr), the bytes and their ratio to DDP's. Bytes and rounds do not depend on
    the seed; they are the first seed's. Rows without a run are left out."""
    out: dict[str, dict[str, Any]] = {}
    ref_lr = lr_of.get(REFERENCE)
    for key in args.rows:
        lr = lr_of[key]
        seeds = [s for s in args.seed_list if runner.has(key, lr, s)]
        if not seeds:
            continue
        reps = [runner.report(key, lr, s) for s in seeds]
        losses = [r["final_eval_loss"] for r in reps]
        rel, rel_seeds = [], []
        for rep, s in zip(reps, seeds, strict=True):
            if ref_lr is not None and runner.has(REFERENCE, ref_lr, s):
                ref = runner.report(REFERENCE, ref_lr, s)["final_eval_loss"]
                rel.append(rep["final_eval_loss"] / ref - 1)
                rel_seeds.append(s)
        out[key] = {
            "label": label(key), "lr": lr, "seeds": seeds, "losses": losses,
            "mean": statistics.fmean(losses),
            "std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
            "rel_vs_diloco": rel, "rel_seeds": rel_seeds,
            "bits_per_value": bits_per_value(key, args.block_size),
            "bytes_sent_per_worker": reps[0]["bytes_sent_per_worker"],
            "peak_sync_bytes": reps[0]["peak_sync_bytes"],
            "rounds_per_fragment": reps[0]["rounds_per_fragment"],
            "tokens": reps[0]["tokens"], "wall_s": statistics.fmean(r["wall_s"] for r in reps),
            "missing_seeds": [s for s in args.seed_list if s not in seeds],
        }
    ddp = ddp_bytes(out, args)
    if ddp is not None:
        for s in out.values():
            s["ratio_vs_ddp"] = ddp[0] / max(s["bytes_sent_per_worker"], 1.0)
            s["ddp_bytes_from"] = ddp[1]
    return out


def ddp_bytes(summary: dict[str, dict[str, Any]],
              args: argparse.Namespace) -> tuple[float, str] | None:
    """DDP's bytes per worker and where they come from: its run, or without one, DiLoCo
    fp32's times steps / H (both send the whole model in fp32 through the same all-reduce,
    DDP every step, DiLoCo every H steps)."""
    if "ddp" in summary:
        return summary["ddp"]["bytes_sent_per_worker"], "measured"
    if REFERENCE in summary and args.steps % args.sync_every == 0:
        # steps / H rounds of DiLoCo against `steps` steps of DDP: H times the bytes.
        return (summary[REFERENCE]["bytes_sent_per_worker"] * args.sync_every,
                f"DiLoCo fp32 x H = {args.sync_every}")
    return None


def _fmt_bytes(n: float) -> str:
    from dilonode.fmt import human_bytes

    return human_bytes(n)


def within(s: dict[str, Any]) -> bool | None:
    """The quality target: mean within 2% of DiLoCo fp32, no seed worse than 3%."""
    rel = s["rel_vs_diloco"]
    if not rel:
        return None
    return statistics.fmean(rel) <= TARGET_REL and max(rel) <= TARGET_WORST


def table(summary: dict[str, dict[str, Any]]) -> str:
    head = (f"{'run':<40} {'lr':>8} {'bits/val':>8} {'eval loss mean':>14} {'std':>7} "
            f"{'seeds':>6} {'vs DiLoCo fp32':>20} {'sent/worker':>11} {'vs DDP':>7} "
            f"{'peak sync':>9} {'rounds/frag':>11} {'wall':>6}")
    lines = [head, "-" * len(head)]
    for s in summary.values():
        rel = s["rel_vs_diloco"]
        rel_s = (f"{statistics.fmean(rel) * 100:+.2f}% "
                 f"({min(rel) * 100:+.1f}..{max(rel) * 100:+.1f})") if rel else "-"
        ratio = f"{s['ratio_vs_ddp']:.0f}x" if "ratio_vs_ddp" in s else "-"
        rounds = ",".join(str(v) for v in s["rounds_per_fragment"].values()) or "-"
        seeds = ",".join(str(v) for v in s["seeds"])
        lines.append(
            f"{s['label']:<40} {s['lr']:>8g} {s['bits_per_value']:>8.3f} {s['mean']:>14.4f} "
            f"{s['std']:>7.4f} {seeds:>6} {rel_s:>20} "
            f"{_fmt_bytes(s['bytes_sent_per_worker']):>11} {ratio:>7} "
            f"{_fmt_bytes(s['peak_sync_bytes']):>9} {rounds:>11} {s['wall_s']:>5.0f}s")
    return "\n".join(lines)


def markdown(summary: dict[str, dict[str, Any]], runner: Runner, args: argparse.Namespace,
             lr_of: dict[str, float]) -> str:
    """The sweep and the table as Markdown, for the reports."""
    out = []
    if args.sweep:
        out += ["| inner lr | " + " | ".join(label(r) for r in args.sweep_rows) + " |",
                "|---" * (len(args.sweep_rows) + 1) + "|"]
        picked = lr_of[args.rows[0]]
        for s_lr in args.sweep:
            cells = [f"{runner.report(r, s_lr, 0)['final_eval_loss']:.4f}"
                     for r in args.sweep_rows]
            out.append(f"| {s_lr:g}{' (picked)' if s_lr == picked else ''} | "
                       + " | ".join(cells) + " |")
        out.append("")
    out += ["| run | inner lr | bits per value | sent per worker | fewer bytes than DDP | "
            "eval loss, mean ± std | per seed | vs DiLoCo fp32, mean (per seed) | "
            "within 2%? | peak bytes in one sync | rounds per fragment |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary.values():
        rel = s["rel_vs_diloco"]
        rel_s = (f"{statistics.fmean(rel) * 100:+.2f}% ("
                 + ", ".join(f"{v * 100:+.2f}" for v in rel) + ")") if rel else "-"
        ratio = f"{s['ratio_vs_ddp']:.1f}x" if "ratio_vs_ddp" in s else "-"
        rounds = ", ".join(str(v) for v in s["rounds_per_fragment"].values()) or "-"
        per_seed = ", ".join(f"{v:.4f} (s{i})" for v, i in zip(s["losses"], s["seeds"],
                                                               strict=True))
        ok = "-" if s is summary.get(REFERENCE) else {None: "-", True: "yes",
                                                      False: "no"}[within(s)]
        out.append(f"| {s['label']} | {s['lr']:g} | {s['bits_per_value']:.3f} | "
                   f"{_fmt_bytes(s['bytes_sent_per_worker'])} | {ratio} | "
                   f"{s['mean']:.4f} ± {s['std']:.4f} | {per_seed} | {rel_s} | {ok} | "
                   f"{_fmt_bytes(s['peak_sync_bytes'])} | {rounds} |")
    return "\n".join(out)


def targets(summary: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    """The targets, met or not: the quality report's (int4 within 2%, >= 400x, and the ratio
    the schedule allows) and the frontier's (the largest ratio within 2%, >= 1,000x)."""
    lines = []
    b = bits_per_value("s-int4-a0.5", args.block_size) / 8
    ideal = args.sync_every * 4 / b
    need_h = math.ceil(TARGET_RATIO * b / 4)
    lines.append(f"ideal ratio vs DDP without the final round: H x 4 B / {b:.4f} B per int4 "
                 f"value = {args.sync_every} x {4 / b:.3f} = {ideal:.1f}x; >= {TARGET_RATIO:.0f}x "
                 f"needs H >= {need_h}")
    for key, s in summary.items():
        ok = within(s)
        if ok is None or key == REFERENCE:
            continue
        rel = s["rel_vs_diloco"]
        ratio = f", {s['ratio_vs_ddp']:.1f}x fewer bytes than DDP" if "ratio_vs_ddp" in s else ""
        lines.append(f"{s['label']}: {statistics.fmean(rel) * 100:+.2f}% vs DiLoCo fp32 "
                     f"(worst seed {max(rel) * 100:+.2f}%, {len(rel)} seeds){ratio}: "
                     f"within {TARGET_REL:.0%} {'met' if ok else 'NOT met'}")
    ok_rows = [s for s in summary.values() if within(s) and "ratio_vs_ddp" in s]
    if ok_rows:
        best = max(ok_rows, key=lambda s: s["ratio_vs_ddp"])
        met = "met" if best["ratio_vs_ddp"] >= FRONTIER_RATIO else "NOT met"
        lines.append(f"largest ratio within {TARGET_REL:.0%}: {best['ratio_vs_ddp']:.1f}x "
                     f"({best['label']}, {len(best['rel_vs_diloco'])} seeds); "
                     f">= {FRONTIER_RATIO:,.0f}x {met}")
    return "\n".join(lines)


_COLORS = {"float32": "tab:green", "int4": "tab:orange", "fp4": "tab:red", "int2": "tab:purple",
           "int1": "tab:brown"}


def plot(runner: Runner, args: argparse.Namespace, lr_of: dict[str, float], path: Path,
         summary: dict[str, dict[str, Any]]) -> None:
    """Eval loss (mean over seeds, band: min..max) against tokens and against bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(12, 4.6))
    for key, s in summary.items():
        r = row(key)
        hists = [runner.report(key, lr_of[key], seed)["history"] for seed in s["seeds"]]
        loss = [[h[i]["eval_loss"] for h in hists] for i in range(len(hists[0]))]
        mean = [statistics.fmean(v) for v in loss]
        lo, hi = [min(v) for v in loss], [max(v) for v in loss]
        tokens = [p["tokens"] for p in hists[0]]
        sent = [max(p["bytes_sent_per_worker"], 1.0) for p in hists[0]]
        color = {"ddp": "black", "diloco": "tab:blue"}.get(r.mode, _COLORS.get(r.codec, "gray"))
        style = "--" if r.alpha == 0.0 else (":" if r.density is not None else "-")
        for ax, x in ((ax_t, tokens), (ax_b, sent)):
            ax.plot(x, mean, style, color=color, marker="." if r.error_feedback else "x",
                    ms=3, lw=1.2, label=r.label)
            ax.fill_between(x, lo, hi, color=color, alpha=0.12, lw=0)
    ax_t.set(xlabel="tokens (all workers)", ylabel="eval loss, outer weights (nats/byte)")
    ax_b.set(xlabel="payload bytes sent per worker", xscale="log")
    lrs = sorted(set(lr_of[k] for k in summary))
    fig.suptitle(f"{args.workers} workers, {args.preset} model, H={args.sync_every}, "
                 f"P={args.fragments}, tau={args.tau}, inner lr {', '.join(map(str, lrs))}; "
                 f"mean of the seeds run (band: min..max)", fontsize=9)
    for ax in (ax_t, ax_b):
        ax.grid(alpha=0.3)
    ax_t.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _methods(text: str) -> list[str]:
    """`--methods`: row keys, shell patterns over the named rows (`s-int2*`) and the groups
    `quality` and `frontier`, in the order given."""
    import fnmatch

    catalog = [*QUALITY, *frontier_rows()]
    out: list[str] = []
    for item in names(text):
        if item == "quality":
            out += QUALITY
        elif item == "frontier":
            out += frontier_rows()
        elif any(c in item for c in "*?["):
            hits = fnmatch.filter(dict.fromkeys(catalog), item)
            if not hits:
                raise argparse.ArgumentTypeError(f"--methods {item}: matches no row of "
                                                 f"{', '.join(dict.fromkeys(catalog))}")
            out += hits
        else:
            try:
                row(item)
            except ValueError as e:
                raise argparse.ArgumentTypeError(str(e)) from None
            out.append(item)
    return list(dict.fromkeys(out))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2, help="M")
    ap.add_argument("--steps", type=int, default=800, help="inner steps per worker")
    ap.add_argument("--sync-every", type=int, default=50, help="H")
    ap.add_argument("--fragments", type=int, default=2, help="P for streaming (strided)")
    ap.add_argument("--tau", type=int, default=1, help="streaming fragment_sync_delay")
    ap.add_argument("--block-size", type=int, default=64, help="values per block scale")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per worker per step")
    ap.add_argument("--warmup", type=int, default=20, help="inner lr warm-up steps")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-batches", type=int, default=24)
    ap.add_argument("--lr", type=float, default=3e-3,
                    help="inner lr of every row without --sweep or --lrs")
    ap.add_argument("--sweep", type=floats, default=None,
                    help="inner lrs to sweep (seed 0) for --sweep-rows; --pick-row's best "
                    "is used for every row")
    ap.add_argument("--lrs", type=floats, default=None,
                    help="inner lrs every row runs with its first seed; each row then uses "
                    "its own best (an lr swept for every method)")
    ap.add_argument("--sweep-rows", type=_methods, default=["ddp", "diloco-fp32", "s-fp32-a0.5"])
    ap.add_argument("--pick-row", default=REFERENCE, help="the sweep row whose best lr is used")
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per row")
    ap.add_argument("--seed-list", type=ints, default=None,
                    help="these seeds instead of --seeds (the first one runs the --lrs sweep)")
    ap.add_argument("--methods", "--rows", dest="rows", type=_methods, default=QUALITY,
                    help="rows, comma-separated: keys (ddp, diloco-fp32, "
                    "s-<codec>[-rand<percent kept>|-top<percent kept>][-ef]-a<alpha>), "
                    "shell patterns, or the groups 'quality' (default) and 'frontier'")
    ap.add_argument("--jobs", type=int, default=1, help="runs in parallel (processes)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--json", type=Path, help="write every run and the summary here")
    ap.add_argument("--resume", action="store_true", help="reuse matching runs from --json")
    ap.add_argument("--no-run", action="store_true",
                    help="run nothing: summarize the runs --json holds (implies --resume)")
    ap.add_argument("--plot", type=Path, help="write the loss vs tokens/bytes plot here (PNG)")
    ap.add_argument("--markdown", action="store_true", help="also print the tables as Markdown")
    args = ap.parse_args(argv)
    args.seed_list = args.seed_list or list(range(args.seeds))
    args.resume = args.resume or args.no_run
    if args.sweep and args.lrs:
        ap.error("--sweep and --lrs: choose one (one lr for every row, or each row's own)")
    if args.sweep and args.pick_row not in args.sweep_rows:
        ap.error(f"--pick-row {args.pick_row} is not among --sweep-rows")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    t0, load0 = time.time(), os.getloadavg()
    doc: dict[str, Any] = {"meta": {
        "command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else argv,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(),
        "cpus": os.cpu_count(), "processor": _cpu_model(), "torch": torch.__version__,
        "python": platform.python_version(), "load_avg_start": load0,
        "args": {k: str(v) for k, v in vars(args).items()}}}

    if args.resume and args.json and args.json.exists():  # keep how the runs began
        earlier = json.loads(args.json.read_text()).get("meta", {})
        doc["meta"]["earlier"] = [*earlier.pop("earlier", []), earlier]

    def save() -> None:
        doc["runs"] = runner.runs
        write_json(args.json, doc)

    runner = Runner(args, save)
    lr_of = {key: args.lr for key in args.rows}
    if args.sweep:
        runner.run([(row, s_lr, 0) for row in args.sweep_rows for s_lr in args.sweep])
        lr = pick_lr(runner, args)
        lr_of = {key: lr for key in args.rows}
        print("\ninner lr sweep (seed 0, final eval loss):")
        print(sweep_table(runner, args, lr))
        doc["sweep"] = {"lrs": args.sweep, "rows": args.sweep_rows, "picked": lr,
                        "rule": f"lowest final eval loss of {args.pick_row}"}
    elif args.lrs:
        first = args.seed_list[0]
        runner.run([(key, lr, first) for key in args.rows for lr in args.lrs])
        lr_of = own_lrs(runner, args)
        doc["sweep"] = {"lrs": args.lrs, "rows": args.rows, "picked": lr_of,
                        "rule": f"each row's lowest final eval loss with seed {first}"}
    runner.run([(key, lr_of[key], s) for s in args.seed_list for key in args.rows])
    summary = summarize(runner, args, lr_of)
    print(f"\nseeds {','.join(map(str, args.seed_list))}:")
    print(table(summary))
    print(targets(summary, args))
    if missing := [k for k in args.rows if k not in summary]:
        print(f"rows without a run: {', '.join(missing)}")
    if args.markdown:
        print("\n" + markdown(summary, runner, args, lr_of))
    doc["lr"] = lr_of if args.lrs else lr_of[args.rows[0]]
    doc["summary"] = summary
    doc["meta"] |= {"finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                    "wall_s": time.time() - t0, "load_avg_end": os.getloadavg()}
    save()
    if args.plot:
        plot(runner, args, lr_of, args.plot, summary)
    return doc


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
