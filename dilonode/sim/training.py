"""The simulator: M virtual workers in one process, through the same `Worker` and algorithm
code the daemon runs, averaging over a `LocalGroup` that counts exactly the payload bytes
each worker would send.

Equally fast workers run in lockstep. With `sim.speeds` (or a modelled `sim.latency`) they
run on a virtual clock instead (`_VirtualRun`): each worker's inner step lasts `1 / speed`
virtual seconds (one reference step for speed 1), events are processed in time order, a
worker whose result is not there waits (that time counts as blocked on the network), and a
round's result reaches its members `latency` after its last contribution. The daemon reads
the wall clock where the simulator reads this one, so a study of 16 workers whose speeds
span 10x runs in one process on the code the swarm runs.

`simulate(cfg)` returns a `SimReport`; `write_report` saves it as JSON, CSV and a PNG plot.
"""

from __future__ import annotations

import csv
import hashlib
import heapq
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dilonode.algo.codecs import get_codec, part_align
from dilonode.algo.mixing import spread
from dilonode.algo.pacing import Pacer, StepPacer, SwarmClock, TimePacer
from dilonode.algo.sliced_encoding import SplicedEncoding
from dilonode.collective import Collective, PendingReduce, RoundRequest, StateSource, SyncKey
from dilonode.config import RunConfig
from dilonode.sim.local_group import LocalGroup
from dilonode.train.data import load_data
from dilonode.train.worker import Worker

__all__ = ["EvalPoint", "SimReport", "Tamper", "end_in_agreement", "replay_traces", "simulate",
           "write_report"]

# (worker index, what is being averaged, the worker's flat tensor) -> what it contributes.
Tamper = Callable[[int, SyncKey, torch.Tensor], torch.Tensor]


@dataclass
class EvalPoint:
    step: int
    tokens: int  # all workers together
    train_loss: float  # mean over workers of the last inner step
    eval_loss: float  # outer weights on the held-out split
    bytes_sent_per_worker: float  # cumulative payload bytes, mean over workers
    wall_s: float
    virtual_s: float = 0.0  # simulated time (reference steps): lockstep, the step


@dataclass
class SimReport:
    mode: str
    workers: int
    steps: int
    codec: str
    sync_every: int
    num_fragments: int
    fragment_sync_delay: int
    fragment_update_alpha: float
    final_eval_loss: float
    tokens: int
    bytes_sent_per_worker: float
    peak_sync_bytes: int
    rounds_per_fragment: dict[int, int]
    outer_digest: str  # sha256 of worker 0's outer weights; identical on all workers
    workers_agree: bool
    wall_s: float
    history: list[EvalPoint] = field(default_factory=list)
    # Per worker: steps, tokens, rounds it took part in, missed, waited-for share.
    worker_stats: list[dict[str, float]] = field(default_factory=list)
    pacing: str = "steps"
    virtual_s: float = 0.0  # simulated duration (reference steps)
    # Grouped swarms: the replicas' spread at the end (max relative L2 distance from their
    # mean) before they adopt the state that stands; 0 when they already held one state.
    replica_spread: float = 0.0


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().to("cpu", torch.float32).contiguous().numpy()
                          .tobytes()).hexdigest()


class _Tampered:
    """A worker's `Collective` whose contributions pass through `tamper` first: how studies
    inject faulty or malicious workers without touching the algorithm."""

    def __init__(self, inner: Collective, worker: int, tamper: Tamper) -> None:
        self.inner, self.worker, self.tamper = inner, worker, tamper

    def begin(self, request: RoundRequest, flat: torch.Tensor, *,
              encoded: SplicedEncoding | None = None,
              state: StateSource | None = None) -> PendingReduce:
        """The inner `begin` on the tampered values; `encoded` (the untampered values'
        encoding) is dropped, so the tampered values are what gets averaged."""
        tampered = self.tamper(self.worker, request.key, flat)
        return self.inner.begin(request, tampered, state=state)


