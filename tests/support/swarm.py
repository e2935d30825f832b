"""Local swarms of real processes on 127.0.0.1 for integration tests: a bootstrap peer and
`dilonode run` nodes, their JSON events read with deadlines, and the end-of-run invariant.

    end = run_swarm(nano_config(tmp_path, ...), 3)       # start, follow to the end, stop
    assert end.codes == [0, 0, 0]
    assert_one_model(end.summaries)

`run_swarm`/`run_to_end` run a `LocalSwarm` to its end; `local_swarm` only guarantees the
teardown, for tests that drive a swarm step by step (`SwarmEvents` reads its events, kept by
process name). `nodes_by_hand` is a bootstrap for nodes a test starts one at a time, each a
`NodeProcess` (its own event queue, its stderr in `n{i}.log`), for tests that signal, freeze
or kill single nodes. `assert_one_model` is the swarm-level invariant: one model, and every
node that ran to the end says so.
"""

from __future__ import annotations

import contextlib
import json
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dilonode.cli.local_swarm import LocalSwarm, Placement
from dilonode.config import RunConfig

__all__ = ["NodeProcess", "NodesByHand", "SwarmEnd", "SwarmEvents", "assert_one_model",
           "config_file", "local_swarm", "nodes_by_hand", "run_swarm", "run_to_end"]

Event = dict[str, Any]


def config_file(cfg: RunConfig, name: str = "cfg.json") -> Path:
    """Write `cfg` as the JSON a `dilonode run --config` reads, into its out_dir."""
    path = Path(cfg.paths.out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(cfg.model_dump_json())
    return path


class NodeProcess:
    """A `dilonode run` child, worker id `i`, writing to `tmp/node-{i}` (stderr:
    `tmp/n{i}.log`); a thread queues the JSON events of its stdout."""

    def __init__(self, tmp: Path, cfg_path: Path, maddrs: Sequence[str], i: int,
                 *extra: str) -> None:
        self.out = tmp / f"node-{i}"
        self.log = tmp / f"n{i}.log"
        self.events: queue.Queue[Event] = queue.Queue()
        with self.log.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dilonode.cli", "run", "--config", str(cfg_path),
                 "--worker-id", str(i), "--out", str(self.out), "--log-format", "json",
                 "--initial-peers", *maddrs, *extra],
                stdout=subprocess.PIPE, stderr=err, text=True)
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.events.put(json.loads(line))
            except json.JSONDecodeError:
                continue
        self.events.put({"event": "eof"})

    def wait_for(self, event: str, timeout: float, min_step: int = 0,
                 until: Callable[[Event], bool] = lambda ev: True) -> Event:
        """The next `event` at step `min_step` or later for which `until` holds; fails when
        the node's output ends first or after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                ev = self.events.get(timeout=left)
            except queue.Empty:
                break
            if ev.get("event") == "eof":
                break
            if ev.get("event") == event and ev.get("step", 0) >= min_step and until(ev):
                return ev
        raise AssertionError(f"{self.out.name}: no {event!r} (step >= {min_step}) within "
                             f"{timeout} s")

    def kill(self) -> None:
        """SIGKILL the node if it still runs (frozen ones too), and reap it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=10)


class NodesByHand:
    """A started bootstrap peer and the nodes a test starts on it one at a time, on the
    config written to `cfg.json` in the run's out_dir."""

    def __init__(self, swarm: LocalSwarm, cfg_path: Path) -> None:
        self.swarm, self.cfg_path = swarm, cfg_path
        self.nodes: list[NodeProcess] = []

    @property
    def maddrs(self) -> list[str]:
        return self.swarm.maddrs

    def start(self, i: int, *extra: str) -> NodeProcess:
        """Start node `i` (worker id i) with `extra` args (`NodeProcess`)."""
        node = NodeProcess(self.swarm.out, self.cfg_path, self.maddrs, i, *extra)
        self.nodes.append(node)
        return node


@contextlib.contextmanager
def nodes_by_hand(cfg: RunConfig) -> Iterator[NodesByHand]:
    """A bootstrap peer on 127.0.0.1 for nodes started by hand; when the block ends, every
    node still running is killed and the bootstrap stopped."""
    swarm = LocalSwarm(cfg, 0)
    try:
        swarm.start_bootstrap()
        hand = NodesByHand(swarm, config_file(cfg))
        try:
            yield hand
        finally:
            for node in hand.nodes:
                node.kill()
    finally:
        swarm.stop()


@contextlib.contextmanager
def local_swarm(cfg: RunConfig, nodes: int = 0, *, forever: bool = False,
                placement: Placement | None = None) -> Iterator[LocalSwarm]:
    """A `LocalSwarm` not yet started, stopped (every child) when the block ends."""
    swarm = LocalSwarm(cfg, nodes, forever, placement=placement)
    try:
        yield swarm
    finally:
        swarm.stop()


