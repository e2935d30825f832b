"""The simulator: M virtual workers in one process, in lockstep, through the same `Worker`
and algorithm code the daemon runs, averaging over a `LocalGroup` that counts exactly the
payload bytes each worker would send.

`simulate(cfg)` returns a `SimReport`; `write_report` saves it as JSON, CSV and a PNG plot.
"""

from __future__ import annotations

import csv
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dilonode.algo.codecs import get_codec
from dilonode.collective import Collective, LocalGroup, PendingReduce, SyncKey
from dilonode.config import RunConfig
from dilonode.train.data import load_data
from dilonode.train.worker import Worker

__all__ = ["EvalPoint", "SimReport", "Tamper", "simulate", "write_report"]

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


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().to("cpu", torch.float32).contiguous().numpy()
                          .tobytes()).hexdigest()


class _Tampered:
    """A worker's `Collective` whose contributions pass through `tamper` first: how studies
    inject faulty or malicious workers without touching the algorithm."""

    def __init__(self, inner: Collective, worker: int, tamper: Tamper) -> None:
        self.inner, self.worker, self.tamper = inner, worker, tamper

    def begin(self, key: SyncKey, flat: torch.Tensor) -> PendingReduce:
        return self.inner.begin(key, self.tamper(self.worker, key, flat))


def _build_workers(cfg: RunConfig, data, device, tamper: Tamper | None = None) -> list[Worker]:
    group = LocalGroup(cfg.sim.workers, get_codec(cfg.codec.name, cfg.codec.block_size),
                       aggregator=cfg.aggregator.spec(), chunk_numel=cfg.network.chunk_numel,
                       align=cfg.codec.block_size)
    views: list[Collective] = [group.view(i) for i in range(cfg.sim.workers)]
    if tamper is not None:
        views = [_Tampered(v, i, tamper) for i, v in enumerate(views)]
    return [Worker(cfg, data, v, identity=i, device=device) for i, v in enumerate(views)]


def _point(workers: list[Worker], step: int, eval_loss: float, t0: float) -> EvalPoint:
    m = len(workers)
    return EvalPoint(step=step, tokens=sum(w.stats.tokens for w in workers),
                     train_loss=sum(w.stats.last_loss for w in workers) / m, eval_loss=eval_loss,
                     bytes_sent_per_worker=sum(w.stats.bytes_sent for w in workers) / m,
                     wall_s=time.perf_counter() - t0)


def simulate(cfg: RunConfig, device: torch.device | None = None,
             on_step: Callable[[int, list[Worker]], None] | None = None,
             on_eval: Callable[[EvalPoint], None] | None = None,
             tamper: Tamper | None = None) -> SimReport:
    """Train `cfg.sim.workers` workers for `cfg.total_steps` inner steps each.

    `tamper`, when given, rewrites every contribution before it is averaged (fault studies).
    """
    data = load_data(cfg.data)
    workers = _build_workers(cfg, data, device, tamper)
    eval_batches = data.eval_batches(cfg.data.seq_len, cfg.data.batch_size, cfg.data.eval_batches)
    history: list[EvalPoint] = []
    t0 = time.perf_counter()
    for step in range(1, cfg.total_steps + 1):
        for w in workers:
            w.train_step()
        for w in workers:
            w.launch()
        for w in workers:
            w.land()
        if step == cfg.total_steps:
            for w in workers:
                w.drain()
        if on_step:
            on_step(step, workers)
        if step % cfg.eval_every == 0 or step == cfg.total_steps:
            history.append(_point(workers, step, workers[0].evaluate(eval_batches), t0))
            if on_eval:
                on_eval(history[-1])
    return _report(cfg, workers, history, time.perf_counter() - t0)


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
