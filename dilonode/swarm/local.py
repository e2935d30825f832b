"""`dilonode swarm`: a bootstrap peer and N training nodes on loopback, one process each.

The parent writes the run's effective config as JSON, starts `dilonode bootstrap`, reads its
multiaddrs, starts N `dilonode run` children (worker ids 0..N-1, so their data streams are
the simulator's), follows their JSON progress lines, and prints a summary table. Ctrl+C or
SIGTERM stops the children cleanly (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from dilonode.config import RunConfig

__all__ = ["LocalSwarm", "run_local_swarm"]

GRACE_S = 15.0


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "dilonode.cli", *args]


def _pump(name: str, stream: IO[str], events: queue.Queue) -> None:
    for line in stream:
        try:
            events.put((name, json.loads(line)))
        except json.JSONDecodeError:
            events.put((name, {"event": "text", "line": line.rstrip()}))
    events.put((name, {"event": "eof"}))


class LocalSwarm:
    """Processes of one local swarm; `start()` launches, `stop()` tears down."""

    def __init__(self, cfg: RunConfig, nodes: int, forever: bool = False) -> None:
        self.cfg, self.n, self.forever = cfg, nodes, forever
        self.out = Path(cfg.paths.out_dir)
        self.events: queue.Queue = queue.Queue()
        self.boot: subprocess.Popen | None = None
        self.procs: list[subprocess.Popen] = []
        self.maddrs: list[str] = []

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log_dir = self.out / name
        log_dir.mkdir(parents=True, exist_ok=True)
        # N processes on one machine: give each its share of cores, or torch's thread pools
        # oversubscribe them and small tensor ops slow down by an order of magnitude.
        threads = max(1, (os.cpu_count() or 1) // max(self.n, 1))
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, bufsize=1, env=env,
                                stderr=(log_dir / "stderr.log").open("w"))
        threading.Thread(target=_pump, args=(name, proc.stdout, self.events),
                         daemon=True).start()
        return proc

    def start(self, boot_timeout: float = 60.0) -> None:
        self.start_bootstrap(boot_timeout)
        self.start_nodes()

    def start_bootstrap(self, timeout: float = 60.0) -> list[str]:
        """Start the DHT-only bootstrap peer; returns its multiaddrs."""
        self.out.mkdir(parents=True, exist_ok=True)
        self.boot = self._spawn("bootstrap", _cli("bootstrap", "--run-id", self.cfg.run_id,
                                                  "--log-format", "json"))
        self.maddrs = self._wait_bootstrap(timeout)
        return self.maddrs

    def start_nodes(self) -> None:
        """Start the N training nodes; they wait for each other before training."""
        cfg_path = self.out / "swarm-config.json"
        net = self.cfg.network.model_copy(update={"min_peers": self.n})
        cfg_path.write_text(self.cfg.model_copy(update={"network": net}).model_dump_json())
        for i in range(self.n):
            cmd = _cli("run", "--config", str(cfg_path), "--worker-id", str(i),
                       "--out", str(self.out / f"node-{i}"), "--log-format", "json",
                       "--initial-peers", *self.maddrs)
            self.procs.append(self._spawn(f"node-{i}", cmd + (["--forever"] if self.forever
                                                               else [])))

    def _wait_bootstrap(self, timeout: float) -> list[str]:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                name, ev = self.events.get(timeout=left)
            except queue.Empty:
                break
            if name == "bootstrap" and ev.get("event") == "bootstrap":
                return list(ev["maddrs"])
            if name == "bootstrap" and ev.get("event") == "eof":
                break
        self.stop()
        raise RuntimeError(f"bootstrap peer did not come up within {timeout:.0f} s "
                           f"(see {self.out / 'bootstrap' / 'stderr.log'})")

    def stop(self) -> None:
        """SIGTERM every child, SIGKILL what is left after the grace period."""
        procs = self.procs + ([self.boot] if self.boot else [])
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        for p in procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)

    def follow(self, on_event: Any = None) -> dict[str, dict]:
        """Consume events until every node's output ends; returns summaries by node name."""
        summaries: dict[str, dict] = {}
        open_nodes = {f"node-{i}" for i in range(self.n)}
        while open_nodes:
            name, ev = self.events.get()
            if ev.get("event") == "summary":
                summaries[name] = ev
            elif ev.get("event") == "eof":
                open_nodes.discard(name)
            if on_event:
                on_event(name, ev)
        for p in self.procs:
            p.wait(timeout=GRACE_S)
        return summaries


def _table(summaries: dict[str, dict]) -> str:
    from dilonode.commands import human_bytes

    head = (f"{'node':<8} {'steps':>6} {'tokens':>10} {'eval loss':>9} {'sent':>10} "
            f"{'rounds/fragment':<24} {'retried':>7} {'skipped':>7} {'util':>6}")
    rows = [head, "-" * len(head)]
    for name in sorted(summaries):
        s = summaries[name]
        rounds = ",".join(f"{k}:{v}" for k, v in s["rounds_per_fragment"].items())
        rows.append(f"{name:<8} {s['steps']:>6} {s['tokens']:>10} {s['final_eval_loss']:>9.4f} "
                    f"{human_bytes(s['bytes_sent']):>10} {rounds:<24} {s['retried_rounds']:>7} "
                    f"{s['skipped_rounds']:>7} "
                    f"{s['compute_utilization'] * 100:>5.1f}%")
    digests = {s["outer_digest"] for s in summaries.values()}
    rows.append(f"outer weights identical on all nodes: {len(digests) == 1}")
    return "\n".join(rows)


def run_local_swarm(cfg: RunConfig, nodes: int, config_path: str | None = None,
                    overrides: list[str] | None = None, forever: bool = False) -> int:
    """The `dilonode swarm` command: start, show progress, print the summary table."""
    from tqdm import tqdm

    swarm = LocalSwarm(cfg, nodes, forever)
    bar = tqdm(total=None if forever else cfg.total_steps, unit="step", file=sys.stdout,
               desc=f"{nodes} nodes")
    steps: dict[str, int] = {}

    def on_event(name: str, ev: dict) -> None:
        if ev.get("event") == "progress":
            steps[name] = ev["step"]
            low = min(steps.values()) if len(steps) == nodes else 0
            bar.update(low - bar.n)
            bar.set_postfix(loss=ev.get("eval_loss"), refresh=False)
        elif ev.get("event") == "started":
            bar.write(f"{name}: peer {ev['peer_id'][:16]}… data {ev['data_addr']}")

    try:
        swarm.start()
        bar.write(f"bootstrap: {' '.join(swarm.maddrs)}")
        summaries = swarm.follow(on_event)
    except KeyboardInterrupt:
        bar.write("stopping the swarm ...")
        swarm.stop()
        summaries = swarm.follow(on_event)
    finally:
        bar.close()
        swarm.stop()
    print(_table(summaries) if summaries else "no node finished")
    print(f"logs and summaries: {swarm.out}/node-*/")
    failed = [p.returncode for p in swarm.procs if p.returncode not in (0, None)]
    return 1 if failed or len(summaries) < nodes else 0
