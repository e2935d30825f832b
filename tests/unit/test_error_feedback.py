"""Error feedback (algo/error_feedback.py) and how the worker keeps its residual: nothing
is lost, only delayed, and nothing is owed twice whatever the merge's alpha; decayed as
configured; checkpointed; reset on adopting a state."""

from __future__ import annotations

import pytest
import torch

from dilonode.algo.codecs import get_codec, part_align
from dilonode.algo.error_feedback import carried, merge_keeping, owed, remainder
from dilonode.algo.sparse import gather, scatter, shared_positions
from dilonode.train.checkpoint import load_checkpoint, save_checkpoint
from dilonode.train.state import config_digest
from tests.support.config import nano_config


def _round(codec, w, g, r, density, alpha, decay=1.0):
    """One node's round of the pure rule with outer SGD at lr 1 (the swarm applies exactly
    what was sent): -> (sent, residual, new local weights, new global weights)."""
    owe = g - w  # the pseudo-gradient: the local weights hold what is still owed
    if density is None:
        sent = carried(codec, owe)
    else:
        pos = shared_positions(1, 0, r, owe.numel(), density)
        sent = scatter(carried(codec, gather(owe, pos)), pos, owe.numel())
    residual = remainder(owe, sent, decay)
    g_new = g - sent
    return sent, residual, merge_keeping(w, g_new, alpha, residual, decay), g_new


@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.9])
@pytest.mark.parametrize(("name", "density"), [("int4", None), ("int2", None),
                                               ("sign1", None), ("int2", 0.05),
                                               ("float32", 0.1)])
def test_what_was_sent_plus_the_residual_is_every_move_once(name: str, density: float | None,
                                                            alpha: float):
    codec = get_codec(name, 64)
    gen = torch.Generator().manual_seed(3)
    n = 5000
    g, w = torch.zeros(n), torch.zeros(n)
    total_moved = torch.zeros(n, dtype=torch.float64)
    total_sent = torch.zeros(n, dtype=torch.float64)
    for r in range(12):
        move = torch.randn(n, generator=gen) * 0.01  # the round's inner steps
        w = w - move
        sent, residual, w, g = _round(codec, w, g, r, density, alpha)
        total_moved += move.double()
        total_sent += sent.double()
        assert (g - w - residual).abs().max() < 1e-6  # the local weights hold the residual
    gap = (total_sent + residual.double() - total_moved).abs().max().item()
    assert gap < 1e-5  # float32 rounding of each step only
    assert residual.abs().max() > 0  # and something is still owed


@pytest.mark.parametrize(("name", "density"), [("int2", None), ("int2", 0.05)])
def test_the_buffer_holds_what_was_not_sent_beside_weights_that_reset(name: str,
                                                                      density: float | None):
    # SparseLoCo's accumulator with DiLoCo's reset (alpha 0): the residual is added to the
    # next pseudo-gradient, inner steps start at the global weights, and with beta = 1 what
    # was sent plus the residual is every move once.
    codec = get_codec(name, 64)
    gen = torch.Generator().manual_seed(4)
    n = 5000
    g, r = torch.zeros(n), None
    total_moved = torch.zeros(n, dtype=torch.float64)
    total_sent = torch.zeros(n, dtype=torch.float64)
    for t in range(12):
        move = torch.randn(n, generator=gen) * 0.01
        w = g - move  # the inner steps from the global weights
        owe = owed(g - w, r)
        if density is None:
            sent = carried(codec, owe)
        else:
            pos = shared_positions(1, 0, t, n, density)
            sent = scatter(carried(codec, gather(owe, pos)), pos, n)
        r = remainder(owe, sent, 1.0)
        g = g - sent
        assert torch.equal(merge_keeping(w, g, 0.0, None, 1.0), g)  # the plain merge
        total_moved += move.double()
        total_sent += sent.double()
    assert (total_sent + r.double() - total_moved).abs().max().item() < 1e-5
    assert r.abs().max() > 0
    assert torch.equal(owed(move, None), move)
    with pytest.raises(ValueError, match="residual of 3 values for a fragment of 2"):
        owed(torch.zeros(2), torch.zeros(3))


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_a_position_left_out_owes_what_it_moved_however_long_it_waits(alpha: float):
    codec = get_codec("float32", 1)
    n = 4096
    moved = torch.linspace(-1.0, 1.0, n)
    g, w = torch.zeros(n), -moved  # one round of training, then none
    first = torch.full((n,), float("nan"))
    for r in range(40):
        sent, _, w, g = _round(codec, w, g, r, 0.05, alpha)
        new = first.isnan() & (sent != 0)
        first[new] = sent[new]
    seen = ~first.isnan()
    assert seen.sum() > n // 2  # positions first sent after waiting up to 39 rounds
    assert torch.allclose(first[seen], moved[seen], atol=1e-6)


