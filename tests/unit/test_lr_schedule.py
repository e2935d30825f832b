"""The learning-rate schedules: warm-up, then constant, cosine or warm-up-stable-decay, as
pure functions of the reference step, with the ends and shapes the configs promise."""

from __future__ import annotations

import math

import pytest

from dilonode.algo.lr_schedule import SCHEDULES, lr_factor


@pytest.mark.parametrize("kind", SCHEDULES)
def test_warm_up_is_linear_and_reaches_the_peak(kind):
    assert [lr_factor(kind, s, 100, warmup=10) for s in (1, 5, 10)] == [0.1, 0.5, 1.0]


def test_cosine_ends_at_the_floor_and_is_half_way_at_the_middle():
    assert lr_factor("cosine", 100, 100, warmup=0, min_ratio=0.1) == pytest.approx(0.1)
    assert lr_factor("cosine", 50, 100, warmup=0, min_ratio=0.0) == pytest.approx(0.5)
    assert lr_factor("cosine", 10_000, 100, min_ratio=0.1) == pytest.approx(0.1)  # past the end
    values = [lr_factor("cosine", s, 100, warmup=10) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_wsd_is_flat_then_decays_linearly_over_its_fraction():
    f = [lr_factor("wsd", s, 100, warmup=5, decay_fraction=0.2, min_ratio=0.0)
         for s in range(1, 101)]
    assert f[4:80] == [1.0] * 76  # steps 5..80
    assert f[89] == pytest.approx(0.5)  # half way through the decay (step 90)
    assert f[99] == pytest.approx(0.0)


def test_constant_stays_at_the_peak():
    assert {lr_factor("constant", s, 50) for s in range(1, 200)} == {1.0}


def test_bad_arguments_are_refused_with_what_is_wrong():
    with pytest.raises(ValueError, match="min_ratio"):
        lr_factor("cosine", 1, 10, min_ratio=2.0)
    with pytest.raises(ValueError, match="unknown"):
        lr_factor("linear", 1, 10)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="decay_fraction"):
        lr_factor("wsd", 50, 100, decay_fraction=0.0)
    assert math.isfinite(lr_factor("cosine", 0.5, 1))
