"""Quality benchmark: DDP vs DiLoCo vs Streaming DiLoCo at equal tokens, over seeds.

Runs the real simulator (`dilonode.sim.training.simulate`: the same Worker and algorithm code as the
daemon) on the built-in corpus with M workers. Every run ends with the final sync of every
fragment (`diloco.final_sync`), and its loss is that of the *outer* weights on the held-out
split. Rows: DDP, DiLoCo fp32, and Streaming DiLoCo in fp32, int4 and fp4 with
tau = `--tau` and alpha 0.5 and 0.

1. `--sweep LR,LR,...`: the sweep rows (`--sweep-rows`; default DDP, DiLoCo fp32 and
   Streaming fp32 alpha 0.5) run at every inner lr with seed 0, and the lr where the
   reference row (`--pick-row`, default DiLoCo fp32, the reference of the quality target)
   ends lowest is used for *every* row. Without `--sweep`, `--lr` is used.
2. Every row runs with `--seeds` seeds (model init and data streams; the eval batches are
   the same for all), reusing the sweep's seed-0 runs at the picked lr.

Prints the sweep and a table (mean, sample std and range over seeds; the loss relative to
DiLoCo fp32 of the same seed; payload bytes each worker sent, the ratio to DDP, the peak
bytes of one sync). `--json` is rewritten after every finished run, and `--resume` reuses
the runs in it whose settings match, so an interrupted benchmark continues where it stopped.

    nice -n 10 python -m benchmarks.sim.quality --sweep 1.875e-4,3.75e-4,7.5e-4,1.5e-3,3e-3,6e-3 \
        --seeds 3 --jobs 2 --json runs/bench/quality.json --plot docs/img/quality.png --resume
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

from benchmarks.harness.args import floats, names
from benchmarks.harness.results import write_json

# (key, label, mode, codec, alpha): alpha None for DDP and DiLoCo (which pins tau = alpha = 0).
ROWS: list[tuple[str, str, str, str, float | None]] = [
    ("ddp", "DDP (fp32, every step)", "ddp", "float32", None),
    ("diloco-fp32", "DiLoCo (fp32)", "diloco", "float32", None),
    ("s-fp32-a0.5", "Streaming fp32, alpha 0.5", "streaming", "float32", 0.5),
    ("s-int4-a0.5", "Streaming int4, alpha 0.5", "streaming", "int4", 0.5),
    ("s-fp4-a0.5", "Streaming fp4, alpha 0.5", "streaming", "fp4", 0.5),
    ("s-fp32-a0", "Streaming fp32, alpha 0", "streaming", "float32", 0.0),
    ("s-int4-a0", "Streaming int4, alpha 0", "streaming", "int4", 0.0),
    ("s-fp4-a0", "Streaming fp4, alpha 0", "streaming", "fp4", 0.0),
]
LABELS = {key: label for key, label, *_ in ROWS}
REFERENCE = "diloco-fp32"
TARGET_REL = 0.02  # Streaming int4 within 2% of DiLoCo fp32
TARGET_RATIO = 400.0  # at least 400x fewer bytes than DDP

Job = tuple[str, float, int]  # (row key, inner lr, seed)


def overrides(args: argparse.Namespace, row: str, lr: float, seed: int) -> dict[str, Any]:
    """The `load_config` overrides of one run."""
    _, _, mode, codec, alpha = next(r for r in ROWS if r[0] == row)
    diloco: dict[str, Any] = {"mode": mode, "sync_every": args.sync_every}
    if mode == "streaming":
        diloco |= {"num_fragments": args.fragments, "fragment_sync_delay": args.tau,
                   "fragment_update_alpha": alpha}
    return {
        "seed": seed, "total_steps": args.steps, "eval_every": args.eval_every, "device": "cpu",
        "model": {"preset": args.preset},
        "data": {"seq_len": args.seq_len, "batch_size": args.batch_size,
                 "eval_batches": args.eval_batches, "seed": seed},
        "inner": {"lr": lr, "warmup_steps": args.warmup},
        "sim": {"workers": args.workers},
        "diloco": diloco,
        "codec": {"name": codec, "block_size": args.block_size},
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


def pick_lr(runner: Runner, args: argparse.Namespace) -> float:
    """The swept lr at which the `--pick-row` row's seed-0 run ends lowest."""
    return min(args.sweep, key=lambda lr: runner.report(args.pick_row, lr, 0)["final_eval_loss"])


