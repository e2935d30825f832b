"""Token-weighted rounds: every aggregator weights by the tokens each contribution claims,
the networked round agrees with the simulator's arithmetic, and inflated claims are refused."""

from __future__ import annotations

import pytest
import torch

from dilonode.algo.butterfly import butterfly_average, reduce_mean, reduce_weighted
from dilonode.algo.codecs import get_codec
from dilonode.algo.robust import AggregatorSpec, aggregate, check_claims
from dilonode.allreduce.memnet import MemNet
from dilonode.allreduce.round import AllReduceRound, GroupSpec, RoundState
from dilonode.collective import RoundRequest, SyncKey
from dilonode.sim.local_group import LocalGroup
from dilonode.wire.errors import RemoteProtocolError

N, NUMEL, CHUNK = 4, 1000, 128
AGGREGATORS = [AggregatorSpec(), AggregatorSpec(norm_bound=3.0),
               AggregatorSpec(name="trimmed_mean", trim=1),
               AggregatorSpec(name="centered_clip")]


def _inputs(n: int = N, numel: int = NUMEL) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randn(numel, generator=gen) * 0.1 + 0.02 * i for i in range(n)]


def test_weighted_mean_is_the_token_weighted_average():
    xs = _inputs()
    tokens = [30720.0, 30720.0, 15360.0, 7680.0]
    got = reduce_weighted(xs, tokens)
    want = sum(x.double() * t for x, t in zip(xs, tokens, strict=True)) / sum(tokens)
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=0)
    # Equal claims are exactly the protocol's plain mean (sum, then divide by N).
    assert torch.equal(reduce_weighted(xs, [5.0] * N), reduce_mean(xs))
    assert torch.equal(reduce_weighted(xs, None), reduce_mean(xs))


