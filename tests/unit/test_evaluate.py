"""`Worker.evaluate`: the held-out loss of the outer weights, taken by swapping them into the
model in place (no copy of the module), equals the loss of a model holding them, and leaves
the inner weights and the training mode as they were, bit for bit."""

from __future__ import annotations

import pytest
import torch

from dilonode.sim.training import simulate
from dilonode.train.data import load_data
from dilonode.train.model import mean_loss
from tests.support.config import nano_config

BASE = {"seed": 2, "total_steps": 12, "eval_every": 1000, "data": {"eval_batches": 8},
        "diloco": {"pacing": "steps"}, "sim": {"workers": 2}}


@pytest.mark.parametrize("mode", ["streaming", "diloco", "ddp"])
def test_evaluate_is_the_outer_weights_loss_and_leaves_the_inner_weights_alone(mode):
    cfg = nano_config(**BASE | {"diloco": {**BASE["diloco"], "mode": mode}})
    got = {}
    simulate(cfg, on_step=lambda s, ws: got.update(w=ws[0]))
    w = got["w"]
    for _ in range(3):  # the inner weights move away from the outer ones
        w.train_step()
    batches = load_data(cfg.data).eval_batches(cfg.data.seq_len, cfg.data.batch_size, 3)
    inner = [p.detach().clone() for p in w.params]
    want = mean_loss(w.outer_model().eval(), batches, "cpu")

    assert w.evaluate(batches) == want
    assert w.model.training
    assert all(torch.equal(p, q) for p, q in zip(w.params, inner, strict=True))
    outer = [p.detach() for p in w.outer_model().parameters() if p.requires_grad]
    differ = not all(torch.equal(p, q) for p, q in zip(outer, inner, strict=True))
    assert differ == (mode != "ddp")
