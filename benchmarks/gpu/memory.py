"""What a node needs, to size machines: parameters, host RAM of the outer
state, GPU memory of training, for the `150m` and `1b` presets.

    python -m benchmarks.gpu.memory estimate --md runs/gpu/memory-estimate.md   # any CPU
    python -m benchmarks.gpu.memory gpu --json runs/gpu/memory.json            # one GPU

`estimate` (CPU, seconds; `--measure-outer` adds the measured host RAM, ~9 GB for 1b):

* parameters, counted on the `meta` device (nothing allocated);
* the outer state (global weights + Nesterov momentum, float32, in host memory unless
  `diloco.outer_state_on_cpu = false`): 8 bytes per parameter, and with `--measure-outer` the
  resident-set growth when the worker's `OuterState`s are made, one per fragment (P = 6);
* activation bytes per token: the tensors autograd saves under bf16 autocast, measured with
  `torch.autograd.graph.saved_tensors_hooks` on 1- and 2-block models of the preset's width
  (the difference is one block) at two sequence lengths (the difference is per token);
* the GPU memory of one node, estimated as 4N (fp32 weights) + 4N (gradients) + 8N (AdamW
  moments) + 2N (bf16 weight copies autocast keeps during a step) + activations x tokens.

`gpu` runs `node` once per case in a fresh process (a Worker on the GPU, 12 inner steps, each
of P = 6 fragments synced once through a 1-member group, one evaluation of the outer weights,
as a node does), and records `torch.cuda.max_memory_allocated` / `max_memory_reserved`, the
host RSS, and the median time of an inner step; from the quality settings' step time it
projects each quality stage's minutes (`gpu_quality.py`), and it times one 4-worker average
of the whole model through the quality runs' `DeviceGroup` (float32: DDP, every step; int4).
Without CUDA `gpu` prints why and exits 0; `node --device cpu` is its CPU equivalent.
`node --estimate` measures one config (`--vocab`, `--micro-batch`, `--checkpointing`: the
gpu.sh stage memory-1b) beside `dilonode memory`'s estimate of it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import ROOT, module_argv
from benchmarks.harness.args import names
from benchmarks.harness.results import write_json, write_text
from dilonode.algo.fragments import assign_fragments
from dilonode.algo.outer import OuterState
from dilonode.config import ModelConfig, RunConfig, load_config
from dilonode.fmt import human_bytes
from dilonode.train.memory import saved_bytes as model_saved_bytes
from dilonode.train.model import build_model, resolve_model_dims

GiB = 1 << 30
VOCAB = 256
# (preset, batch size, seq len, outer state on the CPU): what `gpu` measures.
GPU_CASES = (("150m", 16, 512, True), ("150m", 16, 1024, True), ("150m", 16, 512, False),
             ("1b", 8, 1024, True), ("1b", 16, 1024, True))
# (batch size, seq len) rows of the estimate table.
EST_SHAPES = ((16, 512), (16, 1024), (8, 1024))
QUALITY = {"preset": "150m", "batch_size": 16, "seq_len": 512, "worker_steps": 4 * 2000}


def rss_bytes() -> int:
    """Resident set size of this process now (Linux), else its peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


# ------------------------------------------------------------------ estimate (CPU)


def count_params(preset: str, **dims: int) -> tuple[int, list[int]]:
    """Parameters of a preset and the sizes of its 6 strided fragments (meta device)."""
    with torch.device("meta"):
        model = build_model(model_cfg(preset, **dims), VOCAB)
    names, params = zip(*model.named_parameters(), strict=True)
    layers = resolve_model_dims(model_cfg(preset, **dims))["n_layers"]
    frags = assign_fragments(list(names), min(6, layers), "strided")
    sizes = [sum(params[i].numel() for i in f.param_indices) for f in frags]
    return sum(p.numel() for p in params), sizes


def model_cfg(preset: str, **dims: int) -> ModelConfig:
    return ModelConfig(preset=preset, **dims)