def sweep_table(runner: Runner, args: argparse.Namespace, picked: float) -> str:
    head = f"{'inner lr':>9} " + " ".join(f"{LABELS[r][:26]:>26}" for r in args.sweep_rows)
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


def summarize(runner: Runner, args: argparse.Namespace, lr: float) -> dict[str, dict[str, Any]]:
    """Per row: the loss over seeds, its relation to DiLoCo fp32 (same seed) and to DDP's
    bytes. Bytes and rounds do not depend on the seed; they are the first seed's."""
    out: dict[str, dict[str, Any]] = {}
    ref = REFERENCE if REFERENCE in args.rows else None
    for row in args.rows:
        reps = [runner.report(row, lr, s) for s in args.seed_list]
        losses = [r["final_eval_loss"] for r in reps]
        rel = ([r["final_eval_loss"] / runner.report(ref, lr, s)["final_eval_loss"] - 1
                for r, s in zip(reps, args.seed_list, strict=True)] if ref else [])
        out[row] = {
            "label": LABELS[row], "losses": losses, "mean": statistics.fmean(losses),
            "std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
            "rel_vs_diloco": rel, "bytes_sent_per_worker": reps[0]["bytes_sent_per_worker"],
            "peak_sync_bytes": reps[0]["peak_sync_bytes"],
            "rounds_per_fragment": reps[0]["rounds_per_fragment"],
            "tokens": reps[0]["tokens"], "wall_s": statistics.fmean(r["wall_s"] for r in reps),
        }
    if "ddp" in out:
        for s in out.values():
            s["ratio_vs_ddp"] = out["ddp"]["bytes_sent_per_worker"] / max(
                s["bytes_sent_per_worker"], 1.0)
    return out


def _fmt_bytes(n: float) -> str:
    from dilonode.fmt import human_bytes

    return human_bytes(n)


def table(summary: dict[str, dict[str, Any]]) -> str:
    head = (f"{'run':<28} {'eval loss mean':>14} {'std':>7} {'min..max':>15} "
            f"{'vs DiLoCo fp32':>20} {'sent/worker':>11} {'vs DDP':>7} {'peak sync':>9} "
            f"{'rounds/frag':>11} {'wall':>6}")
    lines = [head, "-" * len(head)]
    for s in summary.values():
        rel = s["rel_vs_diloco"]
        rel_s = (f"{statistics.fmean(rel) * 100:+.2f}% "
                 f"({min(rel) * 100:+.1f}..{max(rel) * 100:+.1f})") if rel else "-"
        ratio = f"{s['ratio_vs_ddp']:.0f}x" if "ratio_vs_ddp" in s else "-"
        rounds = ",".join(str(v) for v in s["rounds_per_fragment"].values()) or "-"
        lines.append(
            f"{s['label']:<28} {s['mean']:>14.4f} {s['std']:>7.4f} "
            f"{min(s['losses']):>7.4f}..{max(s['losses']):.4f} {rel_s:>20} "
            f"{_fmt_bytes(s['bytes_sent_per_worker']):>11} {ratio:>7} "
            f"{_fmt_bytes(s['peak_sync_bytes']):>9} {rounds:>11} {s['wall_s']:>5.0f}s")
    return "\n".join(lines)


def bytes_per_value(codec: str, block_size: int) -> float:
    from dilonode.algo.codecs import get_codec

    n = 1 << 20
    return get_codec(codec, block_size).encoded_size(n) / n


