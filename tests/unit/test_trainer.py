"""The inner loop a GPU owner expects: gradient accumulation over micro-batches that equals
one big batch, learning-rate schedules every node reads at the swarm's point (a joiner too),
an outer rate on a schedule that a joiner's replay reproduces bit for bit, and an optional
`torch.compile` that trains as the eager model does."""

from __future__ import annotations

import math

import pytest
import torch

from dilonode.algo.codecs import get_codec
from dilonode.algo.lr_schedule import lr_factor
from dilonode.algo.pacing import SwarmClock, TimePacer
from dilonode.config import load_config
from dilonode.sim.local_group import LocalGroup
from dilonode.train.data import load_data
from dilonode.train.lr import outer_lr
from dilonode.train.worker import Worker, micro_batches


def _cfg(**over: object):
    base = {"seed": 0, "total_steps": 40, "model": {"preset": "nano"},
            "data": {"seq_len": 16, "batch_size": 4, **over.pop("data", {})},
            "inner": {"lr": 1e-3, **over.pop("inner", {})},
            "diloco": {"mode": "streaming", "sync_every": 4, "num_fragments": 2,
                       "fragment_sync_delay": 1, **over.pop("diloco", {})},
            "codec": {"name": "int4"}}
    return load_config(overrides={**base, **over})


def _worker(cfg, pacer=None, group=None):
    group = group or LocalGroup(1, get_codec("int4", 64))
    return Worker(cfg, load_data(cfg.data), group.view(0), identity=0, pacer=pacer)


def test_micro_batches_add_up_to_the_whole_batch():
    whole, cut = _worker(_cfg()), _worker(_cfg(data={"micro_batch_size": 1}))
    x, y = next(whole.batches)
    loss_whole = whole._forward_backward(x, y)
    loss_cut = cut._forward_backward(x, y)
    assert float(loss_cut) == pytest.approx(float(loss_whole.detach()), abs=1e-6)
    for a, b in zip(whole.params, cut.params, strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-7, rtol=1e-5)


def test_a_micro_batch_that_does_not_divide_the_rows_is_refused():
    x = torch.zeros(6, 4, dtype=torch.long)
    assert len(micro_batches(x, x, 2)) == 3 and len(micro_batches(x, x, None)) == 1
    with pytest.raises(ValueError, match="data.micro_batch_size = 4"):
        micro_batches(x, x, 4)


def test_the_inner_rate_follows_the_schedule_over_own_steps():
    w = _worker(_cfg(inner={"schedule": "cosine", "warmup_steps": 4, "min_lr_ratio": 0.1}))
    seen = []
    for _ in range(40):
        w.train_step()
        seen.append(w.opt.param_groups[0]["lr"])
        w.launch()
        w.land()
    expect = [1e-3 * lr_factor("cosine", s, 40, 4, 0.2, 0.1) for s in range(1, 41)]
    assert seen == pytest.approx(expect)
    assert seen[-1] == pytest.approx(1e-4)


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_clock_paced_joiner_takes_the_swarms_point_of_the_schedule():
    """Paced by the swarm clock, the rate is that of the clock's reference step: a worker
    that starts 30 steps into the run (a joiner) is at step 31's rate at its first step, as
    every other node is then, not at the warm-up's start."""
    cfg = _cfg(inner={"schedule": "wsd", "warmup_steps": 5, "decay_fraction": 0.5,
                      "min_lr_ratio": 0.0, "rewarm_steps": 0},
               diloco={"pacing": "time", "step_seconds": 1.0})
    now = _Clock()
    clock = SwarmClock(t0=0.0, step_seconds=1.0)
    now.t = 30.2  # the swarm is in reference step 30 (0-based) when the joiner starts
    joiner = _worker(cfg, pacer=TimePacer(now, clock))
    joiner.launch()  # the first step boundary reads the clock
    joiner.train_step()
    assert joiner.schedule_step() == 31
    assert joiner.opt.param_groups[0]["lr"] == pytest.approx(1e-3 * lr_factor(
        "wsd", 31, 40, 5, 0.5, 0.0))
    assert joiner.opt.param_groups[0]["lr"] < 1e-3  # decaying, where own step 1 would warm up


def test_the_outer_rate_of_a_round_is_that_of_its_start_step():
    cfg = _cfg(diloco={"outer_lr_schedule": "cosine", "outer_min_lr_ratio": 0.2})
    assert outer_lr(cfg, 20) == pytest.approx(0.7 * lr_factor("cosine", 20, 40, 0, 0.2, 0.2))
    assert outer_lr(cfg, 40) == pytest.approx(0.7 * 0.2)
    assert outer_lr(_cfg(), 40) == 0.7  # constant by default


@pytest.mark.timeout(600)
def test_a_compiled_model_trains_as_the_eager_one():
    eager, compiled = _worker(_cfg()), _worker(_cfg(model={"preset": "nano", "compile": True}))
    for _ in range(2):
        a, b = eager.train_step(), compiled.train_step()
        assert math.isfinite(b) and b == pytest.approx(a, rel=1e-4, abs=1e-4)
    assert compiled.train_module is not compiled.model  # the compiled wrapper trains
