"""Connection flood against a training node: does it change training, or the log?

Runs a 2-node local swarm (`dilonode.cli.local_swarm.LocalSwarm`) twice in one invocation, the
same run without and with a flood: once node-0 has done `--flood-at` of its steps, a
flooder thread opens `--connections` idle TCP connections (default 20,000, or pass
twice the node's open-files limit) to node-0's three public ports (data
plane, state sync, status; a third each), from `--sources` loopback addresses, sends
nothing, and holds every connection until the node closes it or the run ends. Reports
each node's compute utilization and steps per second, what the flooder saw (refused at
once, closed at the node's handshake deadline, held to the end) and the lines node-0
wrote to its log, against the unflooded run.

    .venv/bin/python -m benchmarks.loopback.flood --steps 600 --json runs/bench/flood.json
    .venv/bin/python -m benchmarks.loopback.flood --node-nofile 1024 --connections 2048

`--node-nofile N` runs the swarm's processes under `prlimit --nofile=N:N` (the node then
cannot raise its limit), as in the report that started this (1,500 idle connections under
`ulimit -n 1024` crashed a node). The flooder runs in this process, so on a small machine
it competes with the nodes for CPU: compare utilization (time not blocked on the network)
more than steps per second. Not run in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness.results import save_rows
from dilonode.cli.local_swarm import LocalSwarm
from dilonode.config import RunConfig, load_config
from dilonode.net.admission import raise_nofile_limit
from tests.support.ports import free_port


def run_config(args: argparse.Namespace, label: str) -> RunConfig:
    return load_config(overrides={
        "run_id": f"flood-{label}", "seed": 0, "total_steps": args.steps,
        # progress events come every eval_every steps: the flood starts at one of them
        "eval_every": max(args.steps // 20, 1), "device": "cpu", "model": {"preset": args.preset},
        "data": {"seq_len": 128, "batch_size": 8, "eval_batches": 2},
        "diloco": {"mode": "streaming", "sync_every": 30, "num_fragments": 3,
                   "fragment_sync_delay": 1, "fragment_update_alpha": 0.5},
        "codec": {"name": "int4"},
        "checkpoint": {"every_steps": 0, "on_exit": False},
        "paths": {"out_dir": str(args.out / label)},
    })


class NofileLimit:
    """A `Placement` that runs each process on 127.0.0.1 under an open-files limit."""

    def __init__(self, nofile: int) -> None:
        if shutil.which("prlimit") is None:
            raise SystemExit("--node-nofile needs prlimit (util-linux)")
        self.nofile = nofile

    def wrap(self, name: str, argv: list[str]) -> list[str]:
        return ["prlimit", f"--nofile={self.nofile}:{self.nofile}", "--", *argv]

    def addr(self, name: str) -> str:
        return "127.0.0.1"


# -------------------------------------------------------------------- the flooder


@dataclass
class FloodStats:
    attempted: int = 0
    connect_failed: int = 0
    refused_at_once: int = 0  # closed by the node within 0.5 s (a cap was reached)
    closed_later: int = 0  # closed by the node's handshake deadline (or an eviction)
    held_to_end: int = 0
    max_open: int = 0
    seconds_to_open_all: float = 0.0
    per_port: dict[str, int] = field(default_factory=dict)


class Flooder:
    """Opens idle connections from a thread with its own event loop; `stop()` ends it."""

    def __init__(self, targets: dict[str, tuple[str, int]], connections: int,
                 sources: list[str], concurrency: int = 256) -> None:
        self.targets, self.n, self.sources = targets, connections, sources
        self.concurrency = concurrency
        self.stats = FloodStats(per_port=dict.fromkeys(targets, 0))
        self._open = 0
        self._t0 = 0.0
        self._settled = 0  # connects done or failed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="flooder", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> FloodStats:
        if self._loop is not None and self._done is not None:
            with contextlib.suppress(RuntimeError):  # finished already: every one closed
                self._loop.call_soon_threadsafe(self._done.set)
        self._thread.join(60)
        return self.stats

    def _main(self) -> None:
        asyncio.run(self._flood())

    async def _flood(self) -> None:
        self._loop, self._done = asyncio.get_running_loop(), asyncio.Event()
        sem = asyncio.Semaphore(self.concurrency)
        names = list(self.targets)
        self._t0 = time.perf_counter()
        tasks = [asyncio.create_task(self._one(names[i % len(names)],
                                               self.sources[i % len(self.sources)], sem))
                 for i in range(self.n)]
        await asyncio.gather(*tasks)

    def _settle(self) -> None:
        self._settled += 1
        if self._settled == self.n:
            self.stats.seconds_to_open_all = round(time.perf_counter() - self._t0, 2)

    async def _one(self, port_name: str, source: str, sem: asyncio.Semaphore) -> None:
        assert self._done is not None
        async with sem:  # bounds the connects in flight, not the connections held
            self.stats.attempted += 1
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(
                    *self.targets[port_name], local_addr=(source, 0)), 10)
            except (OSError, TimeoutError):
                self.stats.connect_failed += 1
                self._settle()
                return
        self._settle()
        self.stats.per_port[port_name] += 1
        self._open += 1
        self.stats.max_open = max(self.stats.max_open, self._open)
        t0 = time.perf_counter()
        closed = asyncio.ensure_future(reader.read(1))
        end = asyncio.ensure_future(self._done.wait())
        await asyncio.wait({closed, end}, return_when=asyncio.FIRST_COMPLETED)
        if closed.done():
            fast = time.perf_counter() - t0 < 0.5
            self.stats.refused_at_once += fast
            self.stats.closed_later += not fast
            with contextlib.suppress(Exception):  # a reset is a close too
                closed.result()
        else:
            self.stats.held_to_end += 1
            closed.cancel()
        end.cancel()
        self._open -= 1
        writer.close()


# -------------------------------------------------------------------- one run


def run_once(args: argparse.Namespace, flood: bool) -> dict[str, Any]:
    label = "flooded" if flood else "quiet"
    cfg = run_config(args, label)
    placement = NofileLimit(args.node_nofile) if args.node_nofile else None
    swarm = LocalSwarm(cfg, 2, placement=placement)
    ports = {"data": free_port(), "state": free_port(), "status": free_port()}
    flooder: Flooder | None = None
    load = [round(x, 1) for x in os.getloadavg()]  # others' load skews steps/s most
    t0 = time.perf_counter()
    try:
        swarm.start_bootstrap()
        net = cfg.network.model_copy(update={"min_peers": 2})
        swarm.cfg_path.write_text(cfg.model_copy(update={"network": net}).model_dump_json())
        swarm.start_node(0, ["--set", f"network.port={ports['data']}",
                             "--set", f"statesync.port={ports['state']}",
                             "--set", f"status.port={ports['status']}"])
        swarm.start_node(1)
        targets = {k: ("127.0.0.1", p) for k, p in ports.items()}
        sources = [f"127.0.0.{2 + i}" for i in range(args.sources)]

        def on_event(name: str, ev: dict[str, Any]) -> None:
            nonlocal flooder
            if (flood and flooder is None and name == "node-0" and ev.get("event") == "progress"
                    and ev["step"] >= args.flood_at * args.steps):
                print(f"  flooding node-0 at step {ev['step']}: {args.connections:,} "
                      f"connections", flush=True)
                flooder = Flooder(targets, args.connections, sources)
                flooder.start()

        summaries = swarm.follow(on_event)
    finally:
        swarm.stop()
    stats = flooder.stop() if flooder is not None else None
    row = summarize(label, summaries, swarm.out, stats, time.perf_counter() - t0)
    row["loadavg_start_end"] = [load[0], round(os.getloadavg()[0], 1)]
    return row


def summarize(label: str, summaries: dict[str, dict[str, Any]], out: Path,
              stats: FloodStats | None, wall: float) -> dict[str, Any]:
    log_lines = (out / "node-0" / "stderr.log").read_text().splitlines()
    port_lines = [ln for ln in log_lines if " port" in ln or "rejected connection" in ln
                  or "state sync: dropping" in ln]
    return {
        "run": label,
        "nodes_finished": len(summaries),
        "utilization": {n: round(s["compute_utilization"], 4) for n, s in summaries.items()},
        "steps_per_s": {n: round(s["steps"] / s["wall_s"], 2) for n, s in summaries.items()},
        "skipped_rounds": sum(s["skipped_rounds"] for s in summaries.values()),
        "identical_outer": len({s["outer_digest"] for s in summaries.values()}) == 1,
        "node0_log_lines": len(log_lines), "node0_connection_log_lines": len(port_lines),
        "node0_log_bytes": sum(len(ln) + 1 for ln in log_lines),
        "flood": asdict(stats) if stats else None, "wall_s": round(wall, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=600, help="inner steps per node")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--connections", type=int, default=20_000, help="idle connections opened")
    p.add_argument("--sources", type=int, default=4, help="loopback addresses flooding")
    p.add_argument("--flood-at", type=float, default=0.2, help="share of steps before it")
    p.add_argument("--node-nofile", type=int, default=0,
                   help="open-files limit of the swarm's processes (0: inherited)")
    p.add_argument("--out", type=Path, default=Path("runs/bench/flood"))
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args()
    print(f"flooder's open-files limit: {raise_nofile_limit()}", flush=True)
    rows = []
    for flood in (False, True):
        print(f"run {'with' if flood else 'without'} a flood ...", flush=True)
        rows.append(run_once(args, flood))
        print(json.dumps(rows[-1]), flush=True)
    quiet, flooded = rows
    for node in sorted(quiet["utilization"]):
        if node in flooded["utilization"]:
            du = flooded["utilization"][node] - quiet["utilization"][node]
            print(f"{node}: utilization {quiet['utilization'][node]:.1%} -> "
                  f"{flooded['utilization'][node]:.1%} ({du * 100:+.2f} points); steps/s "
                  f"{quiet['steps_per_s'][node]} -> {flooded['steps_per_s'][node]}")
    extra = flooded["node0_log_lines"] - quiet["node0_log_lines"]
    print(f"node-0 log: {quiet['node0_log_lines']} -> {flooded['node0_log_lines']} lines "
          f"({extra:+d}); connection lines in the flooded run: "
          f"{flooded['node0_connection_log_lines']}")
    save_rows(args.json, args, rows)
    ok = all(r["nodes_finished"] == 2 for r in rows)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
