"""Bounded groups in the simulator: `LocalGroup` splits a round as the daemon's matchmaking
does, mixes each group's outer states in mixing rounds, and a run with at most
`max_group_size` workers is bit for bit the run without groups."""

from __future__ import annotations

import torch

from dilonode.algo.codecs import get_codec
from dilonode.algo.groups import partition
from dilonode.algo.mixing import pack_state
from dilonode.collective import RoundRequest, SyncKey
from dilonode.sim.local_group import LocalGroup
from dilonode.sim.training import simulate
from tests.support.config import nano_config

BASE = {"run_id": "groups-sim", "seed": 3, "eval_every": 12, "total_steps": 24,
        "data": {"seq_len": 16, "batch_size": 2, "eval_batches": 1},
        "diloco": {"num_fragments": 2, "pacing": "steps"}}


def _cfg(workers: int, **network: object):
    return nano_config(**BASE, sim={"workers": workers}, network=network)


def test_at_most_max_group_size_workers_run_exactly_as_one_group() -> None:
    torch.set_num_threads(1)
    wide = simulate(_cfg(4, max_group_size=16))
    exact = simulate(_cfg(4, max_group_size=4))
    assert wide.outer_digest == exact.outer_digest and wide.workers_agree
    assert wide.bytes_sent_per_worker == exact.bytes_sent_per_worker
    assert wide.replica_spread == 0.0


def test_a_grouped_run_mixes_and_ends_in_agreement() -> None:
    torch.set_num_threads(1)
    rep = simulate(_cfg(6, max_group_size=3, final_mix_rounds=2))
    assert rep.workers_agree  # the end-of-run adoption makes them identical
    assert 0.0 < rep.replica_spread < 0.05, rep.replica_spread
    one = simulate(_cfg(6))
    assert abs(rep.final_eval_loss - one.final_eval_loss) < 0.05
    # States travel in float32: a grouped round costs more than an int4 one.
    assert rep.bytes_sent_per_worker > one.bytes_sent_per_worker


def _round(group: LocalGroup, n: int, key: SyncKey, numel: int = 256):
    torch.manual_seed(key.round)
    states = [pack_state(torch.randn(numel), torch.randn(numel)) for _ in range(n)]
    pending = [group.view(i).begin(RoundRequest(key), torch.randn(numel) * 0.01,
                                   state=lambda i=i: states[i]) for i in range(n)]
    return states, [h.wait() for h in pending]


def test_local_group_splits_a_round_and_each_group_ends_on_its_mean_state() -> None:
    n, m = 10, 4
    group = LocalGroup(n, get_codec("int4", 64), max_group_size=m, run_id="lg")
    key = SyncKey("fragment", 0, 2)
    states, results = _round(group, n, key)
    want = partition([str(i) for i in range(n)], m, "lg", 0, 2)
    assert all(len(g) <= m for g in want) and len(want) >= 3
    for g in want:
        members = sorted(int(w) for w in g)
        first = results[members[0]]
        mean = torch.stack([states[i] for i in members]).sum(0) / len(members)
        torch.testing.assert_close(first.state_mean, mean, atol=1e-6, rtol=0)
        for i in members:
            r = results[i]
            assert r.report.grouped and r.report.group_size == len(members)
            assert torch.equal(r.mean, first.mean) and torch.equal(r.state_mean,
                                                                   first.state_mean)
            assert r.state_digest == first.state_digest != ""
    assert len({r.digest for r in results}) == len(want)  # one pseudo-gradient per group


def test_rounds_that_do_not_mix_carry_no_state_and_small_swarms_never_mix() -> None:
    group = LocalGroup(10, get_codec("int4", 64), max_group_size=4, mix_every=2, run_id="lg")
    _, results = _round(group, 10, SyncKey("fragment", 0, 1))
    assert all(r.report.grouped and r.state_mean is None for r in results)
    small = LocalGroup(4, get_codec("int4", 64), max_group_size=4, run_id="lg")
    _, results = _round(small, 4, SyncKey("fragment", 0, 0))
    assert all(not r.report.grouped and r.state_mean is None and r.report.group_size == 4
               for r in results)
