"""Replaying a round on a fragment (no sockets): the encoded result a round keeps decodes to
its result bit for bit, replaying it gives what the members' outer step gave, manifests
carry and check it, and a joiner's fetch plan uses it only when it is cheaper and only if
the outcome hashes to the target's digests."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from dilonode.algo.codecs import get_codec
from dilonode.algo.outer import OuterState
from dilonode.algo.replay import EncodedResult, replay_round
from dilonode.allreduce import AllReduceRound, GroupSpec, MemNet
from dilonode.collective import ReduceResult
from dilonode.statesync.plan import Assembler, chunk_bytes_of, manifest_of, plan_replays
from dilonode.statesync.protocol import Manifest
from dilonode.train.data import load_data
from dilonode.train.state import WorkerState
from dilonode.train.worker import Worker

CB = 4096
DIGEST = "ab" * 32
LR, MU = 0.7, 0.9
REPLAYER = functools.partial(replay_round, lr=LR, momentum_coef=MU, nesterov=True)


def _encode(x: torch.Tensor, codec: str = "int4", piece: int = 1000) -> EncodedResult:
    c = get_codec(codec, 64)
    return EncodedResult(codec, 64, tuple((len(x[a:a + piece]), c.encode(x[a:a + piece])[0])
                                          for a in range(0, x.numel(), piece)))


@pytest.mark.parametrize("codec", ["int4", "int8", "float32"])
def test_a_rounds_encoded_result_decodes_to_its_result_on_every_member(codec):
    spec = GroupSpec(run_id="r", fragment=0, round=3, members=("a", "b", "c"),
                     weights=(1.0, 2.0, 1.0), numel=5000, codec=codec, block_size=64,
                     chunk_numel=640)
    gen = torch.Generator().manual_seed(0)
    rounds = [AllReduceRound(spec, i, torch.randn(spec.numel, generator=gen), timeout=30.0,
                             keep_encoded=True) for i in range(spec.size)]
    MemNet(rounds, start=0.0).run()
    blobs = set()
    for rnd in rounds:
        enc = rnd.encoded
        assert enc is not None and enc.numel == spec.numel
        assert torch.equal(enc.decode(), rnd.result)
        blobs.add(enc.blob())
    assert len(blobs) == 1  # every member serves the same bytes
    alone = dataclasses.replace(spec, members=("a",), weights=(1.0,))
    plain = AllReduceRound(alone, 0, torch.zeros(spec.numel), timeout=30.0)
    plain.start(0.0)
    assert plain.encoded is None  # kept only when asked (memory)


def test_replay_is_the_members_outer_step_and_leaves_its_inputs_alone():
    gen = torch.Generator().manual_seed(1)
    members = OuterState(torch.randn(3000, generator=gen), LR, MU)
    members.step(torch.randn(3000, generator=gen))  # some momentum already
    w0, m0 = members.weights.clone(), members.momentum_buf.clone()
    enc = _encode(torch.randn(3000, generator=gen) * 0.01)
    members.step(enc.decode())
    before = (w0.clone(), m0.clone())
    w, m = REPLAYER(w0, m0, enc)
    assert torch.equal(w, members.weights) and torch.equal(m, members.momentum_buf)
    assert torch.equal(w0, before[0]) and torch.equal(m0, before[1])  # inputs untouched
    with pytest.raises(ValueError, match="the fragment 2999"):
        REPLAYER(w0[:2999], m0[:2999], enc)


def test_encoded_result_from_a_blob_checks_its_size():
    enc = _encode(torch.randn(2500))
    again = EncodedResult.from_blob("int4", 64, enc.numels, enc.blob())
    assert again == enc
    with pytest.raises(ValueError, match="bytes"):
        EncodedResult.from_blob("int4", 64, enc.numels, enc.blob()[:-1])


# -- manifests and the joiner's plan -----------------------------------------------------


def _states(numel: int = 6000, *, tamper: bool = False) -> tuple[WorkerState, WorkerState]:
    """A 2-fragment state, and the same after one more round of fragment 1 (with replay)."""
    gen = torch.Generator().manual_seed(2)
    outer = [OuterState(torch.randn(numel + p, generator=gen), LR, MU) for p in range(2)]
    for st in outer:
        st.step(torch.randn(st.weights.numel(), generator=gen) * 0.01)
    old = WorkerState.capture(40, [1, 1], outer)
    enc = _encode(torch.randn(numel + 1, generator=gen) * 0.01)
    outer[1].step(enc.decode())
    if tamper:  # what is served is not what was applied
        enc = _encode(torch.randn(numel + 1, generator=gen) * 0.01)
    new = WorkerState.capture(70, [1, 2], outer, reuse=old, replays={1: enc})
    return old, new


def _filled(m: Manifest, state: WorkerState, upto: float = 1.0) -> Assembler:
    """An assembler of `m` holding the first `upto` of each tensor's chunks of `state`."""
    asm = Assembler(m)
    for t in m.tensors:
        for i, d in enumerate(t.chunks[:int(len(t.chunks) * upto)]):
            asm.put(d, chunk_bytes_of(state.tensors[t.name], i, CB))
    return asm


