"""Chaos runs: a local swarm (loopback, or the WAN test bed) that breaks one part of one node
at a time, the way an operator or a bad network would, and checks the swarm-level invariant
from outside. Used by tests/integration/test_chaos.py (fast cases) and benchmarks/testbed/chaos.py
(the full matrix).

    plan = [Fault(node=0, part="dht", kind="kill", at_step=40),
            Fault(node=1, part="data", kind="stop", at_step=80, seconds=30)]
    res = run_chaos(cfg, nodes=3, faults=plan, out=Path("runs/chaos"))
    res.violations()        # [] when the invariant held
    res.heal_times()        # per fault: seconds from the part's ERROR line to "healthy again"

Parts and how they are broken (from outside the node, no hook inside it):

| part | kill | stop (for `seconds`) |
|---|---|---|
| dht | SIGKILL the node's DHT process | SIGSTOP it, SIGCONT after |
| p2pd | SIGKILL the DHT process's p2pd | SIGSTOP / SIGCONT |
| data, state, status | destroy the listening socket (`ss -K`) | drop what comes to its port |
| partition | - | `Testbed.partition(*sides)`, `heal()` after |

The invariant: every node either ends with exit code 0, and then all such nodes
hold identical outer weights (`outer_digest` in their summaries), or exits non-zero with a
one-line reason as the last line of its stderr. Never exit 0 with different weights.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dilonode.cli.local_swarm import LocalSwarm
from dilonode.config import RunConfig
from tests.support.ports import free_port

__all__ = ["ChaosResult", "Fault", "NodeEnd", "run_chaos"]

Part = Literal["dht", "p2pd", "data", "state", "status", "partition"]
LISTENERS = {"data": "network.port", "state": "statesync.port", "status": "status.port"}
_GROUP_RE = re.compile(r"group \S+/group/(\d+)/(\d+)/(\d+): (?:closed with )?(\d+) member")
_WITHOUT_RE = re.compile(r"group \S+/group/(\d+)/(\d+)/\d+: closed without us")


@dataclass(frozen=True)
class Fault:
    """Break `part` of node `node` once it reports `at_step`: kill it, or stop it for
    `seconds`. A partition cuts `sides` (test bed host names) apart for `seconds`."""

    node: int
    part: Part
    kind: Literal["kill", "stop"]
    at_step: int
    seconds: float = 30.0
    sides: tuple[tuple[str, ...], ...] = ()

    @property
    def label(self) -> str:
        if self.part == "partition":
            return f"partition {'|'.join(str(len(s)) for s in self.sides)} {self.seconds:g}s"
        return (f"{self.kind} {self.part} node-{self.node}"
                + (f" {self.seconds:g}s" if self.kind == "stop" else ""))


@dataclass
class NodeEnd:
    """How one node ended."""

    name: str
    returncode: int | None
    summary: dict[str, Any] | None
    last_stderr_line: str
    log: Path


@dataclass
class ChaosResult:
    """What a chaos run saw; methods turn it into the figures and the invariant."""

    nodes: dict[str, NodeEnd]
    faults: list[tuple[Fault, float, float]]  # fault, injected at, over at (wall clock)
    timeout_s: float  # network.allreduce_timeout
    wall_s: float
    # node -> (time, step, compute utilization so far) per progress event
    progress: dict[str, list[tuple[float, int, float]]] = field(default_factory=dict)

    def violations(self) -> list[str]:
        """Broken promises: a node exiting 0 with other weights than another node exiting
        0, or exiting non-zero without a one-line reason; [] when the invariant held."""
        bad = []
        ok = {n: e.summary["outer_digest"] for n, e in self.nodes.items()
              if e.returncode == 0 and e.summary}
        if len(set(ok.values())) > 1:
            bad.append(f"exit 0 with different outer weights: {ok}")
        for n, e in self.nodes.items():
            if e.returncode == 0 and not e.summary:
                bad.append(f"{n}: exit 0 without a summary")
            if e.returncode != 0 and not e.last_stderr_line.startswith("dilonode: "):
                bad.append(f"{n}: exit {e.returncode} without a one-line reason "
                           f"(last stderr line: {e.last_stderr_line[:200]!r})")
        return bad

    def log_events(self, name: str) -> list[dict[str, Any]]:
        events = []
        for line in self.nodes[name].log.read_text(errors="replace").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                ev = json.loads(line)
                if isinstance(ev, dict) and "msg" in ev:
                    events.append(ev)
        return events

    def heal_times(self) -> list[float | None]:
        """Per fault, in order: seconds the part was down as the node's supervisor saw it
        (its "healthy again after N s" line), or None if it never healed. Partitions: from
        the heal until every node was grouped with all others again."""
        return [self._heal_time(f, t0, t1) for f, t0, t1 in self.faults]

    def dht_merge_s(self) -> list[float | None]:
        """Per fault, for partitions: seconds from the heal until every node that missed
        peers read all of them live again (its re-merge line); None otherwise or never."""
        out: list[float | None] = []
        for fault, _, t1 in self.faults:
            times = []
            for name in self.nodes if fault.part == "partition" else ():
                back = [ev["ts"] for ev in self.log_events(name)
                        if ev["ts"] >= t1 and ev["msg"].startswith("every peer seen recently")]
                times.append(min(back) - t1 if back else None)
            seen = [t for t in times if t is not None]
            out.append(max(seen) if seen and len(seen) == len(times) else None)
        return out

    def _heal_time(self, fault: Fault, t0: float, t1: float) -> float | None:
        if fault.part == "partition":  # the swarm averages as one group again
            full = [t for t, k in self._groups() if t >= t1 and k == len(self.nodes)]
            return min(full) - t1 if full else None
        part = "dht" if fault.part == "p2pd" else fault.part
        healed = re.compile(rf"^{part} is healthy again after ([\d.]+)s down")
        for ev in self.log_events(f"node-{fault.node}"):
            if ev["ts"] >= t0 and (m := healed.match(ev["msg"])):
                return float(m.group(1))
        return None

    def _groups(self) -> list[tuple[float, int]]:
        """(time, members) of every group any node closed or joined."""
        out = []
        for name in self.nodes:
            for ev in self.log_events(name):
                if m := _GROUP_RE.search(ev["msg"]):
                    out.append((ev["ts"], int(m.group(4))))
        return sorted(out)

    def rounds_lost(self, since: float = 0.0, until: float = float("inf")) -> int:
        """Rounds (fragment, round) first seen in [since, until) that did not average all
        nodes: some node's last attempt of it had fewer members (alone included)."""
        first: dict[tuple[int, int], float] = {}
        last: dict[tuple[str, int, int], tuple[int, int]] = {}
        for name in self.nodes:
            for ev in self.log_events(name):
                if not (m := _GROUP_RE.search(ev["msg"])):
                    continue
                p, r, a, k = (int(x) for x in m.groups())
                first[(p, r)] = min(first.get((p, r), ev["ts"]), ev["ts"])
                if (name, p, r) not in last or a >= last[(name, p, r)][0]:
                    last[(name, p, r)] = (a, k)
        alone = self._alone_rounds()
        return sum(since <= t < until and any(
            last.get((n, p, r), (0, 0))[1] < len(self.nodes) or (n, p, r) in alone
            for n in self.nodes) for (p, r), t in first.items())

    def _alone_rounds(self) -> set[tuple[str, int, int]]:
        """(node, fragment, round) a node went through alone (closed without it)."""
        out = set()
        for name in self.nodes:
            for ev in self.log_events(name):
                if m := _WITHOUT_RE.search(ev["msg"]):
                    out.add((name, int(m.group(1)), int(m.group(2))))
        return out

    def excess_wait_s(self, node: str, since: float, until: float) -> float:
        """Seconds `node`'s trainer waited on the network in [since, until) beyond its usual
        share: the median waiting rate between two of its progress events over the run
        (faults are short next to a run, so the median is a fault-free interval)."""
        pts = self.progress.get(node, [])
        if len(pts) < 3:
            return 0.0
        t0 = pts[0][0]
        waited = [(t, (1.0 - u) * (t - t0)) for t, _, u in pts]  # cumulative wait, approx.
        rates = sorted((w1 - w0) / (t1 - t0_) for (t0_, w0), (t1, w1)
                       in zip(waited, waited[1:], strict=False) if t1 > t0_)
        normal = rates[len(rates) // 2]
        inside = [(t, w) for t, w in waited if since <= t < until]
        if len(inside) < 2:
            return 0.0
        (ta, wa), (tb, wb) = inside[0], inside[-1]
        return max(wb - wa - normal * (tb - ta), 0.0)

    def per_fault(self) -> list[dict[str, Any]]:
        """Per fault: heal time, rounds lost and the other nodes' extra waiting in its
        window (from its injection to the next fault's, or the end)."""
        starts = [t for _, t, _ in self.faults] + [float("inf")]
        rows = []
        merged = self.dht_merge_s()
        for i, ((fault, t0, _), heal) in enumerate(zip(self.faults, self.heal_times(),
                                                        strict=True)):
            others = [n for n in self.nodes if n != f"node-{fault.node}"
                      or fault.part == "partition"]
            last = [t for t, _, _ in self.progress.get(f"node-{fault.node}", [])]
            rows.append({"fault": fault.label, "heal_s": heal, "dht_merge_s": merged[i],
                         # how long its node ran on after it (a heal needs time to show)
                         "ran_on_s": round(max(last) - t0, 1) if last else None,
                         "rounds_lost": self.rounds_lost(t0, starts[i + 1]),
                         "others_excess_wait_s": max(
                             (self.excess_wait_s(n, t0, starts[i + 1]) for n in others),
                             default=0.0)})
        return rows

    def wait_s(self) -> dict[str, float]:
        """Per node that finished: seconds its trainer waited on the network."""
        return {n: e.summary["sync_wait_s"] for n, e in self.nodes.items() if e.summary}


class _Injector:
    """Breaks parts of the swarm's node processes (see the module docstring)."""

    def __init__(self, swarm: LocalSwarm, ports: list[dict[str, int]], bed: Any = None) -> None:
        self.swarm, self.ports, self.bed = swarm, ports, bed

    def netns(self, node: int) -> list[str]:
        """The `ip netns exec NS` prefix of node `node`'s host ([] on loopback)."""
        if self.bed is None:
            return []
        return ["ip", "netns", "exec", self.bed.hosts[f"node-{node}"].netns]

    def apply(self, fault: Fault) -> None:
        """Inject `fault`; blocks for a stop's `seconds`, then undoes it."""
        if fault.part == "partition":
            self.bed.partition(*fault.sides)
            try:
                time.sleep(fault.seconds)  # the outage itself, not a synchronisation
            finally:
                self.bed.heal()
        elif fault.part in LISTENERS:
            self._listener(fault)
        else:
            self._process(fault)

    def _process(self, fault: Fault) -> None:
        pid = self.pid_of(fault.node, fault.part)
        if fault.kind == "kill":
            os.kill(pid, signal.SIGKILL)
            return
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(fault.seconds)  # the outage itself, not a synchronisation
        finally:
            with contextlib.suppress(ProcessLookupError):  # restarted (killed) meanwhile
                os.kill(pid, signal.SIGCONT)

    def pid_of(self, node: int, part: str) -> int:
        """Pid of node `node`'s DHT process or p2pd, looked up now (restarts change it)."""
        root = self.swarm.procs[node].pid
        dht = [p for p in _children(root) if any("p2pd" in _cmdline(c) for c in _children(p))]
        if not dht:
            raise RuntimeError(f"node-{node} (pid {root}) has no DHT process with a p2pd")
        if part == "dht":
            return dht[0]
        return next(c for c in _children(dht[0]) if "p2pd" in _cmdline(c))

    def _listener(self, fault: Fault) -> None:
        port = self.ports[fault.node][fault.part]
        ns = self.netns(fault.node)
        if fault.kind == "kill":
            subprocess.run([*ns, "ss", "-K", "-t", "state", "listening", f"sport = :{port}"],
                           check=True, capture_output=True, timeout=10)
            return
        rule = ["INPUT", "-p", "tcp", "--dport", str(port), "-j", "DROP"]
        subprocess.run([*ns, "iptables", "-I", *rule], check=True, timeout=10)
        try:
            time.sleep(fault.seconds)  # the outage itself, not a synchronisation
        finally:
            subprocess.run([*ns, "iptables", "-D", *rule], check=False, timeout=10)


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                stat = (entry / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
    return sorted(out)


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def run_chaos(cfg: RunConfig, nodes: int, faults: Sequence[Fault], out: Path, *,
              bed: Any = None, deadline_s: float = 900.0, gap_s: float = 0.0) -> ChaosResult:
    """Run a bootstrap and `nodes` nodes to `cfg.total_steps`, injecting `faults` in order,
    each once its node reached its step and at least `gap_s` seconds after the previous
    one ended (a stop lasts its `seconds`); `bed` (a started `Testbed` with hosts bootstrap,
    node-0..) places them in its namespaces, else everything runs on 127.0.0.1."""
    from testbed.hosts import SwarmHosts

    cfg = cfg.model_copy(update={"paths": cfg.paths.model_copy(update={"out_dir": out})})
    swarm = LocalSwarm(cfg, nodes, placement=SwarmHosts(bed) if bed is not None else None)
    ports = [{part: (7100 + 10 * i + k) if bed is not None else free_port()
              for k, part in enumerate(LISTENERS)} for i in range(nodes)]
    t0 = time.monotonic()
    try:
        swarm.start_bootstrap()
        net = cfg.network.model_copy(update={"min_peers": nodes})
        swarm.cfg_path.write_text(cfg.model_copy(update={"network": net}).model_dump_json())
        for i in range(nodes):
            swarm.start_node(i, [a for part, key in LISTENERS.items()
                                 for a in ("--set", f"{key}={ports[i][part]}")])
        seen, progress = _follow(swarm, _Injector(swarm, ports, bed), list(faults), deadline_s,
                                 gap_s)
    finally:
        swarm.stop()
    ends = {f"node-{i}": _end(swarm, i, out, seen["summaries"]) for i in range(nodes)}
    return ChaosResult(ends, seen["faults"], cfg.network.allreduce_timeout,
                       time.monotonic() - t0, progress)


def _follow(swarm: LocalSwarm, inject: _Injector, pending: list[Fault], deadline_s: float,
            gap_s: float) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """Consume the nodes' events until all ended; inject the faults one after the other
    (each on a thread of its own: a stop lasts) as their nodes report their steps."""
    seen: dict[str, Any] = {"summaries": {}, "faults": []}
    progress: dict[str, list[Any]] = {}
    steps: dict[str, int] = {}
    current: threading.Thread | None = None
    open_nodes = {f"node-{i}" for i in range(swarm.n)}
    end = time.monotonic() + deadline_s
    while open_nodes and time.monotonic() < end:
        try:
            name, ev = swarm.events.get(timeout=0.5)
        except Exception:  # queue.Empty: look at the pending faults again
            name, ev = "", {}
        kind = ev.get("event")
        if kind == "summary":
            seen["summaries"][name] = ev
        elif kind == "eof":
            open_nodes.discard(name)
        elif kind == "progress":
            # The swarm's step (the clock every node follows), so faults fall at the same
            # point of the run however fast a node's own steps are.
            steps[name] = ev.get("progress", ev["step"])
            progress.setdefault(name, []).append((time.time(), ev["step"],
                                                  ev.get("utilization", 1.0)))
        if pending and _due(pending[0], steps, current, seen["faults"], gap_s):
            current = _start_fault(inject, pending.pop(0), seen["faults"])
    if current is not None:
        current.join(timeout=120)
    return seen, progress


def _due(fault: Fault, steps: dict[str, int], current: threading.Thread | None,
         done: list[Any], gap_s: float) -> bool:
    """Whether `fault` may go now: its node is at its step, the previous one is over."""
    if current is not None and (current.is_alive() or time.time() - done[-1][2] < gap_s):
        return False
    return steps.get(f"node-{fault.node}", -1) >= fault.at_step


def _start_fault(inject: _Injector, fault: Fault, log: list[Any]) -> threading.Thread:
    def run() -> None:
        t0 = time.time()
        try:
            inject.apply(fault)
        finally:
            log.append((fault, t0, time.time()))

    thread = threading.Thread(target=run, name=f"chaos-{fault.label}", daemon=True)
    thread.start()
    return thread


def _end(swarm: LocalSwarm, i: int, out: Path, summaries: dict[str, Any]) -> NodeEnd:
    name = f"node-{i}"
    log = out / name / "stderr.log"
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return NodeEnd(name, swarm.procs[i].returncode, summaries.get(name),
                   lines[-1] if lines else "", log)
