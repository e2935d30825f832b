"""Robust aggregation inside the sans-IO round: per-chunk checks at each owner, the
`rejected` list on result chunks, agreement between members and with the simulator."""

from __future__ import annotations

import asyncio
import struct
from types import SimpleNamespace

import pytest
import torch

from dilonode.algo.codecs import get_codec
from dilonode.algo.robust import AggregatorSpec, BanTracker
from dilonode.allreduce.memnet import Faults, MemNet
from dilonode.allreduce.retry import RoundPolicy, SwarmRounds
from dilonode.allreduce.round import AllReduceRound, GroupSpec, RoundState
from dilonode.collective import RoundRequest, SyncKey
from dilonode.sim.local_group import LocalGroup
from dilonode.wire.errors import RemoteProtocolError
from dilonode.wire.messages import Contribution, Result, message_from_dict, message_to_dict
from tests.support.config import nano_config

N, NUMEL, CHUNK = 4, 1000, 128


def _spec(codec: str = "float32") -> GroupSpec:
    return GroupSpec(run_id="robust", fragment=0, round=3, members=tuple(f"p{i}" for i in range(N)),
                     weights=(1.0,) * N, numel=NUMEL, codec=codec, block_size=64,
                     chunk_numel=CHUNK)


def _inputs(attacked: slice = slice(None)) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(NUMEL, generator=gen) * 0.1 + 0.05 for _ in range(N)]
    xs[3][attacked] *= 100  # member 3 scales (part of) its pseudo-gradient x100
    return xs


def _run(spec: GroupSpec, xs: list[torch.Tensor], agg: AggregatorSpec) -> list[AllReduceRound]:
    rounds = [AllReduceRound(spec, i, x, timeout=30.0, aggregator=agg) for i, x in enumerate(xs)]
    MemNet(rounds, None, start=0.0, wire=True).run()  # wire=True: through real frames
    return rounds


def _simulated(spec: GroupSpec, xs: list[torch.Tensor], agg: AggregatorSpec):
    group = LocalGroup(N, get_codec(spec.codec, spec.block_size), aggregator=agg,
                       chunk_numel=spec.chunk_numel, align=spec.block_size)
    pending = [group.view(i).begin(RoundRequest(SyncKey("fragment", 0, 3)), x)
               for i, x in enumerate(xs)]
    return [p.wait() for p in pending]


@pytest.mark.parametrize("codec", ["float32", "int8"])
@pytest.mark.parametrize("agg", [AggregatorSpec(norm_bound=3.0),
                                 AggregatorSpec(name="trimmed_mean", norm_bound=3.0),
                                 AggregatorSpec(name="centered_clip")])
def test_members_agree_with_each_other_and_the_simulator(codec: str, agg: AggregatorSpec):
    spec, xs = _spec(codec), _inputs()
    rounds = _run(spec, xs, agg)
    assert all(r.state is RoundState.DONE for r in rounds)
    assert len({r.digest for r in rounds}) == 1  # the digest check passed everywhere
    sim = _simulated(spec, xs, agg)
    assert all(torch.equal(r.result, s.mean) for r, s in zip(rounds, sim, strict=True))
    expected = (3,) if agg.norm_bound else ()
    assert all(r.rejected == expected and r.convicted == expected for r in rounds)
    assert all(s.report.rejected == tuple(str(i) for i in expected) for s in sim)
    honest = torch.stack(xs[:3]).mean(dim=0)
    assert float((rounds[0].result - honest).abs().max()) < 0.5  # the mean is ~25 away
    assert float((torch.stack(xs).mean(dim=0) - honest).abs().max()) > 5


@pytest.mark.parametrize("agg", [AggregatorSpec(), AggregatorSpec(name="trimmed_mean")])
def test_a_nan_in_float32_values_checked_at_the_reduction_names_its_sender(agg):
    # float32 contributions are checked through their chunk's reduction, not on arrival
    # (datapath.HostPath): the plain mean's encode refuses the NaN it summed, a robust
    # aggregator's decode refuses it; either way the round fails naming the sender.
    def poison(msg):
        if not isinstance(msg, Contribution):
            return msg
        payload = bytearray(msg.payload)
        payload[8:12] = struct.pack("<f", float("nan"))
        return msg.model_copy(update={"payload": bytes(payload)})

    spec, xs = _spec(), _inputs()
    rounds = [AllReduceRound(spec, i, x, timeout=30.0, aggregator=agg)
              for i, x in enumerate(xs)]
    MemNet(rounds, Faults().corrupt(3, 0, poison, once=True), start=0.0, wire=True).run()
    failure = rounds[0].failure
    assert rounds[0].state is RoundState.FAILED and failure.culprits == (3,), failure
    assert "p3" in failure.reason and "bad payload" in failure.reason
    assert "non-finite" in failure.reason, failure.reason
    assert all(r.state is RoundState.FAILED for r in rounds)
    assert all(r.failure.reported == (3,) for r in rounds[1:])


