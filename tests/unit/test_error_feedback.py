"""Error feedback (algo/error_feedback.py) and how the worker keeps its residual: nothing
is lost, only delayed; decayed as configured; checkpointed; reset on adopting a state."""

from __future__ import annotations

import pytest
import torch

from dilonode.algo.codecs import get_codec, part_align
from dilonode.algo.error_feedback import carried, owed, remainder
from dilonode.algo.sparse import gather, scatter, shared_positions
from dilonode.train.checkpoint import load_checkpoint, save_checkpoint
from dilonode.train.state import config_digest
from tests.support.config import nano_config


@pytest.mark.parametrize(("name", "density"), [("int4", None), ("int2", None),
                                               ("sign1", None), ("int2", 0.05),
                                               ("float32", 0.1)])
def test_what_was_sent_plus_the_residual_is_every_delta(name: str, density: float | None):
    codec = get_codec(name, 64)
    gen = torch.Generator().manual_seed(3)
    n = 5000
    residual = None
    total_delta = torch.zeros(n, dtype=torch.float64)
    total_sent = torch.zeros(n, dtype=torch.float64)
    for r in range(12):
        delta = torch.randn(n, generator=gen) * 0.01
        owe = owed(delta, residual)
        if density is None:
            sent = carried(codec, owe)
        else:
            pos = shared_positions(1, 0, r, n, density)
            sent = scatter(carried(codec, gather(owe, pos)), pos, n)
        residual = remainder(owe, sent, 1.0)
        total_delta += delta.double()
        total_sent += sent.double()
    gap = (total_sent + residual.double() - total_delta).abs().max().item()
    assert gap < 1e-6  # float32 rounding of each step only
    assert residual.abs().max() > 0  # and something is still owed


def test_decay_scales_the_part_not_sent():
    owe = torch.tensor([1.0, -2.0, 0.5])
    sent = torch.tensor([1.0, -1.0, 0.0])
    assert torch.equal(remainder(owe, sent, 0.5), torch.tensor([0.0, -0.5, 0.25]))
    assert torch.equal(owed(torch.ones(3), None), torch.ones(3))


def test_a_non_finite_contribution_leaves_a_zero_residual():
    owe = torch.tensor([1.0, float("nan")])
    assert torch.equal(remainder(owe, torch.zeros(2), 1.0), torch.zeros(2))
    with pytest.raises(ValueError, match="residual of 2 values"):
        owed(torch.ones(3), torch.ones(2))


def _worker(tmp_path, **codec):
    from dilonode.sim.local_group import LocalGroup
    from dilonode.train.data import load_data
    from dilonode.train.worker import Worker

    cfg = nano_config(tmp_path, total_steps=12, codec=codec)
    c = get_codec(cfg.codec.wire_name, cfg.codec.block_size)
    group = LocalGroup(1, c, align=part_align(c, cfg.codec.block_size))
    return cfg, Worker(cfg, load_data(cfg.data), group.view(0), identity=0)


def _train(w, steps):
    w.end_step = steps
    for _ in range(steps):
        w.train_step()
        w.launch()
        w.land()


def test_the_residual_is_checkpointed_and_a_peer_state_resets_it(tmp_path):
    cfg, w = _worker(tmp_path, name="int2", kind="randk", topk_density=0.2,
                     error_feedback=True, error_decay=0.9)
    _train(w, 12)
    w.drain()
    assert all(f.residual is not None and f.residual.abs().sum() > 0 for f in w.frags)
    state = w.export_state()
    assert set(state.residuals) == {f.index for f in w.frags}
    path = save_checkpoint(tmp_path / "ckpt", state, cfg.run_id, config_digest(cfg), keep=2)
    loaded = load_checkpoint(path, cfg.run_id, config_digest(cfg))
    assert set(loaded.tensors) == set(state.tensors)  # residuals are not outer state
    _, fresh = _worker(tmp_path / "b", name="int2", kind="randk", topk_density=0.2,
                       error_feedback=True, error_decay=0.9)
    fresh.import_state(loaded)  # a resume: the node still owes what it owed
    for mine, theirs in zip(fresh.frags, w.frags, strict=True):
        assert torch.equal(mine.residual, theirs.residual)
    served = type(state)(state.step, state.rounds, state.outer_steps, state.tensors,
                         chains=state.chains)  # what a joiner receives: no residuals
    fresh.import_state(served)
    assert all(f.residual is None for f in fresh.frags)


class _Recording:
    """A collective view that records every contribution it is given."""

    def __init__(self, inner):
        self.inner, self.sizes, self.sent = inner, [], []

    def begin(self, request, flat, **kw):
        self.sizes.append((request.key.fragment, request.key.round, flat.numel()))
        self.sent.append(flat.clone())
        return self.inner.begin(request, flat, **kw)


def test_a_topk_round_keeps_what_its_own_topk_did_not_carry(tmp_path):
    """codec.kind = topk hands the collective the whole owed vector; the residual is what
    the node's own top-k encoding of it left out (and rounded), times the decay."""
    _, w = _worker(tmp_path, name="int2", kind="topk", topk_density=0.05,
                   error_feedback=True, error_decay=0.9)
    codec = get_codec("topk205_int2", 64)  # ceil(0.05 * 4096) of each chunk
    w.collective = rec = _Recording(w.collective)
    w.end_step = 12
    while not rec.sent:
        w.train_step()
        w.launch()
    p, _, n = rec.sizes[0]
    f = w.frags[p]
    assert n == f.outer.weights.numel()  # dense: the codec sparsifies on the wire
    expected = remainder(rec.sent[0], carried(codec, rec.sent[0]), 0.9)
    assert torch.equal(f.residual, expected) and expected.abs().sum() > 0
    sent = carried(codec, rec.sent[0])
    assert int((sent != 0).sum()) <= 205 * -(-n // 4096)


def test_a_sparse_round_hands_the_collective_only_its_values(tmp_path):
    from dilonode.algo.sparse import sparse_numel

    cfg, w = _worker(tmp_path, name="float32", kind="randk", topk_density=0.1)
    w.collective = rec = _Recording(w.collective)
    _train(w, 12)
    w.drain()
    assert rec.sizes
    for p, _, k in rec.sizes:
        n = w.frags[p].outer.weights.numel()
        assert k == sparse_numel(n, 0.1) < n
    assert all(f.sparse_positions is None for f in w.frags)  # every round landed


def test_the_config_digest_counts_the_new_codec_fields_only_off_their_defaults():
    plain = config_digest(nano_config(None))
    assert config_digest(nano_config(None, codec={"kind": "dense", "error_decay": 1.0})) == plain
    for codec in ({"error_feedback": True}, {"kind": "randk"},
                  {"kind": "randk", "topk_density": 0.1}):
        assert config_digest(nano_config(None, codec=codec)) != plain, codec
