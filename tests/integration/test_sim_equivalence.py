"""The simulator against references written the straightforward way."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from dilonode.algo.butterfly import wire_bytes_ideal
from dilonode.algo.codecs import get_codec
from dilonode.algo.fragments import flatten
from dilonode.sim.local_group import LocalGroup
from dilonode.sim.training import simulate
from dilonode.train.data import load_data
from dilonode.train.model import build_model, lm_loss
from dilonode.train.worker import Worker, build_inner_optimizer
from tests.integration import gloo_reference
from tests.support.config import merged, nano_config
from tests.support.ports import free_port

BASE = {"seed": 3, "eval_every": 1000, "inner": {"grad_clip": 1.0},
        "codec": {"name": "float32"}}


def _cfg(**over):
    return nano_config(**merged(BASE, over))


@pytest.mark.timeout(300)
def test_diloco_float32_matches_gloo_reference(tmp_path):
    world = 3
    cfg = _cfg(total_steps=12, sim={"workers": world},
               diloco={"mode": "diloco", "sync_every": 4, "outer_lr": 0.7,
                       "outer_momentum": 0.9})
    out = tmp_path / "ref.pt"
    mp.start_processes(gloo_reference.run, args=(world, free_port(), cfg.model_dump_json(),
                                                 str(out)),
                       nprocs=world, join=True, start_method="spawn")
    reference = torch.load(out)
    captured = {}

    def grab(step, workers):
        if step == cfg.total_steps:
            captured["states"] = [w.outer_model().state_dict() for w in workers]

    report = simulate(cfg, on_step=grab)
    assert report.workers_agree
    assert report.rounds_per_fragment == {0: 3}
    for state in captured["states"]:
        assert state.keys() == reference.keys()
        for name, ref in reference.items():
            torch.testing.assert_close(state[name], ref, atol=1e-6, rtol=0, msg=name)
    # the run actually trained: weights moved away from the initial ones
    torch.manual_seed(cfg.seed)
    init = build_model(cfg.model, 256).state_dict()
    assert any((init[k] - reference[k]).abs().max() > 1e-3 for k in reference)


def test_one_worker_h1_identity_outer_equals_plain_training():
    cfg = _cfg(total_steps=15, sim={"workers": 1},
               diloco={"mode": "streaming", "sync_every": 1, "num_fragments": 1,
                       "fragment_sync_delay": 0, "fragment_update_alpha": 0.0,
                       "outer_lr": 1.0, "outer_momentum": 0.0})
    sim_weights = []
    simulate(cfg, on_step=lambda s, ws: sim_weights.append(ws[0].outer_flat().clone()))

    data = load_data(cfg.data)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, data.vocab_size)
    opt = build_inner_optimizer(model, cfg.inner)
    batches = data.train_batches(0, cfg.data.seq_len, cfg.data.batch_size, cfg.data.seed)
    params = list(model.parameters())
    for step in range(cfg.total_steps):
        x, y = next(batches)
        lm_loss(model, x, y).backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.inner.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        # g - (g - w) is w up to one rounding of g: agreement to 1e-6, not bit-exact
        torch.testing.assert_close(sim_weights[step], flatten(params), atol=1e-6, rtol=0)


def test_outer_lr1_momentum0_makes_every_worker_the_plain_average():
    cfg = _cfg(total_steps=3, sim={"workers": 3},
               diloco={"mode": "diloco", "sync_every": 3, "outer_lr": 1.0,
                       "outer_momentum": 0.0})
    data = load_data(cfg.data)
    group = LocalGroup(3, get_codec("float32"))
    workers = [Worker(cfg, data, group.view(i), identity=i) for i in range(3)]
    for _ in range(3):
        for w in workers:
            w.train_step()
    before = [flatten(w.params) for w in workers]
    assert not torch.equal(before[0], before[1])
    for w in workers:
        w.launch()
    for w in workers:
        w.land()
    average = torch.stack(before).mean(0)
    for w in workers:
        torch.testing.assert_close(flatten(w.params), average, atol=1e-6, rtol=0)


def test_ddp_mode_equals_averaged_gradient_training():
    cfg = _cfg(total_steps=6, sim={"workers": 2}, diloco={"mode": "ddp"})
    sim_weights = []
    report = simulate(cfg, on_step=lambda s, ws: sim_weights.append(flatten(ws[0].params)))
    assert report.workers_agree

    data = load_data(cfg.data)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, data.vocab_size)
    opt = build_inner_optimizer(model, cfg.inner)
    params = list(model.parameters())
    streams = [data.train_batches(i, cfg.data.seq_len, cfg.data.batch_size, cfg.data.seed)
               for i in range(2)]
    for step in range(cfg.total_steps):
        grads = []
        for s in streams:
            x, y = next(s)
            model.zero_grad(set_to_none=True)
            lm_loss(model, x, y).backward()
            grads.append([p.grad.clone() for p in params])
        for p, g0, g1 in zip(params, *grads, strict=True):
            p.grad = (g0 + g1) / 2
        torch.nn.utils.clip_grad_norm_(params, cfg.inner.grad_clip)
        opt.step()
        torch.testing.assert_close(sim_weights[step], flatten(params), atol=1e-6, rtol=0)
    numel = sum(p.numel() for p in params)
    # float32 butterfly: 2 (N-1)/N x payload per step (one half out, one half back for N=2)
    ideal = wire_bytes_ideal(numel * 4, 2) * cfg.total_steps
    assert report.bytes_sent_per_worker == pytest.approx(ideal, rel=1e-3)
