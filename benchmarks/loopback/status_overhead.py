"""Does watching a node slow its training? Steps per second of one worker whose status endpoint
is polled (a client process fetching /status, /history and /metrics back to back, then
pausing `--poll-ms`; the dashboard pauses 2000) against the same worker not polled, in
alternating rounds so drift in a shared machine's load hits both alike. Also: request
latency while training, and the cost of the per-step hook (`NodeStatus.on_step`).

The worker trains over an in-process group of one (no DHT), with the status server on its
own event-loop thread, as in a node.

    python -m benchmarks.loopback.status_overhead --rounds 4 --steps 150 --json
    runs/bench/status.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.harness.results import write_json
from dilonode.algo.codecs import get_codec
from dilonode.config import load_config
from dilonode.net.loop_thread import LoopThread
from dilonode.sim.local_group import LocalGroup
from dilonode.status.metrics import node_metrics
from dilonode.status.server import StatusServer
from dilonode.status.snapshot import NodeStatus
from dilonode.train.data import load_data
from dilonode.train.worker import Worker

# The client runs in its own process, as a browser or Prometheus would: only the serving
# side's cost lands in the node's process. It prints one latency (ms) per request.
_POLLER = """
import sys, time, urllib.request
url, every = sys.argv[1], float(sys.argv[2])
while True:
    for path in ("/status", "/history", "/metrics"):
        t0 = time.perf_counter()
        with urllib.request.urlopen(url + path, timeout=5) as resp:
            resp.read()
        print(round((time.perf_counter() - t0) * 1000, 3), flush=True)
    time.sleep(every)
"""


def start_poller(url: str, every: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _POLLER, url, str(every)],
                            stdout=subprocess.PIPE, text=True)


def stop_poller(proc: subprocess.Popen, latencies: list[float]) -> None:
    proc.terminate()
    out, _ = proc.communicate(timeout=10)
    latencies += [float(x) for x in out.split()]


def train(worker: Worker, status: NodeStatus, steps: int) -> float:
    """Steps per second over `steps` steps (the status hook runs after each, as in a node)."""
    rep = type("Rep", (), {"eval_history": [], "compute_utilization": 1.0, "sync_wait_s": 0.0})
    t0 = time.perf_counter()
    for _ in range(steps):
        worker.train_step()
        worker.launch()
        worker.land()
        status.on_step(worker, rep)
    return steps / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4, help="alternating polled/quiet pairs")
    p.add_argument("--steps", type=int, default=150, help="steps per measurement")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--poll-ms", type=float, default=50.0, help="pause between poll bursts")
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(overrides={"model": {"preset": args.preset}, "device": "cpu",
                                 "data": {"seq_len": 128, "batch_size": 8},
                                 "diloco": {"sync_every": 30, "num_fragments": 3}})
    data = load_data(cfg.data)
    group = LocalGroup(1, get_codec(cfg.codec.name, cfg.codec.block_size))
    worker = Worker(cfg, data, group.view(0), identity=0)
    status = NodeStatus(cfg.run_id, sample_every=1.0)
    loop = LoopThread("bench-status", use_uvloop=False)
    loop.start()
    server = StatusServer(status, node_metrics)
    url = loop.run(server.start(), timeout=10)
    train(worker, status, 20)  # warm-up
    quiet, polled, latencies = [], [], []
    try:
        for _ in range(args.rounds):
            quiet.append(train(worker, status, args.steps))
            poller = start_poller(url, args.poll_ms / 1000)
            try:
                polled.append(train(worker, status, args.steps))
            finally:
                stop_poller(poller, latencies)
            print(f"quiet {quiet[-1]:.2f} steps/s, polled {polled[-1]:.2f} steps/s", flush=True)
    finally:
        loop.run(server.aclose(), timeout=10)
        loop.stop()
    t0 = time.perf_counter()
    for _ in range(10000):
        status.on_step(worker, type("Rep", (), {"eval_history": [], "compute_utilization": 1.0,
                                                "sync_wait_s": 0.0}))
    hook_us = (time.perf_counter() - t0) / 10000 * 1e6
    out = {"preset": args.preset, "steps": args.steps, "rounds": args.rounds,
           "poll_ms": args.poll_ms, "quiet_steps_per_s": [round(x, 2) for x in quiet],
           "polled_steps_per_s": [round(x, 2) for x in polled],
           "ratio_polled_over_quiet": round(statistics.median(polled)
                                            / statistics.median(quiet), 3),
           "pair_ratios": [round(p / q, 3) for p, q in zip(polled, quiet, strict=True)],
           "requests": len(latencies),
           "request_ms_median": round(statistics.median(latencies), 2),
           "request_ms_max": round(max(latencies), 2), "on_step_us": round(hook_us, 2)}
    print(json.dumps(out, indent=2))
    write_json(args.json, out)


if __name__ == "__main__":
    main()
