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
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any, Protocol

from dilonode.config import RunConfig
from dilonode.fmt import human_bytes

__all__ = ["LocalSwarm", "Placement", "run_local_swarm"]

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


class Placement(Protocol):
    """Where each process of a swarm runs (e.g. the WAN test bed's network namespaces)."""

    def wrap(self, name: str, argv: list[str]) -> list[str]:
        """The command that runs `argv` where process `name` lives."""
        ...

    def addr(self, name: str) -> str:
        """The address process `name` listens on and announces."""
        ...


class LocalSwarm:
    """Processes of one local swarm; `start()` launches, `stop()` tears down.

    Without a `placement` every process runs here on 127.0.0.1; with one, each runs where
    the placement puts it, listening on the address it gives.
    """

    def __init__(self, cfg: RunConfig, nodes: int, forever: bool = False,
                 placement: Placement | None = None, threads: int | None = None) -> None:
        self.cfg, self.n, self.forever = cfg, nodes, forever
        self.placement = placement
        self.threads = threads  # torch threads per process (None: the cores, shared out)
        self.out = Path(cfg.paths.out_dir)
        self.events: queue.Queue = queue.Queue()
        self.boot: subprocess.Popen | None = None
        self.procs: list[subprocess.Popen] = []
        self.maddrs: list[str] = []
        self.status_url: str | None = None  # the bootstrap's swarm view

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log_dir = self.out / name
        log_dir.mkdir(parents=True, exist_ok=True)
        # N processes on one machine: give each its share of cores, or torch's thread pools
        # oversubscribe them and small tensor ops slow down by an order of magnitude.
        threads = self.threads or max(1, (os.cpu_count() or 1) // max(self.n, 1))
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        if self.placement is not None:
            cmd = self.placement.wrap(name, cmd)
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
        host = ["--host", self.placement.addr("bootstrap")] if self.placement else []
        self.boot = self._spawn("bootstrap", _cli("bootstrap", "--run-id", self.cfg.run_id,
                                                  "--log-format", "json", *host))
        self.maddrs = self._wait_bootstrap(timeout)
        return self.maddrs

    def start_nodes(self, extra: dict[int, list[str]] | None = None) -> None:
        """Start the N training nodes (node i with `extra[i]` args too, e.g. `--set
        data.batch_size=24` for a slower one); they wait for each other before training."""
        net = self.cfg.network.model_copy(update={"min_peers": self.n})
        self.cfg_path.write_text(self.cfg.model_copy(update={"network": net}).model_dump_json())
        for i in range(self.n):
            self.start_node(i, (extra or {}).get(i))

    @property
    def cfg_path(self) -> Path:
        return self.out / "swarm-config.json"

    def start_node(self, i: int, extra: list[str] | None = None) -> subprocess.Popen:
        """Start node `node-{i}` (worker id i) with the swarm's config, plus `extra` args."""
        name = f"node-{i}"
        cmd = _cli("run", "--config", str(self.cfg_path), "--worker-id", str(i),
                   "--out", str(self.out / name), "--log-format", "json",
                   "--initial-peers", *self.maddrs, *(extra or []))
        if self.placement is not None:
            cmd += ["--set", f"network.host={self.placement.addr(name)}"]
        proc = self._spawn(name, cmd + (["--forever"] if self.forever else []))
        self.procs.append(proc)
        return proc

    def _wait_bootstrap(self, timeout: float) -> list[str]:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                name, ev = self.events.get(timeout=left)
            except queue.Empty:
                break
            if name == "bootstrap" and ev.get("event") == "bootstrap":
                self.status_url = ev.get("status_url")
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

    def postmortem(self, names: Iterable[str], lines: int = 25) -> str:
        """For nodes that ended without a summary: each one's exit status and the end of
        its stderr log."""
        out = []
        for name in sorted(names):
            i = int(name.removeprefix("node-"))
            code = self.procs[i].poll() if i < len(self.procs) else None
            log = self.out / name / "stderr.log"
            tail = log.read_text(errors="replace").splitlines()[-lines:] if log.exists() else []
            out.append(f"{name}: exit status {code}\n" + "\n".join(tail))
        return "\n".join(out)

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
            steps[name] = ev.get("progress", ev["step"])  # the swarm clock's steps
            low = min(steps.values()) if len(steps) == nodes else 0
            bar.update(low - bar.n)
            bar.set_postfix(loss=ev.get("eval_loss"), refresh=False)
        elif ev.get("event") == "started":
            bar.write(f"{name}: peer {ev['peer_id'][:16]}… data {ev['data_addr']}  "
                      f"dashboard {ev.get('status_url') or '-'}")

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    # SIGTERM (and SIGINT, which a shell ignores in background jobs) stop the whole swarm,
    # bootstrap included, like Ctrl+C does.
    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    try:
        swarm.start()
        bar.write(f"bootstrap: {' '.join(swarm.maddrs)}")
        bar.write(f"swarm view: {swarm.status_url or '-'}  (or: dilonode status URL)")
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