@dataclass
class SwarmEnd:
    """How a swarm run ended: the nodes' summaries by name, their exit codes by index."""

    summaries: dict[str, Event]
    codes: list[int | None]


def run_to_end(swarm: LocalSwarm, extra: dict[int, list[str]] | None = None,
               on_event: Callable[[str, Event], None] | None = None) -> SwarmEnd:
    """Start `swarm`'s bootstrap and nodes (node i with `extra[i]` args too), follow them
    until every node's output ends (`on_event` sees each event), then stop the swarm."""
    try:
        swarm.start_bootstrap()
        swarm.start_nodes(extra)
        summaries = swarm.follow(on_event)
    finally:
        swarm.stop()
    return SwarmEnd(summaries, [p.returncode for p in swarm.procs])


def run_swarm(cfg: RunConfig, nodes: int, extra: dict[int, list[str]] | None = None
              ) -> SwarmEnd:
    """A bootstrap and `nodes` nodes on 127.0.0.1 run to `cfg.total_steps` (`run_to_end`)."""
    return run_to_end(LocalSwarm(cfg, nodes), extra)


class SwarmEvents:
    """The events of a swarm's processes (`LocalSwarm.events`), consumed with deadlines
    and kept by process name."""

    def __init__(self, swarm: LocalSwarm) -> None:
        self.swarm = swarm
        self.by_name: dict[str, list[Event]] = {}

    def _take(self, deadline: float) -> tuple[str, Event] | None:
        """The next event (recorded), or None once `deadline` passed without one."""
        try:
            name, ev = self.swarm.events.get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
            return None
        self.by_name.setdefault(name, []).append(ev)
        return name, ev

    def _seen(self) -> dict[str, int]:
        return {n: len(v) for n, v in self.by_name.items()}

    def next(self, pred: Callable[[str, Event], bool], timeout: float,
             what: str) -> tuple[str, Event]:
        """The next (name, event) for which `pred` holds; fails when a process's output
        ends first or after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while (got := self._take(deadline)) is not None:
            name, ev = got
            if ev.get("event") == "eof":
                raise AssertionError(f"{name} exited while waiting for {what} "
                                     f"(see {self.swarm.out / name / 'stderr.log'})")
            if pred(name, ev):
                return name, ev
        raise AssertionError(f"no {what} within {timeout} s")

    def progress(self, node: str, timeout: float = 120) -> Event:
        """The next progress event of `node`."""
        return self.next(lambda n, e: n == node and e.get("event") == "progress", timeout,
                         f"progress of {node}")[1]

    def until(self, done: Callable[[], object], timeout: float, what: str) -> None:
        """Read events (any process's, ends included) until `done()`; fails naming `what`
        after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not done():
            if self._take(deadline) is None:
                raise AssertionError(f"{what}: not within {timeout:.0f} s; seen "
                                     f"{self._seen()}")

    def until_progress(self, check: Callable[[], Any], node: str, timeout: float,
                       what: str) -> Any:
        """Re-evaluate `check()` after each progress event of `node` until it is truthy;
        its value."""
        deadline = time.monotonic() + timeout
        while not (value := check()):
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} not reached within {timeout} s")
            self.progress(node)
        return value

    def first(self, name: str, kind: str) -> Event | None:
        """The first `kind` event `name` printed so far."""
        return next((ev for ev in self.by_name.get(name, []) if ev.get("event") == kind), None)

    def step(self, name: str) -> int:
        """The highest step `name`'s progress events reported so far (0: none yet)."""
        steps = [ev["step"] for ev in self.by_name.get(name, []) if ev.get("event") == "progress"]
        return max(steps, default=0)


def assert_one_model(summaries: Mapping[str, Event] | Iterable[Event]) -> str:
    """The swarm ended as one model: every node ran to the end of the run, its summary names
    the same outer digest as the others', and its end-of-run agreement check found that its
    peers hold those weights. `summaries` by node name, or a sequence (named by worker id).
    Returns the digest."""
    named = (dict(summaries) if isinstance(summaries, Mapping)
             else {str(s.get("worker_id", i)): s for i, s in enumerate(summaries)})
    assert named, "no node summary to compare"
    digests = {n: str(s["outer_digest"]) for n, s in sorted(named.items())}
    assert len(set(digests.values())) == 1, "nodes disagree: " + ", ".join(
        f"{n} {d[:12]} (dropped {named[n].get('dropped_peers', [])[-3:]})"
        for n, d in digests.items())
    for name, s in sorted(named.items()):
        assert not s.get("stopped_early"), f"{name} stopped before the end of the run"
        verdict = s.get("agreement") or {}
        assert verdict.get("agrees") is True, \
            f"{name}: the end-of-run check did not agree: {verdict.get('line', verdict)}"
    return next(iter(digests.values()))