def test_rejection_in_one_part_reaches_every_member_through_the_result():
    spec = _spec()
    start, end = spec.parts[0]
    rounds = _run(spec, _inputs(slice(start, start + CHUNK)), AggregatorSpec(norm_bound=3.0))
    # Only owner 0 saw the outlier; the others learn it from its result chunk. One owner's
    # word is not a majority, so nobody counts it towards a ban.
    assert all(r.state is RoundState.DONE and r.rejected == (3,) for r in rounds)
    assert all(r.convicted == () for r in rounds)


def test_default_mean_names_nobody_and_sends_no_rejected_key():
    spec, xs = _spec(), _inputs()
    rounds = _run(spec, xs, AggregatorSpec())
    assert all(r.rejected == () for r in rounds)
    frames = [a for a in AllReduceRound(spec, 0, xs[0]).start(0.0)]
    assert frames and all("rejected" not in message_to_dict(a.msg) for a in frames)


def _result_body(**fields):
    base = dict(type="result", version=Result.model_fields["version"].default, run_id="r",
                fragment=0, round=0, attempt=0, group="", sender=1, owner=1, chunk=0,
                n_chunks=1, offset=0, numel=2, codec="float32", block_size=64,
                contributors=[0, 1, 2], payload=b"\0" * 8, digest="0" * 64)
    return base | fields


@pytest.mark.parametrize("rejected, needle", [
    ([2, 0], "strictly increasing"), ([1, 1], "strictly increasing"),
    ([3], "proper subset"), ([0, 1, 2], "proper subset"), ([], "rejected"),
    (["0"], "rejected")])
def test_malformed_rejected_list_is_refused(rejected, needle):
    with pytest.raises(RemoteProtocolError, match=needle):
        message_from_dict(_result_body(rejected=rejected))
    assert message_from_dict(_result_body(rejected=[0, 2])).rejected == (0, 2)


def test_swarm_rounds_leave_banned_peers_out_of_matchmaking():
    asked: list[set[str]] = []

    def form(req):
        asked.append(set(req.exclude))
        raise RuntimeError("no peers")  # the round then goes on alone

    bans = BanTracker(max_rejections=2, window=60.0, ban_seconds=30.0)
    now = [100.0]
    plane = SimpleNamespace(peer_id="me", run_id="robust")
    rounds = SwarmRounds(plane, form, RoundPolicy(codec="float32", max_attempts=1),  # type: ignore[arg-type]
                         clock=lambda: now[0], bans=bans)
    rounds._note_rejected(0, 1, ("evil", "me", "odd"), ("evil", "me"))
    rounds._note_rejected(0, 2, ("evil", "odd"), ("evil",))
    assert bans.banned(now[0]) == {"evil"} and not bans.is_banned("me", now[0])
    out = asyncio.run(rounds.reduce(RoundRequest(SyncKey("fragment", 0, 3)), torch.zeros(8)))
    assert out.skipped and asked == [{"evil"}]
    now[0] += 31.0  # the ban has run out
    asyncio.run(rounds.reduce(RoundRequest(SyncKey("fragment", 0, 4)), torch.zeros(8)))
    assert asked[-1] == set()


def _sim_cfg(**aggregator):
    return nano_config(total_steps=8, eval_every=8,
                       data={"seq_len": 16, "batch_size": 2, "eval_batches": 1},
                       diloco={"mode": "diloco", "sync_every": 4}, codec={"name": "int8"},
                       aggregator=aggregator, sim={"workers": 4})


@pytest.fixture
def one_thread():
    # Tiny models on shared cores: intra-op threads only spin (10x the CPU time measured).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_simulator_norm_check_drops_a_scaled_worker_like_a_nan_worker(one_thread):
    from dilonode.sim.training import simulate

    def attack(scale):
        def tamper(worker, key, flat):
            return flat * scale if worker == 3 else flat
        return tamper

    cfg = _sim_cfg(norm_bound=3.0)
    scaled = simulate(cfg, tamper=attack(100.0))
    nan = simulate(cfg, tamper=attack(float("nan")))
    plain = simulate(_sim_cfg(), tamper=attack(100.0))
    assert scaled.workers_agree and nan.workers_agree
    # Rejected in every chunk, worker 3 leaves the same trace as one whose values are NaN.
    assert scaled.outer_digest == nan.outer_digest
    assert plain.outer_digest != scaled.outer_digest


def test_aggregator_config_maps_to_the_spec_and_names_bad_values():
    from dilonode.config import ConfigError, load_config

    cfg = load_config(overrides={"aggregator": {"name": "centered_clip", "clip_tau": 2.0}})
    assert cfg.aggregator.spec() == AggregatorSpec(name="centered_clip", clip_tau=2.0)
    with pytest.raises(ConfigError, match=r"aggregator.norm_bound = 0.5: must be 0 \(off\)"):
        load_config(overrides={"aggregator": {"norm_bound": 0.5}})
    with pytest.raises(ConfigError, match="aggregator.name"):
        load_config(overrides={"aggregator": {"name": "median"}})
