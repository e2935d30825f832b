"""Sparse rounds (algo/sparse.py): shared positions every member draws alike, exact sizes
of the independent top-k form, and a simulated swarm whose members end bit-identical."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dilonode.algo.codecs import get_codec
from dilonode.algo.sparse import (
    SPARSE_CHUNK,
    chunk_k,
    gather,
    positions_bytes,
    round_key,
    scatter,
    shared_positions,
    sparse_numel,
    splitmix64,
    topk_encoded_size,
    topk_positions,
    union_size,
)


def test_splitmix64_matches_the_reference_values():
    # splitmix64 seeded with 0: the first outputs of Vigna's reference generator.
    z = np.array([0, 0x9E3779B97F4A7C15], dtype=np.uint64)
    assert [int(v) for v in splitmix64(z)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4]


@pytest.mark.parametrize("numel", [1, 10, SPARSE_CHUNK, SPARSE_CHUNK + 1, 3 * SPARSE_CHUNK + 77])
@pytest.mark.parametrize("density", [0.01, 0.03, 0.5, 1.0])
def test_positions_are_increasing_per_chunk_counts_and_reproducible(numel, density):
    pos = shared_positions(42, 1, 7, numel, density)
    assert pos.dtype == torch.int64 and pos.numel() == sparse_numel(numel, density)
    assert bool((pos[1:] > pos[:-1]).all()) and int(pos[0]) >= 0 and int(pos[-1]) < numel
    for lo in range(0, numel, SPARSE_CHUNK):
        hi = min(lo + SPARSE_CHUNK, numel)
        assert int(((pos >= lo) & (pos < hi)).sum()) == chunk_k(hi - lo, density)
    assert torch.equal(pos, shared_positions(42, 1, 7, numel, density))


def test_positions_change_with_seed_fragment_and_round():
    base = shared_positions(1, 0, 0, 20000, 0.03)
    for args in ((2, 0, 0), (1, 1, 0), (1, 0, 1)):
        other = shared_positions(*args, 20000, 0.03)
        assert float(torch.isin(base, other).float().mean()) < 0.2  # ~3% overlap by chance
    assert round_key(1, 0, 0) != round_key(1, 0, 1)


def test_chunk_k_and_gather_scatter():
    assert chunk_k(4096, 0.03) == 123 and chunk_k(10, 0.01) == 1 and chunk_k(0, 0.5) == 0
    x = torch.arange(10.0)
    pos = torch.tensor([1, 4, 9])
    assert torch.equal(gather(x, pos), torch.tensor([1.0, 4.0, 9.0]))
    assert torch.equal(scatter(gather(x, pos), pos, 10),
                       torch.tensor([0, 1, 0, 0, 4, 0, 0, 0, 0, 9.0]))


def test_topk_sizes_are_exact():
    assert positions_bytes(10, 4096) == 20  # uint16 offsets
    assert positions_bytes(300, 4096) == 512  # a bitmap is smaller
    assert positions_bytes(0, 4096) == 0
    int4 = get_codec("int4", 64)
    counts = [(123, 4096), (123, 4096), (1, 5)]
    assert topk_encoded_size(int4, counts) == 2 * 246 + 1 + int4.encoded_size(247)  # 5: bitmap
    x = torch.randn(2 * 4096 + 5)
    pos = topk_positions(x, 0.03)
    assert pos.numel() == sparse_numel(x.numel(), 0.03)
    kept = x.abs()[pos[:123]].min()
    rest = torch.ones(4096, dtype=torch.bool)
    rest[pos[:123]] = False
    assert float(x[:4096].abs()[rest].max()) <= float(kept)
    assert union_size([pos, pos]) == pos.numel()
    assert union_size([torch.tensor([1, 2]), torch.tensor([2, 3])]) == 3


def test_a_sparse_swarm_with_error_feedback_ends_bit_identical():
    from dilonode.sim.training import simulate
    from tests.support.config import nano_config

    cfg = nano_config(None, total_steps=12, eval_every=12, sim={"workers": 3},
                      codec={"name": "int2", "kind": "randk", "topk_density": 0.05,
                             "error_feedback": True})
    report = simulate(cfg)
    assert report.workers_agree  # every worker holds the same outer weights, bit for bit
    dense = simulate(nano_config(None, total_steps=12, eval_every=12, sim={"workers": 3},
                                 codec={"name": "int2"}))
    assert dense.workers_agree
    # 5% of the values, with a scale per 64 of them either way.
    assert 0 < report.bytes_sent_per_worker < 0.1 * dense.bytes_sent_per_worker


def test_the_benchmark_counts_shared_positions_at_the_density_and_the_union_above_k():
    from benchmarks.micro.sparse_allreduce import measure

    int4 = get_codec("int4", 64)
    m = measure(4, 4 * 4096, 0.03, 0.0, int4)
    assert m["shared_randk"] == 2 * 3 * int4.encoded_size(123)  # 3 peers, one chunk each
    assert m["dense"] == 2 * 3 * int4.encoded_size(4096)
    assert 3.0 < m["union_over_k"] <= 4.0  # four independent sets barely overlap
    assert m["topk_union"] > m["topk_resparse"] > m["shared_randk"]


def test_robust_aggregation_runs_on_the_shared_positions():
    from dilonode.sim.training import simulate
    from tests.support.config import nano_config

    cfg = nano_config(None, total_steps=12, eval_every=12, sim={"workers": 4},
                      aggregator={"name": "trimmed_mean", "trim": 1},
                      codec={"name": "int4", "kind": "randk", "topk_density": 0.1,
                             "error_feedback": True})
    report = simulate(cfg)
    assert report.workers_agree and math.isfinite(report.final_eval_loss)


def test_the_config_checks_topk_chunks_against_the_chunk_rounds_use():
    from dilonode import config

    assert config._TOPK_CHUNK == SPARSE_CHUNK