def test_decay_scales_the_part_not_sent_and_the_merge_lets_it_go():
    owe = torch.tensor([1.0, -2.0, 0.5])
    sent = torch.tensor([1.0, -1.0, 0.0])
    residual = remainder(owe, sent, 0.5)
    assert torch.equal(residual, torch.tensor([0.0, -0.5, 0.25]))
    g_new, w = -sent, -owe  # g = 0, outer SGD at lr 1
    kept = merge_keeping(w, g_new, 0.5, residual, 0.5)
    assert torch.allclose(g_new - kept, residual)  # the decayed part is owed, no more
    assert torch.equal(merge_keeping(w, g_new, 0.5, None, 0.5), 0.5 * w + 0.5 * g_new)


def test_a_non_finite_contribution_leaves_a_zero_residual():
    owe = torch.tensor([1.0, float("nan")])
    assert torch.equal(remainder(owe, torch.zeros(2), 1.0), torch.zeros(2))
    with pytest.raises(ValueError, match="residual of 2 values for a fragment of 3"):
        merge_keeping(torch.ones(3), torch.ones(3), 0.5, torch.ones(2), 1.0)


def _worker(tmp_path, diloco=None, **codec):
    from dilonode.sim.local_group import LocalGroup
    from dilonode.train.data import load_data
    from dilonode.train.worker import Worker

    cfg = nano_config(tmp_path, total_steps=12, codec=codec, **(
        {"diloco": diloco} if diloco else {}))
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
        local = fresh.ranks.local_flat(mine.index, mine.params)
        assert torch.allclose(mine.outer.weights - local, mine.residual, atol=1e-6)
    served = type(state)(state.step, state.rounds, state.outer_steps, state.tensors,
                         chains=state.chains)  # what a joiner receives: no residuals
    fresh.import_state(served)
    assert all(f.residual is None for f in fresh.frags)
    for f in fresh.frags:
        assert torch.equal(fresh.ranks.local_flat(f.index, f.params), f.outer.weights)


def test_with_the_buffer_a_round_sends_its_delta_plus_the_residual_and_resets(
        tmp_path):
    reset = {"fragment_update_alpha": 0.0}  # the buffer's only alpha (test_config.py)
    cfg, w = _worker(tmp_path, reset, name="int2", kind="topk", topk_density=0.05,
                     error_feedback=True, error_decay=0.9, error_store="buffer")
    codec = get_codec(cfg.codec.wire_name, 64)
    w.collective = rec = _Recording(w.collective)
    w.end_step = 3
    for _ in range(3):
        w.train_step()
    assert w.algo.fragment_update_alpha == 0.0
    for r in range(3):
        for f in w.frags:
            before = f.residual.clone() if f.residual is not None else torch.zeros_like(
                f.outer.weights)
            local = w.ranks.local_flat(f.index, f.params).clone()
            w.start_round(f.index, r)
            sent = rec.by_round[(f.index, r)]
            assert torch.allclose(sent, f.outer.weights - local + before, atol=1e-6)
            assert torch.equal(f.residual, remainder(sent, carried(codec, sent), 0.9))
            w.land_round(f.index)
            after = w.ranks.local_flat(f.index, f.params)
            assert torch.equal(after, f.outer.weights)  # the plain merge keeps no residual
    assert all(f.residual.abs().sum() > 0 for f in w.frags)
    state = w.export_state()
    _, fresh = _worker(tmp_path / "b", reset, name="int2", kind="topk", topk_density=0.05,
                       error_feedback=True, error_decay=0.9, error_store="buffer")
    fresh.import_state(state)  # a resume: the buffer back, the weights at the global ones
    for mine, theirs in zip(fresh.frags, w.frags, strict=True):
        assert torch.equal(mine.residual, theirs.residual)
        assert torch.equal(fresh.ranks.local_flat(mine.index, mine.params), mine.outer.weights)