def markdown(summary: dict[str, dict[str, Any]], runner: Runner, args: argparse.Namespace,
             lr: float) -> str:
    """The sweep and the table as Markdown, for a report in docs/reports/."""
    out = []
    if args.sweep:
        out += ["| inner lr | " + " | ".join(LABELS[r] for r in args.sweep_rows) + " |",
                "|---" * (len(args.sweep_rows) + 1) + "|"]
        for s_lr in args.sweep:
            cells = [f"{runner.report(r, s_lr, 0)['final_eval_loss']:.4f}"
                     for r in args.sweep_rows]
            out.append(f"| {s_lr:g}{' (picked)' if s_lr == lr else ''} | "
                       + " | ".join(cells) + " |")
        out.append("")
    out += ["| run | eval loss, mean ± std (min..max) | vs DiLoCo fp32, mean (min..max) | "
            "sent per worker | fewer bytes than DDP | peak bytes in one sync | "
            "rounds per fragment |", "|---|---|---|---|---|---|---|"]
    for s in summary.values():
        rel = s["rel_vs_diloco"]
        rel_s = (f"{statistics.fmean(rel) * 100:+.2f}% ({min(rel) * 100:+.2f}.."
                 f"{max(rel) * 100:+.2f})") if rel else "-"
        ratio = f"{s['ratio_vs_ddp']:.1f}x" if "ratio_vs_ddp" in s else "-"
        rounds = ", ".join(str(v) for v in s["rounds_per_fragment"].values()) or "-"
        out.append(f"| {s['label']} | {s['mean']:.4f} ± {s['std']:.4f} "
                   f"({min(s['losses']):.4f}..{max(s['losses']):.4f}) | {rel_s} | "
                   f"{_fmt_bytes(s['bytes_sent_per_worker'])} | {ratio} | "
                   f"{_fmt_bytes(s['peak_sync_bytes'])} | {rounds} |")
    return "\n".join(out)


