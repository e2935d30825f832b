"""Quality at GPU scale: DDP vs DiLoCo vs Streaming DiLoCo with int4 and
fp4 exchange, in the simulator (4 workers on one GPU, the same Worker and algorithm code as
the daemon), preset `150m`, bf16 autocast, on the Python-source corpus (`corpus.py`).

    python -m benchmarks.gpu.quality run --method ddp --json runs/gpu/quality-ddp.json
    python -m benchmarks.gpu.quality table runs/gpu/quality-*.json      # the side-by-side

Every method trains with the same settings (`common_config`): 4 workers x 2,000 inner steps
x 16 x 512 tokens (65.5M tokens in all), AdamW lr 4e-4 with 200 warm-up steps, evaluation
of the outer weights every 250 steps and after the end-of-run sync (`SimReport.
final_eval_loss`) on 16 fixed held-out batches. DiLoCo: H = 100 (P = 1, fp32). Streaming:
H = 100, P = 6 strided fragments (3 of the 18 blocks each), tau = 1, alpha = 0.5.

On a GPU the simulated group averages on the GPU (`DeviceGroup`): the simulator's
`LocalGroup` keeps every contribution on the CPU and runs the butterfly through the CPU
codecs, which at 128M values costs seconds per average (DDP averages every step). The
device group runs the same butterfly arithmetic (parts, chunks, member order, token
weights, quantize the owner's result and decode it) with the device codecs
(`dilonode/algo/torch_codecs.py`, bit-identical to the CPU codecs) on the tensors' device,
and counts the same payload bytes; `tests/unit/test_gpu_bench.py` checks that it ends on the
same outer weights as `LocalGroup`. `simulate(group_factory=...)` takes it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import resource
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import blake3
import torch

from benchmarks.harness.results import write_json
from dilonode.algo.butterfly import butterfly_average
from dilonode.algo.codec_table import CODECS
from dilonode.algo.codecs import Codec, CodecMeta
from dilonode.algo.robust import aggregate
from dilonode.algo.torch_codecs import decode_torch, encode_torch
from dilonode.collective import ReduceResult, RoundReport
from dilonode.config import RunConfig, load_config
from dilonode.fmt import human_bytes
from dilonode.sim.local_group import LocalGroup, _Slot
from dilonode.sim.training import EvalPoint, SimReport, simulate

METHODS = ("ddp", "diloco", "int4", "fp4")
_CHUNK = 1 << 24  # values per owner chunk: the same arithmetic as any block multiple


# ------------------------------------------------------------------ the device group


class _DeviceCodec:
    """A codec's wire format with torch ops on the tensors' own device (`len(data)` is the
    byte count, as for the CPU codecs' bytes)."""

    def __init__(self, codec: Codec) -> None:
        self.codec, self.name, self.block_size = codec, codec.name, codec.block_size

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, CodecMeta]:
        meta = CodecMeta(codec=self.name, numel=x.numel(), block_size=self.block_size)
        return encode_torch(self.codec, x), meta

    def decode(self, data: torch.Tensor, meta: CodecMeta) -> torch.Tensor:
        return decode_torch(self.codec, data, meta)


def device_butterfly(contributions: list[torch.Tensor], weights: list[float], codec: Codec,
                     reduce: Any, chunk_numel: int | None, align: int | None,
                     token_weights: list[float]) -> tuple[torch.Tensor, list[int], list[int]]:
    """`dilonode.algo.butterfly.butterfly_average` with its output on the contributions'
    device and the device codecs: the same parts, chunks, order and byte counts."""
    return butterfly_average(contributions, weights, _DeviceCodec(codec),  # type: ignore[arg-type]
                             reduce=reduce, chunk_numel=chunk_numel, align=align,
                             token_weights=token_weights)