@pytest.mark.parametrize("agg", AGGREGATORS, ids=lambda a: f"{a.name}-{a.norm_bound}")
def test_every_aggregator_weights_by_tokens(agg: AggregatorSpec):
    xs = _inputs()
    equal = aggregate(xs, agg, weights=[1.0] * N).value
    assert torch.equal(equal, aggregate(xs, agg).value)  # equal claims change nothing
    # Member 0 (a fast GPU) trained 8x the tokens of the others: the mean moves toward it.
    heavy = aggregate(xs, agg, weights=[8.0, 1.0, 1.0, 1.0]).value
    assert float((heavy - xs[0]).norm()) < float((equal - xs[0]).norm())
    # A member with no tokens moves nothing in the plain weighted mean.
    if agg.name == "mean":
        zero = aggregate(xs, agg, weights=[1.0, 1.0, 1.0, 0.0]).value
        torch.testing.assert_close(zero, reduce_mean(xs[:3]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("agg", AGGREGATORS, ids=lambda a: f"{a.name}-{a.norm_bound}")
def test_an_inflated_token_claim_is_refused_by_every_aggregator(agg: AggregatorSpec):
    xs = _inputs()
    honest = [30720.0, 15360.0, 3072.0]  # speeds spanning 10x pass
    out = aggregate(xs, agg, weights=[*honest, 30720.0 * 1000])
    assert out.rejected == (3,)
    assert torch.equal(out.value, aggregate(xs[:3], agg, weights=honest).value)
    assert aggregate(xs, agg, weights=[*honest, 30720.0]).rejected == ()


def test_claim_check_rules():
    assert check_claims([1.0, 16.0], 16.0) == []  # 16x: allowed
    assert check_claims([1.0, 16.5], 16.0) == [1]  # just above: refused
    assert check_claims([10.0, 10.0, 1e6], 16.0) == [2]
    assert check_claims([10.0, 10.0, 1e6, 1e6], 16.0) == [2, 3]  # half: the lower median
    assert check_claims([1.0, 1.0, 0.05], 16.0) == []  # one slow member refuses nobody
    assert check_claims([1e6, 1e6, 10.0], 16.0) == []  # a majority sets the median
    assert check_claims([0.0, 1e9], 16.0) == []  # nobody else claimed anything
    assert check_claims([1.0, 1e9], 0.0) == []  # the check is off


def _spec(codec: str, n: int = N) -> GroupSpec:
    return GroupSpec(run_id="tokens", fragment=0, round=2, members=tuple(f"p{i}" for i in range(n)),
                     weights=(1.0,) * n, numel=NUMEL, codec=codec, block_size=64,
                     chunk_numel=CHUNK)


@pytest.mark.parametrize("codec", ["float32", "int4"])
@pytest.mark.parametrize("agg", AGGREGATORS[:3], ids=lambda a: f"{a.name}-{a.norm_bound}")
def test_networked_round_equals_the_simulator_with_unequal_tokens(codec: str,
                                                                 agg: AggregatorSpec):
    spec, xs = _spec(codec), _inputs()
    tokens = [30720.0, 30720.0, 15360.0, 7680.0]
    rounds = [AllReduceRound(spec, i, x, aggregator=agg, weight=t)
              for i, (x, t) in enumerate(zip(xs, tokens, strict=True))]
    MemNet(rounds, None, start=0.0, wire=True).run()
    assert all(r.state is RoundState.DONE for r in rounds)
    assert len({r.digest for r in rounds}) == 1
    group = LocalGroup(N, get_codec(codec, 64), aggregator=agg, chunk_numel=CHUNK, align=64)
    pending = [group.view(i).begin(RoundRequest(SyncKey("fragment", 0, 2), t), x)
               for i, (x, t) in enumerate(zip(xs, tokens, strict=True))]
    sim = [p.wait() for p in pending]
    assert all(torch.equal(r.result, s.mean) for r, s in zip(rounds, sim, strict=True))
    plain, _, _ = butterfly_average(xs, [1.0] * N, get_codec(codec, 64), chunk_numel=CHUNK)
    assert not torch.equal(rounds[0].result, plain)  # the weights mattered


def test_networked_round_refuses_an_inflated_claim_and_convicts_it():
    spec, xs = _spec("float32"), _inputs()
    tokens = [30720.0, 30720.0, 15360.0, 30720.0 * 1000]
    rounds = [AllReduceRound(spec, i, x, weight=t)
              for i, (x, t) in enumerate(zip(xs, tokens, strict=True))]
    MemNet(rounds, None, start=0.0, wire=True).run()
    assert all(r.state is RoundState.DONE for r in rounds)
    # Every owner rejected member 3 in every chunk: a majority, so it counts to a ban.
    assert all(r.rejected == (3,) and r.convicted == (3,) for r in rounds)
    honest = reduce_weighted(xs[:3], tokens[:3])
    assert float((rounds[0].result - honest).abs().max()) < 1e-6


def test_a_claim_that_changes_between_chunks_fails_the_round():
    spec, xs = _spec("float32", n=2), _inputs(2)
    rounds = [AllReduceRound(spec, i, x, weight=100.0) for i, x in enumerate(xs)]
    actions = rounds[1].start(0.0)
    sends = [a for a in actions if hasattr(a, "msg") and a.msg.type == "contribution"]
    assert len(sends) >= 2
    rounds[0].start(0.0)
    rounds[0].receive(1, sends[0].msg, 0.0)
    forged = sends[1].msg.model_copy(update={"weight": 1e6})
    with pytest.raises(RemoteProtocolError, match="claims weight"):
        rounds[0]._handle(1, forged)


def test_weight_bounds_are_local_errors():
    spec, xs = _spec("float32"), _inputs()
    with pytest.raises(ValueError, match="weight"):
        AllReduceRound(spec, 0, xs[0], weight=float("nan"))
    with pytest.raises(ValueError, match="weight"):
        AllReduceRound(spec, 0, xs[0], weight=-1.0)
