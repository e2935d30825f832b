"""Adopting a state (a join, a re-sync) does not spike the loss: a worker that has trained
keeps its AdamW moments, a fresh one warms its learning rate up again. Measured side by side
with the naive way (a fresh AdamW at full learning rate), on the held-out loss of the
worker's own weights, which a training batch's loss is too noisy to show."""

from __future__ import annotations

import pytest
import torch

from dilonode.algo.codecs import get_codec
from dilonode.sim.local_group import LocalGroup
from dilonode.sim.training import simulate
from dilonode.train.data import load_data
from dilonode.train.model import lm_loss
from dilonode.train.worker import Worker, build_inner_optimizer
from tests.support.config import nano_config

# A learning rate at which zero AdamW moments do spike the loss of a trained model.
BASE = {"seed": 1, "total_steps": 60, "eval_every": 1000,
        "data": {"seq_len": 64, "batch_size": 8, "eval_batches": 8},
        "inner": {"lr": 1e-2, "warmup_steps": 10},
        "diloco": {"sync_every": 30, "pacing": "steps"}, "sim": {"workers": 2}}
AFTER = 8  # steps measured after adopting


@pytest.fixture(scope="module")
def swarm_state():
    cfg = nano_config(**BASE)
    got = {}
    simulate(cfg, on_step=lambda s, ws: got.update(w=ws) if s == cfg.total_steps else None)
    return cfg, got["w"][0].export_state()


def _held_out(w: Worker, batches) -> float:
    w.model.eval()
    with torch.no_grad():
        loss = sum(float(lm_loss(w.model, x, y)) for x, y in batches) / len(batches)
    w.model.train()
    return loss


def _rise(losses: list[float], steps: int = AFTER) -> float:
    """How far the held-out loss rose above its value at adoption within `steps` steps."""
    return max(losses[:steps + 1]) - losses[0]


def _assert_no_spike(new: list[float], old: list[float]) -> None:
    """Zeroed moments at full learning rate spike the loss within a few steps (`old`, which
    must, at this learning rate); adopting the right way must not: no rise over the first
    3 steps, and over the whole window at most half the naive way's rise (later steps wander
    at this high rate, by amounts that differ from one CPU's float rounding to another's)."""
    assert _rise(old) > 0.03, old
    assert _rise(new, 3) <= 0.01, new
    assert _rise(new) <= _rise(old) / 2, (new, old)


def _adopt(cfg, state, trained: int, old_way: bool = False):
    """Held-out losses of a worker that trains `trained` steps, adopts `state`, then trains
    AFTER steps (index 0: right after adopting); and its learning rates. `old_way`: a
    fresh AdamW at full learning rate (the naive way)."""
    data = load_data(cfg.data)
    batches = data.eval_batches(cfg.data.seq_len, cfg.data.batch_size, 4)
    w = Worker(cfg, data, LocalGroup(1, get_codec("int4")).view(0), identity=7)
    for _ in range(trained):
        w.train_step()
    w.import_state(state)
    if old_way:
        w.opt = build_inner_optimizer(w.model, cfg.inner)
        w._rewarm_from = None
    losses, lrs = [_held_out(w, batches)], []
    for _ in range(AFTER):
        w.train_step()
        losses.append(_held_out(w, batches))
        lrs.append(w.opt.param_groups[0]["lr"])
    return losses, lrs


def test_a_joiner_rewarms_and_does_not_spike(swarm_state):
    cfg, state = swarm_state
    old, old_lrs = _adopt(cfg, state, trained=0, old_way=True)
    new, lrs = _adopt(cfg, state, trained=0)
    assert old_lrs[0] == cfg.inner.lr and lrs[0] == pytest.approx(cfg.inner.lr /
                                                                   cfg.inner.rewarm_steps)
    _assert_no_spike(new, old)


def test_a_resyncing_worker_keeps_its_moments_and_does_not_spike(swarm_state):
    cfg, state = swarm_state
    old, _ = _adopt(cfg, state, trained=40, old_way=True)
    new, lrs = _adopt(cfg, state, trained=40)
    assert lrs[0] == cfg.inner.lr  # no re-warm needed: its moments are kept
    _assert_no_spike(new, old)


def test_a_worker_adopts_the_fragments_not_in_flight_and_keeps_the_others(swarm_state):
    cfg, state = swarm_state
    w = Worker(cfg, load_data(cfg.data), LocalGroup(2, get_codec("int4")).view(0), identity=3)
    for _ in range(5):
        w.train_step()
    w.start_round(0, 0)  # fragment 0's round in flight (its peer never contributes)
    before = w.frags[0].outer.weights.clone()
    with pytest.raises(RuntimeError, match="in flight"):
        w.import_fragments(state, [0, 1])
    w.import_fragments(state, [1, 2])
    for p in (1, 2):
        f = w.frags[p]
        assert torch.equal(f.outer.weights, state.tensors[f"outer.{p}.weights"])
        assert f.next_round == state.rounds[p] and f.chain == state.chains[p]
    assert torch.equal(w.frags[0].outer.weights, before) and w.frags[0].next_round == 1
