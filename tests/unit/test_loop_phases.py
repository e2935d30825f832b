"""The training loop's account of where its training steps' time went (`LoopReport.phases`):
each phase measured by the loop or the worker, together no more than `train_s`, and the
summary a node writes carrying them."""

from __future__ import annotations

import threading

from dilonode.algo.codecs import get_codec
from dilonode.node.summary import NodeSummary
from dilonode.sim.local_group import LocalGroup
from dilonode.train.data import load_data
from dilonode.train.loop import PHASES, train_loop
from dilonode.train.worker import Worker
from tests.support.config import nano_config


def test_phases_cover_the_training_steps_and_reach_the_summary():
    cfg = nano_config(data={"seq_len": 16, "batch_size": 2, "eval_batches": 2},
                      diloco={"sync_every": 4, "num_fragments": 2}, codec={"name": "int4"})
    data = load_data(cfg.data)
    group = LocalGroup(1, get_codec(cfg.codec.name, cfg.codec.block_size))
    worker = Worker(cfg, data, group.view(0), identity=0)
    hooked: list[int] = []
    rep = train_loop(worker, 12, 100, data.eval_batches(16, 2, 1), threading.Event(),
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