def test_manifest_lists_the_replay_of_the_last_round_and_refuses_inconsistent_ones():
    _, new = _states()
    m = manifest_of(new, "run", DIGEST, CB)
    (r,) = m.replays
    assert (r.fragment, r.round, r.codec, sum(r.numels)) == (1, 1, "int4", 6001)
    assert Manifest.model_validate(m.model_dump()) == m
    for bad, why in (({"round": 0}, "landed 2 rounds"), ({"numels": [6000]}, "6000 values"),
                     ({"fragment": 7}, "not a fragment"), ({"nbytes": 10 * CB}, "chunks for")):
        data = m.model_dump()
        data["replays"][0].update(bad)
        with pytest.raises(ValueError, match=why):
            Manifest.model_validate(data)


def test_a_fragment_one_round_old_is_replayed_into_exactly_the_targets_bytes():
    old, new = _states()
    target = Assembler(manifest_of(new, "run", DIGEST, CB))
    target.reuse(old)  # fragment 0 did not change
    held = _filled(manifest_of(old, "run", DIGEST, CB), old)
    (job,) = plan_replays(target, held)
    assert job.wants() == list(dict.fromkeys(target.manifest.replays[0].chunks))
    blob = new.replays[1].blob()
    for i, d in enumerate(job.spec.chunks):
        job.put(d, blob[i * CB:(i + 1) * CB])
    assert job.run(target, REPLAYER) == ""
    got = target.state()
    for name, t in new.tensors.items():
        assert torch.equal(got.tensors[name], t), name


def test_a_replay_that_does_not_hash_right_leaves_the_target_to_be_fetched():
    old, new = _states(tamper=True)
    target = Assembler(manifest_of(new, "run", DIGEST, CB))
    target.reuse(old)
    (job,) = plan_replays(target, _filled(manifest_of(old, "run", DIGEST, CB), old))
    blob = new.replays[1].blob()
    for i, d in enumerate(job.spec.chunks):
        job.put(d, blob[i * CB:(i + 1) * CB])
    missing = target.needed()
    assert "digests differ" in job.run(target, REPLAYER)
    assert target.needed() == missing


def test_replay_is_planned_only_when_cheaper_and_only_one_round_on():
    old, new = _states()
    m_new, m_old = (manifest_of(s, "run", DIGEST, CB) for s in (new, old))
    # Little of the old fragment held: fetching the new one is cheaper.
    assert plan_replays(Assembler(m_new), _filled(m_old, old, upto=0.1)) == []
    assert len(plan_replays(Assembler(m_new), _filled(m_old, old, upto=0.9))) == 1
    # Two rounds on (or the same round) cannot be replayed from one result.
    older = WorkerState(10, (1, 0), (1, 0), dict(old.tensors))
    assert plan_replays(Assembler(m_new), _filled(manifest_of(older, "run", DIGEST, CB),
                                                  older)) == []
    assert plan_replays(Assembler(m_new), _filled(m_new, new)) == []


class _Int4Pair:
    """A collective whose "group" averages our value with itself through int4, and keeps
    the encoded result as the network collective does."""

    def begin(self, key, flat, weight=1.0, state=None):
        enc = _encode(flat.detach().clone())
        result = ReduceResult(enc.decode(), 2, 0, 0, encoded=enc)

        class _Done:
            def done(self):
                return True

            def wait(self, timeout=None):
                return result
        return _Done()


def test_a_workers_exported_state_replays_its_last_round_from_the_one_before():
    from tests.unit.test_checkpoint import _h4_p2_config

    cfg = _h4_p2_config()
    a = cfg.diloco.effective()
    replayer = functools.partial(replay_round, lr=a.outer_lr, momentum_coef=a.outer_momentum,
                                 nesterov=a.outer_nesterov)
    worker = Worker(cfg, load_data(cfg.data), _Int4Pair(), identity=0)
    states = {}
    while worker.step < 11:  # fragment 0 lands at 3, 7, 11; fragment 1 at 5, 9
        worker.train_step()
        worker.launch()
        worker.land()
        states[worker.step] = worker.export_state()
    before, after = states[10], states[11]
    assert (before.rounds, after.rounds) == ((2, 2), (3, 2))
    assert sorted(after.replays) == [0, 1]  # each fragment's last round
    w, m = replayer(before.tensors["outer.0.weights"], before.tensors["outer.0.momentum"],
                    after.replays[0])
    assert torch.equal(w, after.tensors["outer.0.weights"])
    assert torch.equal(m, after.tensors["outer.0.momentum"])
    # A state adopted from elsewhere has no round of ours to offer.
    worker.import_state(after)
    assert worker.export_state().replays == {}