class _Recording:
    """A collective view that records every contribution it is given, in order and by
    (fragment, round)."""

    def __init__(self, inner):
        self.inner, self.sizes, self.sent, self.by_round = inner, [], [], {}

    def begin(self, request, flat, **kw):
        self.sizes.append((request.key.fragment, request.key.round, flat.numel()))
        self.sent.append(flat.clone())
        self.by_round[(request.key.fragment, request.key.round)] = self.sent[-1]
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


def test_the_worker_sends_a_value_left_out_once_as_it_was_moved(tmp_path):
    # The daemon's and the simulator's path: train, then rounds with no training between
    # them, alpha 0.5. A value sent for the first time rounds later is what the inner
    # steps moved it, neither counted again for every round it waited nor lost.
    density = 0.1
    cfg, w = _worker(tmp_path, name="float32", kind="randk", topk_density=density,
                     error_feedback=True)
    assert cfg.diloco.fragment_update_alpha == 0.5
    w.end_step = 3
    for _ in range(3):
        w.train_step()
    moved = [f.outer.weights - w.ranks.local_flat(f.index, f.params) for f in w.frags]
    w.collective = rec = _Recording(w.collective)
    rounds = 12
    for r in range(rounds):
        for p in range(len(w.frags)):
            w.start_round(p, r)
            w.land_round(p)
    checked = 0
    for f in w.frags:
        n = f.outer.weights.numel()
        first = torch.zeros(n, dtype=torch.bool)
        for r in range(rounds):
            pos = shared_positions(cfg.seed, f.index, r, n, density)
            sent = scatter(rec.by_round[(f.index, r)], pos, n)
            new = torch.zeros(n, dtype=torch.bool)
            new[pos] = ~first[pos]
            assert torch.allclose(sent[new], moved[f.index][new], atol=1e-6), (f.index, r)
            first |= new
            checked += int(new.sum()) if r else 0
        never = ~first  # never sent: still owed in full, the local weights hold it
        local = w.ranks.local_flat(f.index, f.params)
        assert torch.allclose((f.outer.weights - local)[never], moved[f.index][never],
                              atol=1e-6)
        assert torch.allclose(f.residual[never], moved[f.index][never], atol=1e-6)
    assert checked > 0  # values that waited one round or more


def test_the_config_digest_counts_the_new_codec_fields_only_off_their_defaults():
    plain = config_digest(nano_config(None))
    assert config_digest(nano_config(None, codec={"kind": "dense", "error_decay": 1.0})) == plain
    assert config_digest(nano_config(None, codec={"error_store": "weights"})) == plain
    for codec in ({"error_feedback": True}, {"kind": "randk"},
                  {"kind": "randk", "topk_density": 0.1}):
        assert config_digest(nano_config(None, codec=codec)) != plain, codec
    reset = {"fragment_update_alpha": 0.0}
    ef = {"error_feedback": True}
    assert config_digest(nano_config(None, diloco=reset, codec=ef)) != config_digest(
        nano_config(None, diloco=reset, codec=ef | {"error_store": "buffer"}))


def test_an_end_of_run_mix_keeps_what_the_node_still_owes(tmp_path):
    # A mixing round averages outer states, not pseudo-gradients: the residual stays owed,
    # and the local weights still hold it off the mixed global weights.
    from types import SimpleNamespace

    from dilonode.algo.mixing import pack_state

    _, w = _worker(tmp_path, name="int2", kind="randk", topk_density=0.2,
                   error_feedback=True, error_decay=0.9)
    _train(w, 12)
    w.drain()
    f = w.frags[0]
    owed = f.residual.clone()
    assert owed.abs().sum() > 0
    mixed = f.outer.weights + 0.01  # the group's mean state
    result = SimpleNamespace(
        mean=pack_state(mixed, f.outer.momentum_buf.clone()), digest="mixed",
        report=SimpleNamespace(payload_bytes_sent=0, payload_bytes_received=0, group_size=2))
    before = w.ranks.local_flat(f.index, f.params).clone()
    w._land_mix(f, 12, result)
    assert torch.equal(f.outer.weights, mixed) and torch.equal(f.residual, owed)
    local = w.ranks.local_flat(f.index, f.params)
    alpha = w.algo.fragment_update_alpha
    assert torch.allclose(local, merge_keeping(before, mixed, alpha, owed, 0.9), atol=1e-6)
    plain = alpha * before + (1 - alpha) * mixed  # would owe part of it again
    assert not torch.allclose(local, plain, atol=1e-6)