class DeviceGroup(LocalGroup):
    """`LocalGroup` whose contributions stay on their device and are averaged there (see
    the module docstring). Fragment results carry `LocalGroup`'s digest (blake3 of the
    mean's bytes); DDP gradient results carry none (the worker does not read it)."""

    def _keep(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.detach().to(self.device or flat.device, torch.float32)  # not to the CPU

    def __init__(self, *args: Any, device: torch.device | str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Where contributions are averaged; None: where each arrives. The pseudo-gradients
        # of an outer state kept on the CPU arrive there.
        self.device = None if device is None else torch.device(device)

    def _reduce(self, slot: _Slot) -> None:
        everyone = sorted(slot.contributions)
        refused = {w for w in everyone if not bool(torch.isfinite(slot.contributions[w]).all())}
        order = [w for w in everyone if w not in refused]
        if not order:
            raise ValueError("DeviceGroup: every contribution holds NaN/Inf")
        rejected = set(refused)

        def reduce(chunks: list[torch.Tensor], tokens: list[float]) -> torch.Tensor:
            out = aggregate(chunks, self.aggregator, weights=tokens, assume_finite=True)
            rejected.update(order[i] for i in out.rejected)
            return out.value

        mean, sent, recv = device_butterfly(
            [slot.contributions[w] for w in order], [self.weights[w] for w in order],
            self.codec, reduce, self.chunk_numel, self.align, [slot.tokens[w] for w in order])
        digest = ""
        if slot.key is None or slot.key.kind == "fragment":
            cpu = mean.to("cpu").numpy().tobytes()
            digest = blake3.blake3(cpu, max_threads=blake3.blake3.AUTO).hexdigest()
        names = tuple(str(w) for w in sorted(rejected))
        slot.results = {w: ReduceResult(mean, RoundReport(len(order), sent[i], recv[i],
                                                          rejected=names), digest=digest)
                        for i, w in enumerate(order)}
        slot.results.update({w: ReduceResult(mean, RoundReport(len(order), 0, 0, rejected=names),
                                             digest=digest) for w in refused})
        slot.contributions.clear()
        slot.tokens.clear()


# ------------------------------------------------------------------ configs and runs


def common_config(args: argparse.Namespace) -> dict[str, Any]:
    """The settings every method shares."""
    data: dict[str, Any] = {"seq_len": args.seq_len, "batch_size": args.batch_size,
                            "eval_batches": args.eval_batches}
    data |= {"source": "builtin"} if args.data == "builtin" else \
        {"source": "bin", "path": args.data}
    return {
        "run_id": "gpu-quality", "seed": 0, "total_steps": args.steps,
        "eval_every": args.eval_every, "device": args.device,
        "model": {"preset": args.preset}, "data": data,
        "inner": {"lr": args.lr, "warmup_steps": args.warmup, "weight_decay": 0.1},
        "network": {"chunk_numel": _CHUNK},
        "sim": {"workers": args.workers},
    }


def method_config(args: argparse.Namespace, method: str) -> RunConfig:
    h = args.sync_every
    algo: dict[str, Any] = {
        "ddp": {"mode": "ddp"},
        "diloco": {"mode": "diloco", "sync_every": h},
    }.get(method, {"mode": "streaming", "sync_every": h, "num_fragments": args.fragments,
                   "fragment_pattern": "strided", "fragment_sync_delay": args.tau,
                   "fragment_update_alpha": args.alpha})
    codec = method if method in CODECS else "float32"
    return load_config(overrides={**common_config(args), "codec": {"name": codec},
                                  "diloco": {**algo, "pacing": "steps"}})


def machine() -> dict[str, Any]:
    """What ran it: host, GPU, versions, date (UTC)."""
    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "cpus": os.cpu_count(), "host": platform.node(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info |= {"gpu": props.name, "gpu_memory_bytes": props.total_memory,
                 "cudnn": torch.backends.cudnn.version()}
    return info


def run_method(args: argparse.Namespace, method: str) -> dict[str, Any]:
    """Train one method; returns its report (SimReport fields) plus throughput and memory."""
    cfg = method_config(args, method)
    device = torch.device(args.device if args.device != "auto" else
                          ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    progress = _progress(args, method)
    on_device = (cuda or args.group == "device") and args.group != "local"
    factory = functools.partial(DeviceGroup, device=device) if on_device else LocalGroup
    report = simulate(cfg, on_eval=progress, on_step=Pace(args.steps, args.max_s, method),
                      group_factory=factory)
    if not report.workers_agree:
        raise SystemExit(f"{method}: workers ended with different outer weights")
    return _result(args, method, report, cuda)


class Pace:
    """Times the steps; from step `first + span` on, projects the run's length, prints it
    and, past `max_s`, stops the run at once (a device command that would be killed at its
    time limit gives nothing back; this says what to change instead)."""

    def __init__(self, steps: int, max_s: float, method: str, first: int = 10,
                 span: int = 40) -> None:
        self.steps, self.max_s, self.method = steps, max_s, method
        self.first, self.span = first, span
        self.t0 = time.perf_counter()
        self.t_first = 0.0

    def __call__(self, step: int, workers: list[Any]) -> None:
        if torch.cuda.is_available() and step in (self.first, self.first + self.span):
            torch.cuda.synchronize()
        now = time.perf_counter()
        if step == self.first:
            self.t_first = now
        if step != self.first + self.span or step >= self.steps:
            return
        per_step = (now - self.t_first) / self.span  # all workers' inner steps, no syncs yet
        projected = (now - self.t0) + per_step * (self.steps - step)
        print(f"{self.method}: {per_step * 1000:.1f} ms per step of all {len(workers)} "
              f"workers ({per_step / len(workers) * 1000:.1f} ms per worker-step); projected "
              f"{projected:.0f} s for {self.steps} steps (syncs and evaluations not counted)",
              flush=True)
        if self.max_s and projected > self.max_s:
            raise SystemExit(f"{self.method}: projected {projected:.0f} s > --max-s "
                             f"{self.max_s:.0f}: stopping now; run every method with a "
                             "smaller --batch-size (or --steps), the same for all")


def _progress(args: argparse.Namespace, method: str) -> Any:
    log = args.json.with_suffix(".progress.jsonl") if args.json else None
    if log:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("")

    def on_eval(p: EvalPoint) -> None:
        print(f"{method}: step {p.step} tokens {p.tokens:,} train {p.train_loss:.4f} eval "
              f"{p.eval_loss:.4f} sent/worker {human_bytes(p.bytes_sent_per_worker)} "
              f"wall {p.wall_s:.0f}s ({p.tokens / max(p.wall_s, 1e-9):,.0f} tokens/s)",
              flush=True)
        if log:
            with log.open("a") as fh:
                fh.write(json.dumps(asdict(p)) + "\n")
    return on_eval


def _result(args: argparse.Namespace, method: str, report: SimReport,
            cuda: bool) -> dict[str, Any]:
    out = asdict(report)
    out |= {"method": method, "tokens_per_s": report.tokens / max(report.wall_s, 1e-9),
            "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if cuda:
        out |= {"gpu_peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                "gpu_peak_reserved_bytes": torch.cuda.max_memory_reserved()}
    return out


# ------------------------------------------------------------------ the table


def table(results: list[dict[str, Any]]) -> str:
    """Markdown: one row per method, in METHODS order."""
    by = {r["method"]: r for r in results}
    ddp, diloco = by.get("ddp"), by.get("diloco")
    head = ("| method | final eval loss | vs DiLoCo | sent per worker | fewer bytes than DDP | "
            "peak sync | tokens/s (all workers) | wall | GPU peak |")
    rows = [head, "|" + "---|" * 9]
    for m in [m for m in METHODS if m in by]:
        r = by[m]
        rel = f"{(r['final_eval_loss'] / diloco['final_eval_loss'] - 1) * 100:+.2f}%" \
            if diloco else "-"
        red = f"{ddp['bytes_sent_per_worker'] / max(r['bytes_sent_per_worker'], 1):,.0f}x" \
            if ddp else "-"
        gpu = human_bytes(r["gpu_peak_allocated_bytes"]) if "gpu_peak_allocated_bytes" in r \
            else "-"
        rows.append(f"| {_label(r)} | {r['final_eval_loss']:.4f} | {rel} | "
                    f"{human_bytes(r['bytes_sent_per_worker'])} | {red} | "
                    f"{human_bytes(r['peak_sync_bytes'])} | {r['tokens_per_s']:,.0f} | "
                    f"{r['wall_s']:.0f} s | {gpu} |")
    return "\n".join(rows)


def _label(r: dict[str, Any]) -> str:
    if r["mode"] == "ddp":
        return "DDP (fp32, every step)"
    if r["mode"] == "diloco":
        return f"DiLoCo H={r['sync_every']} ({r['codec']})"
    return (f"Streaming H={r['sync_every']} P={r['num_fragments']} tau="
            f"{r['fragment_sync_delay']} alpha={r['fragment_update_alpha']} ({r['codec']})")


# ------------------------------------------------------------------ command line


def add_settings(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--data", default="runs/corpus/pysrc",
                    help="token shards (corpus.py) or 'builtin'")
    ap.add_argument("--preset", default="150m")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2000, help="inner steps per worker")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--sync-every", type=int, default=100, help="H (DiLoCo and Streaming)")
    ap.add_argument("--fragments", type=int, default=6, help="P (Streaming)")
    ap.add_argument("--tau", type=int, default=1)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--max-s", type=float, default=0.0,
                    help="stop early when the run is projected to last longer (0: never)")
    ap.add_argument("--group", default="auto", choices=["auto", "device", "local"],
                    help="auto: DeviceGroup on a GPU, LocalGroup on the CPU")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="train one method and write its report")
    run.add_argument("--method", required=True, choices=METHODS)
    run.add_argument("--json", type=Path, help="write the report here")
    add_settings(run)
    tab = sub.add_parser("table", help="markdown table of report files")
    tab.add_argument("reports", nargs="+", type=Path)
    return ap


def main_report(argv: list[str]) -> dict[str, Any]:
    """`run` with these arguments, returning the report instead of writing it."""
    args = parser().parse_args(["run", *argv])
    return run_method(args, args.method)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.cmd == "table":
        print(table([json.loads(p.read_text()) for p in args.reports if p.is_file()]))
        return 0
    t0 = time.perf_counter()
    result = run_method(args, args.method)
    result |= {"machine": machine(), "command": shlex.join([sys.executable, *sys.argv]),
               "settings": {k: str(v) for k, v in vars(args).items()},
               "process_wall_s": time.perf_counter() - t0}
    print(f"{args.method}: final eval loss {result['final_eval_loss']:.4f}, sent per worker "
          f"{human_bytes(result['bytes_sent_per_worker'])}, {result['tokens_per_s']:,.0f} "
          f"tokens/s, {result['wall_s']:.0f} s")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