def saved_bytes(preset: str, n_layers: int, seq_len: int, batch: int = 1) -> int:
    """Bytes of the distinct non-parameter tensors autograd saves in one forward under bf16
    autocast (CPU), for `n_layers` blocks of the preset's width."""
    torch.manual_seed(0)
    model = build_model(model_cfg(preset, n_layers=n_layers, max_seq_len=seq_len), VOCAB)
    return model_saved_bytes(model, VOCAB, seq_len, batch)


def activation_per_token(preset: str, t1: int = 128, t2: int = 256) -> tuple[float, float]:
    """(bytes per token per block, bytes per token outside the blocks) under bf16 autocast."""
    slope = {n: (saved_bytes(preset, n, t2) - saved_bytes(preset, n, t1)) / (t2 - t1)
             for n in (1, 2)}
    per_block = slope[2] - slope[1]
    return per_block, slope[1] - per_block


def measure_outer(sizes: list[int]) -> int:
    """Resident-set growth from making one OuterState per fragment (weights + momentum)."""
    gc.collect()
    before = rss_bytes()
    states = []
    for n in sizes:
        initial = torch.empty(n, dtype=torch.float32).normal_()  # [n]: the flattened fragment
        states.append(OuterState(initial, 0.7, 0.9, True, "cpu"))
        del initial
    grown = rss_bytes() - before
    del states
    gc.collect()
    return grown


def estimate(presets: list[str], measure: list[str]) -> dict[str, Any]:
    rows = {}
    for preset in presets:
        n, sizes = count_params(preset)
        dims = resolve_model_dims(model_cfg(preset))
        per_block, head = activation_per_token(preset)
        row: dict[str, Any] = {"params": n, "fragment_params": sizes, **dims,
                               "outer_state_bytes": 8 * n,
                               "act_bytes_per_token_per_block": per_block,
                               "act_bytes_per_token_outside_blocks": head}
        if preset in measure:
            need = int(1.4 * 8 * n)
            if mem_available() < need:
                row["outer_state_measured"] = f"skipped: needs {human_bytes(need)} free"
            else:
                row["outer_state_measured_bytes"] = measure_outer(sizes)
        row["gpu_estimate_bytes"] = {
            f"{b}x{t}": 18 * n + b * t * (per_block * dims["n_layers"] + head)
            for b, t in EST_SHAPES}
        rows[preset] = row
    return rows


def estimate_md(rows: dict[str, Any]) -> str:
    head = ("| preset | parameters | outer state in host RAM (8 B/param) | measured RSS growth | "
            "activations per token (bf16) | " + " | ".join(
                f"GPU estimate {b}x{t}" for b, t in EST_SHAPES) + " |")
    lines = [head, "|" + "---|" * (5 + len(EST_SHAPES))]
    for preset, r in rows.items():
        measured = r.get("outer_state_measured") or (
            human_bytes(r["outer_state_measured_bytes"])
            if "outer_state_measured_bytes" in r else "-")
        block, rest = r["act_bytes_per_token_per_block"], r["act_bytes_per_token_outside_blocks"]
        act = block * r["n_layers"] + rest
        est = " | ".join(human_bytes(r["gpu_estimate_bytes"][f"{b}x{t}"]) for b, t in EST_SHAPES)
        lines.append(f"| {preset} | {r['params'] / 1e6:,.1f}M | "
                     f"{human_bytes(r['outer_state_bytes'])} | {measured} | "
                     f"{human_bytes(act)} ({block / 1024:.1f} KiB x {r['n_layers']} blocks + "
                     f"{human_bytes(rest)}) | "
                     f"{est} |")
    return "\n".join(lines)


# ------------------------------------------------------------------ one node (GPU or CPU)


