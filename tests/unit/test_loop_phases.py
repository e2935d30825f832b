"""The training loop's account of where its training steps' time went (`LoopReport.phases`):
each phase measured by the loop or the worker, together no more than `train_s`, and the
summary a node writes carrying them."""

from __future__ import annotations

import threading
import time

from dilonode.algo.codecs import get_codec
from dilonode.node.summary import NodeSummary
from dilonode.sim.local_group import LocalGroup
from dilonode.train.data import load_data
from dilonode.train.loop import PHASES, train_loop
from dilonode.train.worker import Worker
from tests.support.config import nano_config


def _worker() -> tuple[Worker, list]:
    """A lone worker of 12 steps' run, H = 4 over two fragments, and its eval batches."""
    cfg = nano_config(data={"seq_len": 16, "batch_size": 2, "eval_batches": 2},
                      diloco={"sync_every": 4, "num_fragments": 2}, codec={"name": "int4"})
    data = load_data(cfg.data)
    group = LocalGroup(1, get_codec(cfg.codec.name, cfg.codec.block_size))
    return Worker(cfg, data, group.view(0), identity=0), data.eval_batches(16, 2, 1)


def test_phases_cover_the_training_steps_and_reach_the_summary():
    worker, batches = _worker()
    hooked: list[int] = []
    rep = train_loop(worker, 12, 100, batches, threading.Event(),
                     on_step=lambda w, _r: hooked.append(w.step))
    ph = rep.phases
    assert set(ph) == set(PHASES) and hooked == list(range(1, 13))
    # 12 steps, H = 4, two fragments: rounds started and applied inside the loop.
    assert ph["step_s"] > 0 and ph["start_s"] > 0 and ph["apply_s"] > 0
    assert ph["step_s"] == rep.step_s and ph["hooks_s"] >= 0 and ph["train_cpu_s"] > 0
    assert ph["step_s"] + ph["start_s"] + ph["apply_s"] + ph["wait_s"] + ph["hooks_s"] \
        <= rep.train_s
    # The end-of-run rounds come after the training steps: counted by the worker, not here.
    assert worker.stats.apply_s > ph["apply_s"]
    summary = NodeSummary.of_run(rep, worker, peer_id="p", worker_id="w")
    assert summary.phases == {k: round(v, 4) for k, v in ph.items()}


def test_time_spent_catching_up_between_steps_counts_against_utilization():
    # The state keeper fetches the swarm's state between steps (inside the hook) and adds
    # the time to `catch_up_s`: training stood still, as when waiting on a round's result.
    worker, batches = _worker()

    def fetch_state(w: Worker, _rep: object) -> None:
        if w.step == 6:  # one catch-up, 50 ms of wall time in which nothing trains
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 0.05:
                pass
            w.stats.catch_up_s += time.perf_counter() - t0

    rep = train_loop(worker, 12, 100, batches, threading.Event(),
                     on_step=fetch_state)
    assert rep.catch_up_s == worker.stats.catch_up_s >= 0.05
    assert rep.compute_utilization == 1.0 - (rep.sync_wait_s + rep.catch_up_s) / rep.wall_s
    assert rep.compute_utilization < 1.0 - rep.sync_wait_s / rep.wall_s
    summary = NodeSummary.of_run(rep, worker, peer_id="p", worker_id="w")
    assert summary.catch_up_s == round(rep.catch_up_s, 3)
    assert summary.compute_utilization == rep.compute_utilization


def test_the_summary_splits_each_fragments_round_latency_into_forming_groups_and_the_rest():
    from dilonode.collective import RoundReport

    worker, batches = _worker()
    rep = train_loop(worker, 4, 100, batches, threading.Event())
    worker.stats.latency.clear()
    worker.stats.forming.clear()
    for latency, forming in ((4.0, 1.0), (6.0, 3.0)):
        worker.stats.record(0, RoundReport(2, 0, 0, latency_s=latency, forming_s=forming))
    summary = NodeSummary.of_run(rep, worker, peer_id="p", worker_id="w")
    assert summary.round_latency_s[0] == {"n": 2, "mean": 5.0, "max": 6.0,
                                          "forming_mean": 2.0}