class _Clock:
    """The virtual time a pacer reads: the lockstep step, or the current worker's time."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t


def _pacer(cfg: RunConfig, now: Callable[[], float]) -> Pacer:
    if cfg.diloco.pacing == "steps" or cfg.diloco.mode == "ddp":
        return StepPacer()
    return TimePacer(now, SwarmClock(t0=0.0, step_seconds=1.0))


# (workers, codec, aggregator=, chunk_numel=, align=) -> the group the workers average in:
# `LocalGroup`, or a subclass (benchmarks/gpu/quality.py averages on the GPU).
GroupFactory = Callable[..., LocalGroup]


def _build_workers(cfg: RunConfig, data, device, tamper: Tamper | None = None,
                   clocks: list[Callable[[], float]] | None = None,
                   group_factory: GroupFactory = LocalGroup,
                   ) -> tuple[list[Worker], LocalGroup]:
    net = cfg.network
    codec = get_codec(cfg.codec.wire_name, cfg.codec.block_size)
    group = group_factory(cfg.sim.workers, codec,
                          aggregator=cfg.aggregator.spec(), chunk_numel=net.chunk_numel,
                          align=part_align(codec, cfg.codec.block_size),
                          max_group_size=net.max_group_size,
                          mix_every=net.mix_state_every, run_id=cfg.run_id)
    views: list[Collective] = [group.view(i) for i in range(cfg.sim.workers)]
    if tamper is not None:
        views = [_Tampered(v, i, tamper) for i, v in enumerate(views)]
    workers = [Worker(cfg, data, v, identity=i, device=device,
                      pacer=_pacer(cfg, clocks[i]) if clocks else None)
               for i, v in enumerate(views)]
    for w in workers:
        w.end_step = cfg.total_steps
    return workers, group


def _point(workers: list[Worker], step: int, eval_loss: float, t0: float,
           virtual_s: float) -> EvalPoint:
    m = len(workers)
    return EvalPoint(step=step, tokens=sum(w.stats.tokens for w in workers),
                     train_loss=sum(w.stats.last_loss for w in workers) / m, eval_loss=eval_loss,
                     bytes_sent_per_worker=sum(w.stats.bytes_sent for w in workers) / m,
                     wall_s=time.perf_counter() - t0, virtual_s=virtual_s)


def simulate(cfg: RunConfig, device: torch.device | None = None,
             on_step: Callable[[int, list[Worker]], None] | None = None,
             on_eval: Callable[[EvalPoint], None] | None = None,
             tamper: Tamper | None = None, virtual: bool | None = None,
             group_factory: GroupFactory = LocalGroup) -> SimReport:
    """Train `cfg.sim.workers` workers for `cfg.total_steps` (reference) steps.

    `tamper`, when given, rewrites every contribution before it is averaged (fault studies).
    `virtual` runs on the virtual clock even with equal speeds (default: only with
    `sim.speeds` or `sim.latency`); `on_step` is then called once, at the end.
    `group_factory` makes the group the workers average in (default `LocalGroup`).
    """
    if virtual is None:
        virtual = cfg.sim.speeds is not None or cfg.sim.latency > 0
    if virtual and cfg.diloco.mode == "ddp":
        raise ValueError("sim.speeds / sim.latency: mode=ddp runs in lockstep only")
    data = load_data(cfg.data)
    eval_batches = data.eval_batches(cfg.data.seq_len, cfg.data.batch_size, cfg.data.eval_batches)
    t0 = time.perf_counter()
    if virtual:
        run = _VirtualRun(cfg, data, device, tamper, eval_batches, on_eval, group_factory)
        workers, history = run.run()
        if on_step:
            on_step(cfg.total_steps, workers)
        report = _report(cfg, workers, history, time.perf_counter() - t0)
        report.worker_stats = run.worker_stats()
        report.virtual_s = max(r.t for r in run.runs)
        report.replica_spread = run.spread
        return report
    workers, history, spread_at_end = _lockstep(cfg, data, device, tamper, eval_batches,
                                                on_step, on_eval, t0, group_factory)
    report = _report(cfg, workers, history, time.perf_counter() - t0)
    report.worker_stats = [_worker_stats(w, 0.0, float(cfg.total_steps)) for w in workers]
    report.virtual_s = float(cfg.total_steps)
    report.replica_spread = spread_at_end
    return report


def _lockstep(cfg: RunConfig, data, device, tamper: Tamper | None, eval_batches,
              on_step: Callable[[int, list[Worker]], None] | None,
              on_eval: Callable[[EvalPoint], None] | None,
              t0: float, group_factory: GroupFactory = LocalGroup,
              ) -> tuple[list[Worker], list[EvalPoint], float]:
    """Equally fast workers: each phase of a step for all workers before the next phase
    (every worker begins a round before anyone waits on it). Also returns the replicas'
    spread before the end-of-run agreement (grouped swarms)."""
    clock = _Clock()
    spread_at_end = 0.0
    workers, _ = _build_workers(cfg, data, device, tamper, [clock.now] * cfg.sim.workers,
                                group_factory)
    history: list[EvalPoint] = []
    for step in range(1, cfg.total_steps + 1):
        clock.t = float(step)
        for phase in (Worker.train_step, Worker.launch, Worker.land):
            for w in workers:
                phase(w)
        if step == cfg.total_steps:
            spread_at_end = _finish_lockstep(workers)
        if on_step:
            on_step(step, workers)
        if step % cfg.eval_every == 0 or step == cfg.total_steps:
            history.append(_point(workers, step, workers[0].evaluate(eval_batches), t0,
                                  float(step)))
            if on_eval:
                on_eval(history[-1])
    return workers, history, spread_at_end


def _finish_lockstep(workers: list[Worker]) -> float:
    """Land what is in flight, then the end-of-run rounds (and, in a grouped swarm, the
    end-of-run mixing rounds): all begin before anyone waits."""
    for w in workers:
        w.drain()
    for w in workers:
        w.start_final()
    for w in workers:
        w.drain()
    while any(w.final_mix_due() for w in workers):
        for w in workers:
            if w.final_mix_due():
                w.start_mix()
        for w in workers:
            w.drain()
    return end_in_agreement(workers)


def end_in_agreement(workers: list[Worker]) -> float:
    """The daemon's end-of-run check, in process: every worker adopts the outer state most
    of them hold (then most tokens, then the lowest index; `swarm/agreement.py`). Only a
    grouped swarm ends with different states; returns their spread before (max relative
    L2 distance from the mean, `algo.mixing.spread`)."""
    if not workers or workers[0].plan is None:
        return 0.0
    flats = [w.outer_flat() for w in workers]
    digests = [_digest(f) for f in flats]
    if len(set(digests)) == 1:
        return 0.0
    worst, _ = spread(flats)
    holders: dict[str, list[int]] = {}
    for i, d in enumerate(digests):
        holders.setdefault(d, []).append(i)
    best = min(holders, key=lambda d: (-len(holders[d]),
                                       -sum(workers[i].stats.tokens for i in holders[d]),
                                       holders[d][0]))
    src = workers[holders[best][0]]
    for i, w in enumerate(workers):
        if digests[i] != best:
            w.adopt_outer(src)
    return worst


def _worker_stats(w: Worker, blocked_s: float, duration: float) -> dict[str, float]:
    st = w.stats
    return {"steps": st.steps, "tokens": st.tokens, "rounds": sum(st.rounds.values()),
            "alone": st.alone, "missed": st.missed, "late": st.late,
            "utilization": 1.0 - blocked_s / duration if duration > 0 else 0.0}


@dataclass
class _Timed:
    """One worker on the virtual clock."""

    worker: Worker
    step_time: float  # virtual seconds per inner step
    t: float = 0.0
    blocked_s: float = 0.0
    finished: bool = False


# What a worker's driver hands the scheduler: None (continue at its time) or the results
# it must wait for.
_Wait = list[PendingReduce] | None


class _VirtualRun:
    """Workers of different speeds on one virtual clock (see the module docstring)."""

    def __init__(self, cfg: RunConfig, data, device, tamper: Tamper | None,
                 eval_batches, on_eval: Callable[[EvalPoint], None] | None,
                 group_factory: GroupFactory = LocalGroup) -> None:
        self.cfg = cfg
        speeds = cfg.sim.speeds or (1.0,) * cfg.sim.workers
        self.runs: list[_Timed] = []
        clocks = [lambda i=i: self.runs[i].t for i in range(cfg.sim.workers)]
        workers, self.group = _build_workers(cfg, data, device, tamper, clocks, group_factory)
        self.runs = [_Timed(w, 1.0 / v) for w, v in zip(workers, speeds, strict=True)]
        self.current = self.runs[0]
        self.group.now = lambda: self.current.t
        self.group.latency = cfg.sim.latency
        self.eval_batches, self.on_eval = eval_batches, on_eval
        self.history: list[EvalPoint] = []
        self.t0 = time.perf_counter()
        self.spread = 0.0  # replicas' spread before the end-of-run adoption

    def run(self) -> tuple[list[Worker], list[EvalPoint]]:
        drivers = [self._drive(r) for r in self.runs]
        ready = [(0.0, i) for i in range(len(self.runs))]
        parked: dict[int, list[PendingReduce]] = {}
        next_eval = float(self.cfg.eval_every)
        while ready or parked:
            if not ready:
                raise RuntimeError(f"simulation deadlock: workers {sorted(parked)} wait for "
                                   "rounds nobody else will contribute to")
            t, i = heapq.heappop(ready)
            while next_eval <= t and next_eval < self.cfg.total_steps:
                self._evaluate(next_eval)
                next_eval += self.cfg.eval_every
            self.current = run = self.runs[i]
            try:
                wait = next(drivers[i])
            except StopIteration:
                run.finished = True
            else:
                if wait is None or all(h.done() for h in wait):
                    heapq.heappush(ready, (run.t, i))
                else:
                    parked[i] = wait
            for j in [j for j, hs in parked.items() if all(_arrival(h) is not None
                                                            for h in hs)]:
                hs = parked.pop(j)
                arrive = max(_arrival(h) or 0.0 for h in hs)
                self.runs[j].blocked_s += max(arrive - self.runs[j].t, 0.0)
                self.runs[j].t = max(arrive, self.runs[j].t)
                heapq.heappush(ready, (self.runs[j].t, j))
        self._evaluate(max(r.t for r in self.runs), final=True)
        return [r.worker for r in self.runs], self.history

    def _drive(self, run: _Timed) -> Iterator[_Wait]:
        """One worker's life: the daemon's training loop, with waits handed to the
        scheduler instead of blocking (`Worker.blocking` says what would block)."""
        w = run.worker
        while True:
            w.train_step()
            run.t += run.step_time
            yield None  # later workers' earlier events go first
            due = w.due()
            if wait := w.blocking(due):
                yield wait
            w.start_due(due)
            if wait := w.blocking():
                yield wait
            w.land()
            if w.at_end():
                break
        w.start_final()  # fragments with no round in flight, as `Worker.final_sync`
        if wait := w.unfinished():
            yield wait
        w.drain()
        w.start_final()  # those whose rounds were in flight
        if wait := w.unfinished():
            yield wait
        w.drain()
        while w.final_mix_due():
            w.start_mix()
            yield None  # the others start theirs before anyone waits
            if wait := w.unfinished():
                yield wait
            w.drain()
        if all(r.finished or r is run for r in self.runs):
            self.spread = end_in_agreement([r.worker for r in self.runs])

    def _evaluate(self, at: float, final: bool = False) -> None:
        workers = [r.worker for r in self.runs]
        step = self.cfg.total_steps if final else int(at)
        self.history.append(_point(workers, step, workers[0].evaluate(self.eval_batches),
                                   self.t0, at))
        if self.on_eval:
            self.on_eval(self.history[-1])

    def worker_stats(self) -> list[dict[str, float]]:
        return [_worker_stats(r.worker, r.blocked_s, r.t) for r in self.runs]


def replay_traces(cfgs: list[RunConfig], traces: list[list[dict]], steps: list[int],
                  device: torch.device | None = None,
                  peers: list[str] | None = None) -> list[Worker]:
    """Re-run a networked run's schedule in process: worker i (config `cfgs[i]`, identity i)
    trains `steps[i]` inner steps and starts and lands rounds exactly where node i's
    recorded `trace` (`Worker.trace`) says, averaging over a `LocalGroup` of all workers.
    Every recorded round must have had every worker in its group (the caller checks).
    `peers[i]`: node i's peer id, which orders each round's sum as the node's group did
    (its trace's `members`); float sums depend on the order. Returns the workers: their
    outer weights are what the nodes should hold."""
    data = [load_data(c.data) for c in cfgs]
    codec = get_codec(cfgs[0].codec.wire_name, cfgs[0].codec.block_size)
    group = LocalGroup(len(cfgs), codec, aggregator=cfgs[0].aggregator.spec(),
                       chunk_numel=cfgs[0].network.chunk_numel,
                       align=part_align(codec, cfgs[0].codec.block_size))
    if peers is not None:
        index = {peer: i for i, peer in enumerate(peers)}
        for event in (e for t in traces for e in t if e.get("members")):
            key = SyncKey("fragment", int(event["fragment"]), int(event["round"]))
            group.orders[key] = [index[m] for m in event["members"]]
    workers = [Worker(c, d, group.view(i), identity=i, device=device)
               for i, (c, d) in enumerate(zip(cfgs, data, strict=True))]
    drivers = [_replay(w, t, n) for w, t, n in zip(workers, traces, steps, strict=True)]
    parked: dict[int, PendingReduce] = {}
    live = set(range(len(workers)))
    while live:
        progressed = False
        for i in sorted(live):
            if i in parked and not parked[i].done():
                continue
            parked.pop(i, None)
            try:
                wait = next(drivers[i])
            except StopIteration:
                live.discard(i)
            else:
                if wait is not None:
                    parked[i] = wait
            progressed = True
        if not progressed:
            raise RuntimeError(f"replay deadlock: workers {sorted(parked)} wait for rounds "
                               "the others never start (a trace with a smaller group?)")
    return workers


def _replay(w: Worker, trace: list[dict], steps: int) -> Iterator[PendingReduce | None]:
    events = iter(trace)
    nxt = next(events, None)
    while True:
        while nxt is not None and nxt["step"] == w.step:
            p, r = int(nxt["fragment"]), int(nxt["round"])
            if nxt["event"] == "start":
                w.start_round(p, r)
                yield None  # let the others contribute before anyone waits
            else:
                pending = w.frags[p].pending
                assert pending is not None, f"trace lands fragment {p}, which has no round"
                if not pending.handle.done():
                    yield pending.handle
                w.land_round(p)
            nxt = next(events, None)
        if w.step >= steps:
            break
        w.train_step()
        yield None
    if nxt is not None:
        raise ValueError(f"trace event {nxt} after the last step {steps}")


def _arrival(handle: PendingReduce) -> float | None:
    done_at = getattr(handle, "done_at", None)
    return done_at() if done_at is not None else 0.0


def _report(cfg: RunConfig, workers: list[Worker], history: list[EvalPoint],
            wall: float) -> SimReport:
    a = cfg.diloco.effective()
    digests = [_digest(w.outer_flat()) for w in workers]
    last = history[-1]
    return SimReport(
        mode=a.mode, workers=len(workers), steps=cfg.total_steps, codec=cfg.codec.name,
        sync_every=a.sync_every, num_fragments=a.num_fragments,
        fragment_sync_delay=a.fragment_sync_delay,
        fragment_update_alpha=a.fragment_update_alpha, final_eval_loss=last.eval_loss,
        pacing=a.pacing,
        tokens=last.tokens, bytes_sent_per_worker=last.bytes_sent_per_worker,
        peak_sync_bytes=max(w.stats.peak_sync_bytes for w in workers),
        rounds_per_fragment=dict(sorted(workers[0].stats.rounds.items())),
        outer_digest=digests[0], workers_agree=len(set(digests)) == 1, wall_s=wall,
        history=history)


def write_report(report: SimReport, out_dir: Path) -> dict[str, Path]:
    """Write report.json, history.csv and loss.png under `out_dir`; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "report.json", "csv": out_dir / "history.csv",
             "png": out_dir / "loss.png"}
    paths["json"].write_text(json.dumps(asdict(report), indent=2) + "\n")
    with paths["csv"].open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(asdict(report.history[0])))
        writer.writeheader()
        writer.writerows(asdict(p) for p in report.history)
    plot_histories({f"{report.mode} ({report.codec})": report.history}, paths["png"])
    return paths


def plot_histories(histories: dict[str, list[EvalPoint]], path: Path) -> None:
    """Eval loss and cumulative bytes per worker against tokens, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_bytes) = plt.subplots(1, 2, figsize=(11, 4))
    for label, hist in histories.items():
        tokens = [p.tokens for p in hist]
        ax_loss.plot(tokens, [p.eval_loss for p in hist], marker=".", label=label)
        ax_bytes.plot(tokens, [max(p.bytes_sent_per_worker, 1.0) for p in hist], label=label)
    ax_loss.set(xlabel="tokens (all workers)", ylabel="eval loss (outer weights)")
    ax_bytes.set(xlabel="tokens (all workers)", ylabel="bytes sent per worker", yscale="log")
    for ax in (ax_loss, ax_bytes):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
