"""Robust aggregation: contribution checks, the three aggregators and the ban tracker."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dilonode.algo.butterfly import reduce_mean
from dilonode.algo.robust import (
    AggregatorSpec,
    BanTracker,
    aggregate,
    centered_clip,
    check_contributions,
    convicted,
    trimmed_mean,
)

_FLOATS = st.floats(-1e3, 1e3, allow_nan=False, width=32)


@st.composite
def honest_chunks(draw, min_n=1, max_n=6):
    n = draw(st.integers(min_n, max_n))
    numel = draw(st.integers(1, 40))
    rows = draw(st.lists(st.lists(_FLOATS, min_size=numel, max_size=numel),
                         min_size=n, max_size=n))
    return [torch.tensor(r, dtype=torch.float32) for r in rows]


@settings(max_examples=150, deadline=None)
@given(chunks=honest_chunks())
def test_mean_is_reduce_mean_bit_for_bit(chunks):
    out = aggregate(chunks, AggregatorSpec())
    assert out.rejected == ()
    assert torch.equal(out.value, reduce_mean(chunks))
    assert out.value.numpy().tobytes() == reduce_mean(chunks).numpy().tobytes()


@settings(max_examples=150, deadline=None)
@given(chunks=honest_chunks(min_n=3), where=st.integers(0, 5),
       scale=st.floats(1e4, 1e30), sign=st.sampled_from([-1.0, 1.0]))
def test_trimmed_mean_stays_inside_the_honest_range(chunks, where, scale, sign):
    outlier = torch.full_like(chunks[0], sign * scale)
    mixed = chunks[:]
    mixed.insert(where % (len(chunks) + 1), outlier)
    out = aggregate(mixed, AggregatorSpec(name="trimmed_mean", trim=1)).value
    honest = torch.stack(chunks)
    lo, hi = honest.min(dim=0).values, honest.max(dim=0).values
    slack = 1e-3 * (1 + hi.abs().max())
    assert bool((out >= lo - slack).all()) and bool((out <= hi + slack).all())


@settings(max_examples=150, deadline=None)
@given(chunks=honest_chunks(min_n=3), scale=st.floats(1e8, 1e30), seed=st.integers(0, 99))
def test_centered_clip_bounds_one_outlier(chunks, scale, seed):
    direction = torch.randn(chunks[0].numel(), generator=torch.Generator().manual_seed(seed))
    outlier = direction / direction.norm().clamp_min(1e-6) * scale
    spec = AggregatorSpec(name="centered_clip", clip_tau=1.0, clip_iters=3)
    out = aggregate([*chunks, outlier], spec).value
    honest = torch.stack(chunks)
    hmean = honest.mean(dim=0)
    radius = float((honest - hmean).norm(dim=1).max())
    box = float((honest.max(dim=0).values - honest.min(dim=0).values).norm())
    # Start within the honest box, then at most (honest reach + tau/n) per iteration: a
    # bound that does not grow with the outlier's scale.
    bound = box + spec.clip_iters * 2 * (radius + box) * (1 + spec.clip_tau) + 1e-3
    assert float((out - hmean).norm()) <= bound
    assert bound < scale / 10  # the plain mean would be pulled ~scale/n away


def test_centered_clip_of_agreeing_members_is_their_value():
    x = torch.tensor([1.0, -2.0, 3.0])
    assert torch.allclose(centered_clip([x, x.clone(), x.clone()], 1.0, 3), x)


def test_trimmed_mean_small_groups():
    a, b, c = torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([9.0])
    assert torch.equal(trimmed_mean([a, b], trim=1), reduce_mean([a, b]))  # n=2: plain mean
    assert torch.equal(trimmed_mean([a, b, c], trim=1), b)  # n=3: the median


def test_nan_contribution_is_rejected_and_left_out():
    ok0, ok2 = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    bad = torch.tensor([float("nan"), 0.0])
    for name in ("mean", "trimmed_mean", "centered_clip"):
        out = aggregate([ok0, bad, ok2], AggregatorSpec(name=name))
        assert out.rejected == (1,), name
        assert bool(torch.isfinite(out.value).all()), name
    assert torch.equal(aggregate([ok0, bad, ok2], AggregatorSpec()).value,
                       reduce_mean([ok0, ok2]))
    inf = torch.tensor([float("inf"), 0.0])
    assert check_contributions([ok0, inf]) == [1]
    with pytest.raises(ValueError, match="all 2 contributions rejected"):
        aggregate([bad, inf], AggregatorSpec())


def test_norm_bound_rejects_scaled_contribution_relative_to_median():
    honest = [torch.tensor([1.0, 1.0]), torch.tensor([1.2, 0.8]), torch.tensor([0.9, 1.1])]
    attack = honest[0] * 100
    assert check_contributions([*honest, attack], norm_bound=0.0) == []
    assert check_contributions([*honest, attack], norm_bound=3.0) == [3]
    out = aggregate([attack, *honest], AggregatorSpec(norm_bound=3.0))
    assert out.rejected == (0,)
    assert torch.equal(out.value, reduce_mean(honest))
    # Two members: the smaller norm is the reference, so the x100 one is the one refused.
    assert check_contributions([honest[0], attack], norm_bound=3.0) == [1]


def test_spec_rejects_bad_settings_naming_them():
    with pytest.raises(ValueError, match="name='median'"):
        AggregatorSpec(name="median")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="norm_bound=0.5"):
        AggregatorSpec(norm_bound=0.5)
    with pytest.raises(ValueError, match="clip_tau=nan"):
        AggregatorSpec(clip_tau=math.nan)
    with pytest.raises(ValueError, match="clip_iters=0"):
        AggregatorSpec(clip_iters=0)
    with pytest.raises(ValueError, match="no contributions"):
        aggregate([], AggregatorSpec())


def test_ban_tracker_bans_after_repeated_rejections_then_forgets():
    bans = BanTracker(max_rejections=3, window=100.0, ban_seconds=50.0)
    assert not bans.record("p", 0.0)
    assert not bans.record("p", 10.0)
    assert not bans.is_banned("p", 10.0)
    assert bans.record("p", 20.0)
    assert bans.is_banned("p", 20.0) and bans.banned(69.0) == {"p"}
    assert not bans.record("p", 30.0)  # already banned: not banned again
    assert bans.banned(70.0) == set() and not bans.is_banned("p", 70.0)
    assert (bans.rejections_total, bans.bans_total) == (4, 1)


def test_ban_tracker_counts_only_rejections_within_the_window():
    bans = BanTracker(max_rejections=2, window=10.0, ban_seconds=5.0)
    assert not bans.record("p", 0.0)
    assert not bans.record("p", 10.0)  # the first one has left the window
    assert not bans.record("q", 11.0)  # other peers count separately
    assert bans.record("p", 12.0)
    assert bans.banned(12.0) == {"p"}
    with pytest.raises(ValueError, match="max_rejections=0"):
        BanTracker(max_rejections=0)


def test_convicted_needs_a_majority_of_the_other_owners():
    owners = [0, 1, 2, 3]
    assert convicted({0: {3}, 1: {3}, 2: {3}, 3: {3}}, owners) == {3}
    assert convicted({0: {3}, 1: {3}}, owners) == {3}  # 2 of the 3 others
    assert convicted({0: {3}}, owners) == set()  # one owner's word alone
    # A lying owner naming everyone convicts nobody; its own vote for itself is ignored.
    assert convicted({2: {0, 1, 3}, 3: {3}}, owners) == set()
    assert convicted({0: {2}, 1: {2}}, [0, 1, 2]) == {2}  # owners without a part don't vote
    assert convicted({0: {1}, 5: {1}}, [0, 1]) == {1}
