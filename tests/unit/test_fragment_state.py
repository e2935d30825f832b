"""A worker's per-fragment bookkeeping (dilonode/train/fragment_state.py): which rounds the
outer state holds while one is in flight, what starting, abandoning and refusing a round do
to the counters and the chain."""

from __future__ import annotations

import pytest
import torch

from dilonode.algo.chain import chain_next, chain_start
from dilonode.algo.fragments import Fragment
from dilonode.algo.outer import NonFiniteError, OuterState
from dilonode.collective import ReduceResult, RoundReport
from dilonode.train.fragment_state import FragmentState


class _Done:
    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> ReduceResult:
        raise AssertionError("not waited for here")


def _fragment(numel: int = 8) -> FragmentState:
    outer = OuterState(torch.zeros(numel), 0.7, 0.9)
    return FragmentState(0, Fragment(0, (0,), (0,)), [], outer, chain_start("d" * 64, 0))


def test_a_round_in_flight_is_not_landed_and_a_mixing_round_claims_no_counter():
    f = _fragment()
    f.tokens_since = 96
    assert f.claim(2) == (2, 96) and f.next_round == 3 and f.tokens_since == 0
    f.launched(2, _Done(), step=5)
    assert f.landed() == 2 and f.pending.launched_at == 5
    f.take_landing()
    assert f.landed() == 3 and f.pending is None
    f.launched(3, _Done(), step=9, mix=True)
    assert f.landed() == 3


@pytest.mark.parametrize("mix", [False, True])
def test_an_abandoned_round_gives_its_counter_back_unless_it_was_mixing(mix):
    f = _fragment()
    f.claim(0)
    f.launched(4 if mix else 0, _Done(), step=1, mix=mix)
    f.abandon()
    assert f.pending is None and f.next_round == (1 if mix else 0)


def test_a_refused_result_moves_the_chain_but_not_the_outer_state():
    f = _fragment()
    chain, before = f.chain, f.outer.weights.clone()
    mean = torch.full((8,), float("nan"))
    with pytest.raises(NonFiniteError):
        f.outer_step(0, ReduceResult(mean, RoundReport(2, 0, 0), digest="ab" * 16), keep_rounds=3)
    assert f.chain == chain_next(chain, 0, "ab" * 16, applied=False)
    assert torch.equal(f.outer.weights, before) and f.replays == []