def node_config(preset: str, batch: int, seq_len: int, outer_cpu: bool, device: str,
                data: str, steps: int, vocab: int | None = None, micro_batch: int | None = None,
                checkpointing: bool = False) -> RunConfig:
    src = {"source": "builtin"} if data == "builtin" else {"source": "bin", "path": data}
    return load_config(overrides={
        "seed": 0, "total_steps": steps, "device": device,
        "model": {"preset": preset, "vocab_size": vocab,
                  "activation_checkpointing": checkpointing},
        "data": {**src, "seq_len": seq_len, "batch_size": batch, "eval_batches": 4,
                 "micro_batch_size": micro_batch},
        "inner": {"lr": 4e-4, "warmup_steps": 2},
        "diloco": {"mode": "streaming", "sync_every": steps,
                   "num_fragments": min(6, resolve_model_dims(model_cfg(preset))["n_layers"]),
                   "fragment_sync_delay": 1, "pacing": "steps",
                   "outer_state_on_cpu": outer_cpu},
        "codec": {"name": "int4"}, "sim": {"workers": 1},
    })


def run_node(cfg: RunConfig) -> dict[str, Any]:
    """A Worker alone (1-member group): steps, one round per fragment, one evaluation."""
    from dilonode.algo.codecs import get_codec
    from dilonode.sim.local_group import LocalGroup
    from dilonode.train.data import load_data
    from dilonode.train.worker import Worker

    dev = torch.device(cfg.device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.init()
        torch.empty(1, device=dev)  # the CUDA context, outside the node's own figures
    rss0 = rss_bytes()
    data = load_data(cfg.data)
    group = LocalGroup(1, get_codec(cfg.codec.name, cfg.codec.block_size),
                       chunk_numel=cfg.network.chunk_numel, align=cfg.codec.block_size)
    t0 = time.perf_counter()
    w = Worker(cfg, data, group.view(0), identity=0, device=dev)
    build_s = time.perf_counter() - t0
    rss_built = rss_bytes()
    times = []
    for _ in range(cfg.total_steps):
        sync()
        t = time.perf_counter()
        w.train_step()
        sync()
        times.append(time.perf_counter() - t)
        w.launch()
        w.land()
    w.drain()
    eval_loss = w.evaluate(data.eval_batches(cfg.data.seq_len, cfg.data.batch_size, 2))
    n = sum(p.numel() for p in w.params)
    out = {"preset": cfg.model.preset, "batch_size": cfg.data.batch_size,
           "seq_len": cfg.data.seq_len, "outer_state_on_cpu": cfg.diloco.outer_state_on_cpu,
           "device": str(dev), "params": n, "rounds": sum(w.stats.rounds.values()),
           "step_s_median": statistics.median(times[2:] or times), "build_s": build_s,
           "eval_loss": eval_loss, "host_rss_after_context_bytes": rss0,
           "host_rss_built_bytes": rss_built, "host_rss_end_bytes": rss_bytes(),
           "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "outer_state_bytes": sum(2 * f.outer.weights.numel() * 4 for f in w.frags)}
    if cuda:
        out |= {"gpu_peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                "gpu_peak_reserved_bytes": torch.cuda.max_memory_reserved(),
                "gpu": torch.cuda.get_device_name(0)}
    return out


def beside_estimate(cfg: RunConfig, measured: dict[str, Any]) -> dict[str, Any]:
    """`estimate_memory` of the config the node ran (`dilonode memory`), and the measured
    peak (`torch.cuda.max_memory_allocated`) against it when the node ran on a GPU."""
    from dilonode.train.data import load_data
    from dilonode.train.memory import estimate_memory

    vocab = cfg.model.vocab_size or load_data(cfg.data).vocab_size
    est = estimate_memory(cfg, vocab, fused_optimizer=cfg.device == "cuda")
    out: dict[str, Any] = {"vocab_size": vocab, "micro_batch_size": cfg.data.micro_batch_size,
                           "activation_checkpointing": cfg.model.activation_checkpointing,
                           "estimate": est.as_dict(),
                           "estimate_device_bytes": est.device_bytes}
    peak = measured.get("gpu_peak_allocated_bytes")
    if peak:
        out["measured_over_estimate"] = round(peak / est.device_bytes, 4)
    return out


def time_device_average(n: int, codec: str, workers: int = 4) -> float:
    """Seconds for one `DeviceGroup` average of `workers` x n values on the GPU."""
    from benchmarks.gpu.quality import DeviceGroup
    from dilonode.algo.codecs import get_codec
    from dilonode.collective import RoundRequest, SyncKey

    xs = [torch.randn(n, device="cuda") * 1e-3 for _ in range(workers)]
    best = float("inf")
    for r in range(3):
        group = DeviceGroup(workers, get_codec(codec, 64), chunk_numel=1 << 24, align=64,
                            device="cuda")
        torch.cuda.synchronize()
        t = time.perf_counter()
        handles = [group.view(i).begin(RoundRequest(SyncKey("grad", 0, r)), xs[i])
                   for i in range(workers)]
        handles[0].wait()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def gpu(args: argparse.Namespace) -> dict[str, Any]:
    """Every GPU_CASES case in its own process, then the averaging timings and projection."""
    cases = []
    for preset, b, t, outer_cpu in GPU_CASES:
        cmd = [*module_argv(__spec__.name), "node", "--preset", preset, "--batch-size", str(b),
               "--seq-len", str(t), "--data", args.data, "--device", "cuda"]
        cmd += [] if outer_cpu else ["--outer-on-gpu"]
        print("$", " ".join(cmd[1:]), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.case_timeout,
                              cwd=ROOT)
        last = proc.stdout.strip().splitlines()[-1:] if proc.stdout.strip() else []
        if proc.returncode == 0 and last:
            cases.append(json.loads(last[0]))
        else:
            oom = "OutOfMemoryError" in proc.stderr
            cases.append({"preset": preset, "batch_size": b, "seq_len": t,
                          "outer_state_on_cpu": outer_cpu,
                          "error": "CUDA out of memory" if oom else proc.stderr[-800:]})
        print(json.dumps(cases[-1]), flush=True)
    n150 = next((c["params"] for c in cases if c.get("params") and c["preset"] == "150m"), 0)
    avg = {c: time_device_average(n150, c) for c in ("float32", "int4")} if n150 else {}
    return {"cases": cases, "device_average_s": avg, "projection": project(cases, avg)}


def project(cases: list[dict[str, Any]], avg: dict[str, float]) -> dict[str, float]:
    """Minutes each quality stage should take, from the measured quality-shape step time."""
    step = next((c["step_s_median"] for c in cases if c.get("preset") == QUALITY["preset"]
                 and c.get("batch_size") == QUALITY["batch_size"]
                 and c.get("seq_len") == QUALITY["seq_len"] and c.get("outer_state_on_cpu")
                 and "step_s_median" in c), None)
    if step is None:
        return {}
    train = QUALITY["worker_steps"] * step
    ddp = train + QUALITY["worker_steps"] // 4 * avg.get("float32", 0.0)
    return {"worker_step_s": step, "diloco_min": (train + 60) / 60,
            "streaming_min": (train + 60) / 60, "ddp_min": (ddp + 60) / 60}


def gpu_md(res: dict[str, Any]) -> str:
    lines = ["| preset | batch x seq | outer state | GPU peak allocated | GPU peak reserved | "
             "host RSS at end | inner step |", "|" + "---|" * 7]
    for c in res["cases"]:
        where = "CPU" if c["outer_state_on_cpu"] else "GPU"
        if "error" in c:
            lines.append(f"| {c['preset']} | {c['batch_size']}x{c['seq_len']} | {where} | "
                         f"{c['error'][:60]} | | | |")
            continue
        lines.append(f"| {c['preset']} | {c['batch_size']}x{c['seq_len']} | {where} | "
                     f"{human_bytes(c['gpu_peak_allocated_bytes'])} | "
                     f"{human_bytes(c['gpu_peak_reserved_bytes'])} | "
                     f"{human_bytes(c['host_rss_end_bytes'])} | "
                     f"{c['step_s_median'] * 1000:.0f} ms |")
    if res.get("device_average_s"):
        lines.append("\n4-worker average of the whole 150m model on the GPU (DeviceGroup): " +
                     ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in
                               res["device_average_s"].items()))
    if res.get("projection"):
        p = res["projection"]
        lines.append(f"projected quality stages: DDP {p['ddp_min']:.1f} min, DiLoCo "
                     f"{p['diloco_min']:.1f} min, Streaming {p['streaming_min']:.1f} min each "
                     f"(worker step {p['worker_step_s'] * 1000:.0f} ms x 8,000, +1 min start "
                     "and evaluations)")
    return "\n".join(lines)


# ------------------------------------------------------------------ command line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    est = sub.add_parser("estimate", help="parameters, outer state, activations (CPU)")
    est.add_argument("--presets", default="150m,1b")
    est.add_argument("--measure-outer", default="", help="presets whose outer state to "
                     "allocate and measure (e.g. 150m,1b; 1b needs ~9 GB)")
    est.add_argument("--json", type=Path)
    est.add_argument("--md", type=Path)
    nd = sub.add_parser("node", help="one node's memory and step time (prints JSON)")
    nd.add_argument("--preset", default="150m")
    nd.add_argument("--batch-size", type=int, default=16)
    nd.add_argument("--seq-len", type=int, default=512)
    nd.add_argument("--steps", type=int, default=12)
    nd.add_argument("--outer-on-gpu", action="store_true")
    nd.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    nd.add_argument("--data", default="runs/corpus/pysrc", help="shards or 'builtin'")
    nd.add_argument("--vocab", type=int, help="model.vocab_size (pads the data's)")
    nd.add_argument("--micro-batch", type=int, help="data.micro_batch_size")
    nd.add_argument("--checkpointing", action="store_true",
                    help="model.activation_checkpointing")
    nd.add_argument("--estimate", action="store_true", help="`dilonode memory`'s estimate "
                    "of the same config beside the measurement")
    nd.add_argument("--json", type=Path, help="also write the result here")
    g = sub.add_parser("gpu", help="every case of GPU_CASES on this GPU")
    g.add_argument("--data", default="runs/corpus/pysrc")
    g.add_argument("--case-timeout", type=float, default=240.0)
    g.add_argument("--json", type=Path)
    g.add_argument("--md", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "node":
        if args.device == "cuda" and not torch.cuda.is_available():
            print("skipped: torch sees no CUDA GPU", file=sys.stderr)
            return 0
        cfg = node_config(args.preset, args.batch_size, args.seq_len, not args.outer_on_gpu,
                          args.device, args.data, args.steps, args.vocab, args.micro_batch,
                          args.checkpointing)
        out = run_node(cfg)
        if args.estimate:
            out |= beside_estimate(cfg, out)
        write_json(args.json, out)
        print(json.dumps(out), flush=True)
        return 0
    if args.cmd == "gpu" and not torch.cuda.is_available():
        print("benchmarks/gpu/memory.py gpu: skipped, torch sees no CUDA GPU")
        return 0
    if args.cmd == "estimate":
        res: dict[str, Any] = {"presets": estimate(
            names(args.presets), names(args.measure_outer))}
        md = estimate_md(res["presets"])
    else:
        res = gpu(args)
        md = gpu_md(res)
    res |= {"machine": {"cpus": os.cpu_count(), "torch": torch.__version__,
                        "cuda": torch.version.cuda, "date": time.strftime(
                            "%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
            "command": " ".join([Path(sys.executable).name, *sys.argv])}
    print(md)
    write_json(args.json, res)
    write_text(args.md, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
