"""A real swarm on one GPU: a bootstrap peer and 4 `dilonode run` processes
sharing the GPU for at least 10 minutes, preset `150m`, Streaming DiLoCo with int4 exchange,
on the Python-source corpus; per node tokens/s, compute utilization, bytes, round latency and
the end-of-run agreement, and the GPU's utilization and memory sampled every 5 s.

A remote command may be limited to 10 minutes, so the run outlives the command that starts
it:

    python -m benchmarks.gpu.swarm start                # config, swarm and sampler, detached
    python -m benchmarks.gpu.swarm wait --max-s 480      # exit 0 when done, 3 while running
    python -m benchmarks.gpu.swarm collect --json runs/gpu/swarm.json --md runs/gpu/swarm.md

`start` launches `dilonode swarm --nodes 4` (the one-command local swarm: bootstrap and N
`dilonode run` children on 127.0.0.1) in a new session (`setsid`), so it survives the
command that started it as long as the machine stays up. The run is paced by the swarm clock
(`diloco.pacing = "time"`) with `diloco.step_seconds` fixed, so its length is
`total_steps x step_seconds` whatever speed the nodes reach: `--minutes 11` at 0.1 s a
reference step is 6,600 reference steps, with the end-of-run round that makes every node
hold the same outer weights. Files land in `runs/gpu/swarm/` (`--dir`).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import ROOT, module_argv
from benchmarks.harness.results import write_json, write_text
from testbed.hosts import pid_alive

DEFAULT_DIR = Path("runs/gpu/swarm")
SAMPLE_S = 5.0


def swarm_config(args: argparse.Namespace) -> dict[str, Any]:
    """The run every node shares (configs/gpu-150m.toml's algorithm, the quality shape)."""
    src = {"source": "builtin"} if args.data == "builtin" else \
        {"source": "bin", "path": str(args.data)}
    return {
        "run_id": "gpu-swarm", "seed": 0, "device": args.device,
        "total_steps": max(1, round(args.minutes * 60 / args.step_seconds)),
        "eval_every": args.eval_every,
        "model": {"preset": args.preset},
        "data": {**src, "seq_len": args.seq_len, "batch_size": args.batch_size,
                 "eval_batches": 8},
        "inner": {"lr": 4e-4, "warmup_steps": 200, "weight_decay": 0.1},
        "diloco": {"mode": "streaming", "sync_every": args.sync_every,
                   "num_fragments": args.fragments,
                   "fragment_pattern": "strided", "fragment_sync_delay": 5,
                   "fragment_update_alpha": 0.5, "pacing": "time",
                   "step_seconds": args.step_seconds},
        "codec": {"name": "int4", "block_size": 64},
        "checkpoint": {"every_steps": 0, "on_exit": False},
        "paths": {"out_dir": str(args.dir)},
    }


def start(args: argparse.Namespace) -> dict[str, Any]:
    from dilonode.config import load_config

    if args.dir.exists():
        shutil.rmtree(args.dir)
    args.dir.mkdir(parents=True)
    cfg = load_config(overrides=swarm_config(args))  # validated here, not in 4 children
    cfg_path = args.dir / "config.json"
    cfg_path.write_text(cfg.model_dump_json(indent=2) + "\n")
    cmd = [sys.executable, "-m", "dilonode.cli", "swarm", "--nodes", str(args.nodes),
           "--config", str(cfg_path)]
    log = (args.dir / "swarm.log").open("w")
    swarm = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    sampler = subprocess.Popen([*module_argv(__spec__.name), "sample", "--dir", str(args.dir),
                                "--pid", str(swarm.pid)], start_new_session=True, cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    info = {"swarm_pid": swarm.pid, "sampler_pid": sampler.pid, "started": time.time(),
            "command": " ".join(cmd), "total_steps": cfg.total_steps,
            "step_seconds": args.step_seconds, "nodes": args.nodes}
    (args.dir / "pids.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def last_line(path: Path) -> str:
    """The newest line of a log a progress bar rewrites with carriage returns."""
    try:
        text = path.read_bytes()[-4096:].decode("utf-8", "replace")
    except OSError:
        return ""
    parts = [p.strip() for p in text.replace("\r", "\n").splitlines() if p.strip()]
    return parts[-1] if parts else ""


def wait(args: argparse.Namespace) -> int:
    """Until the swarm exits (0) or `--max-s` passes (3), a progress line every minute."""
    info = json.loads((args.dir / "pids.json").read_text())
    deadline = time.monotonic() + args.max_s
    next_print = 0.0
    while pid_alive(info["swarm_pid"]):
        if time.monotonic() >= deadline:
            print(f"swarm still running after {time.time() - info['started']:.0f} s", flush=True)
            return 3
        if time.monotonic() >= next_print:
            print(f"[{time.time() - info['started']:.0f} s] {last_line(args.dir / 'swarm.log')}",
                  flush=True)
            next_print = time.monotonic() + 60
        time.sleep(0.5)
    print(f"swarm done after {time.time() - info['started']:.0f} s", flush=True)
    return 0


def stop(args: argparse.Namespace) -> None:
    """SIGTERM the swarm (its nodes land their rounds and stop)."""
    info = json.loads((args.dir / "pids.json").read_text())
    if pid_alive(info["swarm_pid"]):
        os.kill(info["swarm_pid"], signal.SIGTERM)


# ------------------------------------------------------------------ GPU sampling


def _smi(query: str, kind: str) -> list[list[str]]:
    out = subprocess.run(["nvidia-smi", f"--query-{kind}={query}", "--format=csv,noheader,"
                          "nounits"], capture_output=True, text=True, timeout=20).stdout
    return [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.strip()]


def worker_of(pid: str) -> str:
    """'node-i' for a `dilonode run --worker-id i` process, else the pid."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return pid
    if b"--worker-id" in argv:
        return "node-" + argv[argv.index(b"--worker-id") + 1].decode()
    return pid


def sample(args: argparse.Namespace) -> None:
    """Every 5 s while the swarm runs: GPU utilization, memory, power; memory per process."""
    if shutil.which("nvidia-smi") is None:
        return
    with (args.dir / "gpu.csv").open("w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(["t", "what", "util_pct", "memory_mib", "power_w"])
        t0 = time.time()
        while pid_alive(args.pid):
            t = round(time.time() - t0, 1)
            try:
                for util, mem, power in _smi("utilization.gpu,memory.used,power.draw", "gpu"):
                    out.writerow([t, "gpu", util, mem, power])
                for pid, mem in _smi("pid,used_memory", "compute-apps"):
                    out.writerow([t, worker_of(pid), "", mem, ""])
            except (subprocess.SubprocessError, ValueError, OSError):
                pass
            fh.flush()
            time.sleep(SAMPLE_S)


# ------------------------------------------------------------------ collect


def _gpu_figures(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    rows = list(csv.DictReader(path.open()))
    gpu = [r for r in rows if r["what"] == "gpu" and r["util_pct"] not in ("", "[N/A]")]
    busy = [float(r["util_pct"]) for r in gpu if float(r["memory_mib"] or 0) > 0]
    per: dict[str, float] = {}
    for r in rows:
        if r["what"] != "gpu":
            per[r["what"]] = max(per.get(r["what"], 0.0), float(r["memory_mib"] or 0))
    return {"samples": len(gpu),
            "util_mean_pct": statistics.fmean(busy) if busy else None,
            "util_median_pct": statistics.median(busy) if busy else None,
            "memory_max_mib": max((float(r["memory_mib"]) for r in gpu), default=None),
            "process_memory_max_mib": per}


def collect(args: argparse.Namespace) -> dict[str, Any]:
    info = json.loads((args.dir / "pids.json").read_text())
    nodes = {}
    for path in sorted(args.dir.glob("node-*/summary.json")):
        s = json.loads(path.read_text())
        lat = s.get("round_latency_s", {})
        frag = [v for k, v in lat.items() if int(k) >= 0]
        n = sum(v["n"] for v in frag)
        nodes[path.parent.name] = {
            "steps": s["steps"], "tokens": s["tokens"], "wall_s": s["wall_s"],
            "tokens_per_s": s["tokens"] / max(s["wall_s"], 1e-9),
            "compute_utilization": s["compute_utilization"], "step_share": s["step_share"],
            "bytes_sent": s["bytes_sent"], "bytes_received": s["bytes_received"],
            "rounds": sum(s["rounds_per_fragment"].values()),
            "rounds_with_peers": s.get("rounds_with_peers"),
            "skipped_rounds": s["skipped_rounds"], "retried_rounds": s["retried_rounds"],
            "late_rounds": s.get("late_rounds"), "missed_rounds": s.get("missed_rounds"),
            "round_latency_mean_s": sum(v["mean"] * v["n"] for v in frag) / n if n else None,
            "round_latency_max_s": max((v["max"] for v in frag), default=None),
            "final_eval_loss": s["final_eval_loss"], "outer_digest": s["outer_digest"],
            "agreement": s.get("agreement", {})}
    digests = {v["outer_digest"] for v in nodes.values()}
    errors = {p.name: last_line(p / "stderr.log") for p in sorted(args.dir.glob("node-*"))
              if p.name not in nodes}
    return {"nodes": nodes, "expected_nodes": info["nodes"], "errors": errors,
            "identical_outer_weights": len(digests) == 1 and len(nodes) == info["nodes"],
            "swarm_running": pid_alive(info["swarm_pid"]),
            "run_s": max((v["wall_s"] for v in nodes.values()), default=None),
            "total_tokens_per_s": sum(v["tokens_per_s"] for v in nodes.values()),
            "gpu": _gpu_figures(args.dir / "gpu.csv"), "start": info,
            "config": json.loads((args.dir / "config.json").read_text()),
            "swarm_log_tail": last_line(args.dir / "swarm.log")}


def collect_md(res: dict[str, Any]) -> str:
    from dilonode.fmt import human_bytes

    lines = ["| node | steps | tokens/s | compute util | sent | received | rounds (with peers) | "
             "round latency mean / max | skipped | final eval loss |", "|" + "---|" * 10]
    for name, v in res["nodes"].items():
        lat = "-" if v["round_latency_mean_s"] is None else \
            f"{v['round_latency_mean_s']:.2f} / {v['round_latency_max_s']:.2f} s"
        lines.append(f"| {name} | {v['steps']:,} | {v['tokens_per_s']:,.0f} | "
                     f"{v['compute_utilization'] * 100:.1f}% | {human_bytes(v['bytes_sent'])} | "
                     f"{human_bytes(v['bytes_received'])} | {v['rounds']} "
                     f"({v['rounds_with_peers']}) | {lat} | {v['skipped_rounds']} | "
                     f"{v['final_eval_loss']:.4f} |")
    for name, err in res["errors"].items():
        lines.append(f"| {name} | no summary: {err[-200:]} |" + " |" * 8)
    if len(res["nodes"]) < res["expected_nodes"]:
        lines.append(f"\nswarm log: {res['swarm_log_tail'][-300:]}")
    g = res.get("gpu") or {}
    lines.append(f"\n{len(res['nodes'])}/{res['expected_nodes']} nodes reported; run "
                 f"{res['run_s'] or 0:.0f} s; {res['total_tokens_per_s']:,.0f} tokens/s in all; "
                 f"identical outer weights on all nodes: {res['identical_outer_weights']}")
    if g:
        per = ", ".join(f"{k} {v / 1024:.1f} GiB" for k, v in
                        sorted(g["process_memory_max_mib"].items()))
        util = "-" if g["util_mean_pct"] is None else f"{g['util_mean_pct']:.0f}%"
        mem = "-" if g["memory_max_mib"] is None else f"{g['memory_max_mib'] / 1024:.1f} GiB"
        lines.append(f"GPU ({g['samples']} samples every {SAMPLE_S:.0f} s): utilization mean "
                     f"{util}, memory used max {mem}; per process max: {per or '-'}")
    return "\n".join(lines)


# ------------------------------------------------------------------ command line


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("start", help="write the config, start the swarm and the sampler")
    st.add_argument("--nodes", type=int, default=4)
    st.add_argument("--minutes", type=float, default=11.0, help="length of the run")
    st.add_argument("--step-seconds", type=float, default=0.1, help="diloco.step_seconds")
    st.add_argument("--sync-every", type=int, default=100, help="H")
    st.add_argument("--fragments", type=int, default=6, help="P")
    st.add_argument("--eval-every", type=int, default=1000)
    st.add_argument("--preset", default="150m")
    st.add_argument("--batch-size", type=int, default=16)
    st.add_argument("--seq-len", type=int, default=512)
    st.add_argument("--data", default="runs/corpus/pysrc", help="shards or 'builtin'")
    st.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    wt = sub.add_parser("wait", help="until the swarm is done (0) or --max-s passed (3)")
    wt.add_argument("--max-s", type=float, default=480.0)
    sub.add_parser("stop", help="SIGTERM the swarm")
    sm = sub.add_parser("sample", help="(internal) sample the GPU while --pid lives")
    sm.add_argument("--pid", type=int, required=True)
    co = sub.add_parser("collect", help="per-node figures and GPU samples")
    co.add_argument("--json", type=Path)
    co.add_argument("--md", type=Path)
    for p in (st, wt, sm, co, sub.choices["stop"]):
        p.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    return ap


def main_args(argv: list[str]) -> argparse.Namespace:
    return parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = main_args(sys.argv[1:] if argv is None else argv)
    if args.cmd == "start":
        print(json.dumps(start(args)))
    elif args.cmd == "wait":
        return wait(args)
    elif args.cmd == "stop":
        stop(args)
    elif args.cmd == "sample":
        sample(args)
    else:
        res = collect(args)
        md = collect_md(res)
        print(md)
        write_json(args.json, res)
        write_text(args.md, md)
        return 0 if res["identical_outer_weights"] else 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