def targets(summary: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    """The two targets, met or not, and the byte ratio the schedule allows."""
    lines = []
    b = bytes_per_value("int4", args.block_size)
    ideal = args.sync_every * 4 / b
    need_h = math.ceil(TARGET_RATIO * b / 4)
    lines.append(f"ideal ratio vs DDP without the final round: H x 4 B / {b:.4f} B per int4 "
                 f"value = {args.sync_every} x {4 / b:.3f} = {ideal:.1f}x; >= {TARGET_RATIO:.0f}x "
                 f"needs H >= {need_h}")
    for row in ("s-int4-a0.5", "s-int4-a0"):
        s = summary.get(row)
        if s is None or not s["rel_vs_diloco"]:
            continue
        rel = statistics.fmean(s["rel_vs_diloco"])
        ok = "met" if rel <= TARGET_REL else "NOT met"
        lines.append(f"{s['label']}: {rel * 100:+.2f}% vs DiLoCo fp32 (mean over seeds): "
                     f"within {TARGET_REL:.0%} {ok}")
        if "ratio_vs_ddp" in s:
            ok = "met" if s["ratio_vs_ddp"] >= TARGET_RATIO else "NOT met"
            lines.append(f"{s['label']}: {s['ratio_vs_ddp']:.1f}x fewer bytes than DDP: "
                         f">= {TARGET_RATIO:.0f}x {ok}")
    return "\n".join(lines)


def plot(runner: Runner, args: argparse.Namespace, lr: float, path: Path) -> None:
    """Eval loss (mean over seeds, band: min..max) against tokens and against bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"float32": "tab:green", "int4": "tab:orange", "fp4": "tab:red"}
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(12, 4.6))
    for key, label, mode, codec, alpha in ROWS:
        if key not in args.rows:
            continue
        hists = [runner.report(key, lr, s)["history"] for s in args.seed_list]
        loss = [[h[i]["eval_loss"] for h in hists] for i in range(len(hists[0]))]
        mean = [statistics.fmean(v) for v in loss]
        lo, hi = [min(v) for v in loss], [max(v) for v in loss]
        tokens = [p["tokens"] for p in hists[0]]
        sent = [max(p["bytes_sent_per_worker"], 1.0) for p in hists[0]]
        color = {"ddp": "black", "diloco": "tab:blue"}.get(mode, colors[codec])
        style = "--" if alpha == 0.0 else "-"
        for ax, x in ((ax_t, tokens), (ax_b, sent)):
            ax.plot(x, mean, style, color=color, marker=".", ms=3, lw=1.2, label=label)
            ax.fill_between(x, lo, hi, color=color, alpha=0.12, lw=0)
    ax_t.set(xlabel="tokens (all workers)", ylabel="eval loss, outer weights (nats/byte)")
    ax_b.set(xlabel="payload bytes sent per worker", xscale="log")
    fig.suptitle(f"{args.workers} workers, {args.preset} model, H={args.sync_every}, "
                 f"P={args.fragments}, tau={args.tau}, inner lr {lr:g}; mean of "
                 f"{len(args.seed_list)} seeds (band: min..max)", fontsize=9)
    for ax in (ax_t, ax_b):
        ax.grid(alpha=0.3)
    ax_t.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _rows(text: str) -> list[str]:
    rows = names(text)
    unknown = [r for r in rows if r not in LABELS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown rows {unknown}; known: {', '.join(LABELS)}")
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2, help="M")
    ap.add_argument("--steps", type=int, default=800, help="inner steps per worker")
    ap.add_argument("--sync-every", type=int, default=50, help="H")
    ap.add_argument("--fragments", type=int, default=2, help="P for streaming (strided)")
    ap.add_argument("--tau", type=int, default=1, help="streaming fragment_sync_delay")
    ap.add_argument("--block-size", type=int, default=64, help="values per int4/fp4 scale")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per worker per step")
    ap.add_argument("--warmup", type=int, default=20, help="inner lr warm-up steps")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-batches", type=int, default=24)
    ap.add_argument("--lr", type=float, default=3e-3, help="inner lr when there is no --sweep")
    ap.add_argument("--sweep", type=floats, default=None, help="inner lrs to sweep (seed 0)")
    ap.add_argument("--sweep-rows", type=_rows, default=["ddp", "diloco-fp32", "s-fp32-a0.5"])
    ap.add_argument("--pick-row", default=REFERENCE, help="the sweep row whose best lr is used")
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per row")
    ap.add_argument("--rows", type=_rows, default=[r[0] for r in ROWS],
                    help=f"comma-separated subset of {','.join(LABELS)}")
    ap.add_argument("--jobs", type=int, default=1, help="runs in parallel (processes)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--json", type=Path, help="write every run and the summary here")
    ap.add_argument("--resume", action="store_true", help="reuse matching runs from --json")
    ap.add_argument("--plot", type=Path, help="write the loss vs tokens/bytes plot here (PNG)")
    ap.add_argument("--markdown", action="store_true", help="also print the tables as Markdown")
    args = ap.parse_args(argv)
    args.seed_list = list(range(args.seeds))
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
    lr = args.lr
    if args.sweep:
        runner.run([(row, s_lr, 0) for row in args.sweep_rows for s_lr in args.sweep])
        lr = pick_lr(runner, args)
        print("\ninner lr sweep (seed 0, final eval loss):")
        print(sweep_table(runner, args, lr))
        doc["sweep"] = {"lrs": args.sweep, "rows": args.sweep_rows, "picked": lr,
                        "rule": f"lowest final eval loss of {args.pick_row}"}
    runner.run([(row, lr, s) for s in args.seed_list for row in args.rows])
    summary = summarize(runner, args, lr)
    print(f"\ninner lr {lr:g}, {len(args.seed_list)} seeds:")
    print(table(summary))
    print(targets(summary, args))
    if args.markdown:
        print("\n" + markdown(summary, runner, args, lr))
    doc["lr"], doc["summary"] = lr, summary
    doc["meta"] |= {"finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                    "wall_s": time.time() - t0, "load_avg_end": os.getloadavg()}
    save()
    if args.plot:
        plot(runner, args, lr, args.plot)
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
