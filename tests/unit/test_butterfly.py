"""Butterfly partitioning and the in-process butterfly average."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dilonode.algo.butterfly import (
    CHUNK_FLOOR,
    PIPELINE_CHUNKS,
    butterfly_average,
    part_bounds,
    reduce_mean,
    round_chunk_numel,
    wire_bytes_ideal,
)
from dilonode.algo.codecs import get_codec


@settings(max_examples=200, deadline=None)
@given(numel=st.integers(0, 5000), align=st.sampled_from([1, 2, 64]),
       weights=st.lists(st.floats(0, 1000, allow_nan=False), min_size=1, max_size=9)
       .filter(lambda w: any(x > 0 for x in w)))
def test_parts_cover_in_order_aligned_and_proportional(numel, align, weights):
    bounds = part_bounds(numel, weights, align)
    assert len(bounds) == len(weights)
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    for (s0, e0), (s1, _) in zip(bounds, bounds[1:], strict=False):
        assert e0 == s1 and s0 <= e0
    for s, _ in bounds:
        assert s % align == 0 or s == numel
    units = -(-numel // align)
    total = sum(weights)
    for (s, e), w in zip(bounds, weights, strict=True):
        got_units = -(-(e - s) // align)
        assert abs(got_units - w * units / total) <= 1.0 + 1e-9
        if w == 0:
            assert s == e


def test_part_bounds_hand_values_and_errors():
    assert part_bounds(100, [1, 1, 1]) == [(0, 34), (34, 67), (67, 100)]
    assert part_bounds(130, [1, 1, 1], 64) == [(0, 64), (64, 128), (128, 130)]
    assert part_bounds(10, [1, 0, 3]) == [(0, 3), (3, 3), (3, 10)]
    with pytest.raises(ValueError, match="weights"):
        part_bounds(10, [0, 0])
    with pytest.raises(ValueError, match="weights"):
        part_bounds(10, [1, float("nan")])


def test_reduce_mean_sums_in_member_order():
    parts = [torch.tensor([1e8, 1.0]), torch.tensor([1.0, 1e8]), torch.tensor([-1e8, -1e8])]
    expected = ((parts[0] + parts[1]) + parts[2]) / 3
    assert torch.equal(reduce_mean(parts), expected)


def test_float32_butterfly_is_the_exact_mean_and_bytes_are_ideal():
    torch.manual_seed(0)
    contribs = [torch.randn(3000) for _ in range(4)]
    mean, sent, received = butterfly_average(contribs, [1, 1, 1, 1], get_codec("float32"))
    assert torch.equal(mean, reduce_mean(contribs))
    ideal = wire_bytes_ideal(3000 * 4, 4)
    assert all(s == pytest.approx(ideal) for s in sent)
    assert sum(sent) == sum(received)


def test_int4_butterfly_is_close_and_compressed():
    torch.manual_seed(0)
    contribs = [torch.randn(6400) for _ in range(3)]
    codec = get_codec("int4", 64)
    mean, sent, _ = butterfly_average(contribs, [1, 2, 1], codec)
    assert (mean - reduce_mean(contribs)).abs().max() < 1.0
    assert sum(sent) < sum(butterfly_average(contribs, [1, 2, 1], get_codec("float32"))[1]) / 7


CAP = 1 << 22


def test_round_chunk_hand_values():
    # 50M values among 4: a part of 12.5M in 3 chunks of 4,166,720 (whole 64-value blocks).
    assert round_chunk_numel(50_000_000, 4, CAP, 64) == 4_166_720
    assert round_chunk_numel(500_000_000, 4, CAP, 64) == CAP  # capped: 30 chunks a part
    assert round_chunk_numel(10_000_000, 4, CAP, 64) == 833_344
    # A small fragment (the test bed's 2.3M values): the floor.
    assert round_chunk_numel(2_300_000, 4, CAP, 64) == CHUNK_FLOOR
    # A configured chunk at or below the floor is used as it is (tests, small frames).
    assert round_chunk_numel(10_000_000, 4, 4096, 64) == 4096


@settings(max_examples=200, deadline=None)
@given(numel=st.integers(1, 10**9), members=st.integers(1, 64),
       cap_blocks=st.integers(1, 1 << 17), block=st.sampled_from([16, 32, 64, 128]))
def test_round_chunk_is_whole_blocks_within_bounds_and_pipelines(numel, members,
                                                                cap_blocks, block):
    cap = cap_blocks * block
    c = round_chunk_numel(numel, members, cap, block)
    assert c % block == 0 and 0 < c <= cap
    if cap > CHUNK_FLOOR:
        assert c >= min(CHUNK_FLOOR, cap)
        part = -(-numel // members)
        if c < cap and c > CHUNK_FLOOR:  # neither bound holds it: the part is pipelined
            assert -(-part // c) == PIPELINE_CHUNKS
