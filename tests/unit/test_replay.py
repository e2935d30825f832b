"""Replaying rounds on a fragment (no sockets): the encoded result a round keeps decodes to
its result bit for bit, replaying it gives what the members' outer step gave, servers keep
the last rounds' results and manifests carry and check them, and a joiner's chunk bank
brings chunks held at older versions forward through several rounds, only when it is
cheaper and only where the outcome hashes to the target's digests."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from dilonode.algo.codecs import get_codec
from dilonode.algo.outer import OuterState
from dilonode.algo.replay import (
    EncodedResult,
    keep_replay,
    kept_rounds,
    replay_round,
    replayer,
)
from dilonode.allreduce.memnet import MemNet
from dilonode.allreduce.round import AllReduceRound, GroupSpec
from dilonode.collective import ReduceResult, RoundReport
from dilonode.statesync.bank import ChunkBank
from dilonode.statesync.keeper import StateKeeper
from dilonode.statesync.plan import Assembler, chunk_bytes_of, digests_of, manifest_of
from dilonode.statesync.protocol import Manifest
from dilonode.train.data import load_data
from dilonode.train.state import WorkerState
from dilonode.train.worker import Worker

CB = 4096
DIGEST = "ab" * 32
LR, MU = 0.7, 0.9
STEP = functools.partial(replay_round, lr=LR, momentum_coef=MU, nesterov=True)
REPLAYER = replayer(lambda _p, _r: LR, MU, True)


def _encode(x: torch.Tensor, codec: str = "int4", piece: int = 1000) -> EncodedResult:
    c = get_codec(codec, 64)
    return EncodedResult.of_pieces(codec, 64, [(len(x[a:a + piece]), c.encode(x[a:a + piece])[0])
                                               for a in range(0, x.numel(), piece)])


@pytest.mark.parametrize("codec", ["int4", "int8", "float32", "topk64_int2"])
def test_a_rounds_encoded_result_decodes_to_its_result_on_every_member(codec):
    # (top-k rounds cut their chunks at multiples of its 4096-value chunk)
    spec = GroupSpec(run_id="r", fragment=0, round=3, members=("a", "b", "c"),
                     weights=(1.0, 2.0, 1.0), numel=5000 if "topk" not in codec else 20000,
                     codec=codec, block_size=64,
                     chunk_numel=640 if "topk" not in codec else 4096)
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
    w, m = STEP(w0, m0, enc)
    assert torch.equal(w, members.weights) and torch.equal(m, members.momentum_buf)
    assert torch.equal(w0, before[0]) and torch.equal(m0, before[1])  # inputs untouched
    with pytest.raises(ValueError, match="the fragment 2999"):
        STEP(w0[:2999], m0[:2999], enc)


def test_encoded_result_from_a_blob_checks_its_size():
    enc = _encode(torch.randn(2500))
    again = EncodedResult.from_blob("int4", 64, enc.numels, enc.blob())
    assert again == enc
    with pytest.raises(ValueError, match="bytes"):
        EncodedResult.from_blob("int4", 64, enc.numels, enc.blob()[:-1])


# -- manifests and the joiner's plan -----------------------------------------------------


def _history(numel: int = 6000, rounds: int = 1, *, tamper: bool = False
             ) -> list[WorkerState]:
    """A 2-fragment state, then the same after each of `rounds` more rounds of fragment 1,
    each state serving the results of the rounds since the first (algo/replay.py)."""
    gen = torch.Generator().manual_seed(2)
    outer = [OuterState(torch.randn(numel + p, generator=gen), LR, MU) for p in range(2)]
    for st in outer:
        st.step(torch.randn(st.weights.numel(), generator=gen) * 0.01)
    states, kept = [WorkerState.capture(40, [1, 1], outer)], []
    for k in range(rounds):
        enc = _encode(torch.randn(numel + 1, generator=gen) * 0.01)
        outer[1].step(enc.decode())
        if tamper and k == rounds - 1:  # what is served is not what was applied
            enc = _encode(torch.randn(numel + 1, generator=gen) * 0.01)
        kept.append(enc)
        states.append(WorkerState.capture(70 + 30 * k, [1, 2 + k], outer, reuse=states[-1],
                                          replays={1: tuple(kept)}))
    return states


def _states(numel: int = 6000, *, tamper: bool = False) -> tuple[WorkerState, WorkerState]:
    """A 2-fragment state, and the same after one more round of fragment 1 (with replay)."""
    old, new = _history(numel, 1, tamper=tamper)
    return old, new


def _banked(bank: ChunkBank, state: WorkerState, names: dict[str, list[int]] | None = None
            ) -> None:
    """Put chunks of `state` in `bank` (`names`: only these chunk indices of these tensors)
    as a fetch of it would."""
    asm = Assembler(manifest_of(state, "run", DIGEST, CB))
    for t in asm.manifest.tensors:
        if names is not None and t.name not in names:
            continue
        for i, d in enumerate(t.chunks):
            if names is None or i in names[t.name]:
                bank.record_fetched(asm, d, chunk_bytes_of(state.tensors[t.name], i, CB))


def _derive(target_state: WorkerState, bank: ChunkBank) -> tuple[Assembler, list, list]:
    """The target assembled from `bank` (held chunks, then derivations run with the
    results served): (assembler, derivations, their (bytes, why))."""
    m = manifest_of(target_state, "run", DIGEST, CB)
    asm = Assembler(m)
    bank.fill(asm)
    jobs = bank.plan(asm)
    blobs = {d: blob[i * CB:(i + 1) * CB] for r, blob in _served(target_state, m)
             for i, d in enumerate(r.chunks)}
    for job in jobs:
        for d in job.wants(bank):
            bank.put_result(d, blobs[d])
    return asm, jobs, [job.run(bank, asm, REPLAYER) for job in jobs]


def _served(state: WorkerState, m: Manifest) -> list[tuple[object, bytes]]:
    out = []
    for p, kept in state.replays.items():
        first = state.rounds[p] - len(kept)
        for j, enc in enumerate(kept):
            (spec,) = [r for r in m.replays if (r.fragment, r.round) == (p, first + j)]
            out.append((spec, enc.blob()))
    return out


def test_manifest_lists_the_replays_of_the_last_rounds_and_refuses_inconsistent_ones():
    *_, new = _history(rounds=3)
    m = manifest_of(new, "run", DIGEST, CB)
    assert [(r.fragment, r.round, r.codec, sum(r.numels)) for r in m.replays] == \
        [(1, k, "int4", 6001) for k in (1, 2, 3)]
    assert Manifest.model_validate(m.model_dump()) == m
    for at, bad, why in ((2, {"round": 2}, "listed after its round 2"),
                         (0, {"round": 0}, "listed after its round 0"),
                         (2, {"numels": [6000]}, "6000 values"),
                         (1, {"fragment": 7}, "not a fragment"),
                         (0, {"nbytes": 10 * CB}, "chunks for")):
        data = m.model_dump()
        data["replays"][at].update(bad)
        with pytest.raises(ValueError, match=why):
            Manifest.model_validate(data)
    data = m.model_dump()
    data["replays"] = data["replays"][:2]  # must end at the round that made the state
    with pytest.raises(ValueError, match="last replay, but the state has landed 4 rounds"):
        Manifest.model_validate(data)


def test_a_fragment_one_round_old_is_replayed_into_exactly_the_targets_bytes():
    old, new = _states()
    bank = ChunkBank(CB)
    _banked(bank, old)
    asm, jobs, outcomes = _derive(new, bank)
    (job,) = jobs
    assert (job.fragment, job.start) == (1, 1) and outcomes[0][1] == ""
    got = asm.state()
    for name, t in new.tensors.items():
        assert torch.equal(got.tensors[name], t), name


def test_chunks_held_at_several_versions_are_brought_to_the_target_bit_for_bit():
    """A slow joiner's fetch, cut short by rounds: pairs of weights and momentum chunks of
    fragment 1 held at versions 1, 2 and 3 of 4 rounds on come out exactly the target's;
    a weights chunk whose momentum was fetched at a later version cannot be, and is left
    to be fetched."""
    states = _history(rounds=4)  # fragment 1 at rounds 1 (states[0]) .. 5 (states[4])
    n = len(digests_of(states[0].tensors["outer.1.weights"], CB))  # 6 chunks
    bank = ChunkBank(CB)
    _banked(bank, states[0], {"outer.0.weights": list(range(n)),
                              "outer.0.momentum": list(range(n))})
    _banked(bank, states[0], {"outer.1.weights": [0, 1, 3], "outer.1.momentum": [0, 1]})
    _banked(bank, states[1], {"outer.1.weights": [2], "outer.1.momentum": [2, 3]})
    _banked(bank, states[3], {"outer.1.weights": [4], "outer.1.momentum": [4]})
    asm, jobs, outcomes = _derive(states[4], bank)
    (job,) = jobs
    assert (job.fragment, job.start, outcomes[0][1]) == (1, 1, "")
    target = states[4]
    left = set(asm.needed())
    want_left = {digests_of(target.tensors["outer.1.weights"], CB)[i] for i in (3, 5)} | \
        {digests_of(target.tensors["outer.1.momentum"], CB)[5]}
    assert left == want_left  # weights 3: its momentum came a version later; 5: never held
    for name in ("outer.1.weights", "outer.1.momentum"):
        ds = digests_of(target.tensors[name], CB)
        for i in range(n):
            if ds[i] not in left:
                assert torch.equal(asm.tensors[name].view(torch.uint8)[i * CB:(i + 1) * CB],
                                   target.tensors[name].view(torch.uint8)[i * CB:(i + 1) * CB])


def test_a_replay_that_does_not_hash_right_leaves_the_target_to_be_fetched():
    old, new = _states(tamper=True)
    bank = ChunkBank(CB)
    _banked(bank, old)
    asm, _, outcomes = _derive(new, bank)
    assert outcomes[0][0] == 0 and "digests differ" in outcomes[0][1]
    assert set(asm.needed()) == set(digests_of(new.tensors["outer.1.weights"], CB)) | \
        set(digests_of(new.tensors["outer.1.momentum"], CB))


def test_replay_is_planned_only_when_cheaper_and_only_from_rounds_served():
    states = _history(rounds=3)
    new = states[3]
    m_new = manifest_of(new, "run", DIGEST, CB)
    n = len(m_new.tensors[2].chunks)
    # One chunk held two rounds old: its bytes are fewer than the two results'.
    little = ChunkBank(CB)
    _banked(little, states[1], {"outer.1.momentum": [0]})
    assert little.plan(Assembler(m_new)) == []
    most = ChunkBank(CB)
    _banked(most, states[1], {"outer.1.weights": list(range(n - 1)),
                              "outer.1.momentum": list(range(n - 1))})
    assert [j.start for j in most.plan(Assembler(m_new))] == [2]
    # Four rounds on when the server keeps three: nothing to replay from.
    older = WorkerState(10, (1, 0), (1, 0), dict(states[0].tensors))
    bank = ChunkBank(CB)
    _banked(bank, older)
    assert bank.plan(Assembler(m_new)) == []
    # A version whose outer steps do not match the rounds since (a refused round) neither.
    skipped = WorkerState(10, (1, 2), (1, 1), dict(states[1].tensors))
    bank = ChunkBank(CB)
    _banked(bank, skipped)
    assert bank.plan(Assembler(m_new)) == []
    # Already the target's: nothing to derive.
    same = ChunkBank(CB)
    _banked(same, new)
    asm = Assembler(m_new)
    same.fill(asm)
    assert same.plan(asm) == [] and asm.needed() == []


def test_keep_replay_keeps_consecutive_rounds_within_its_bounds():
    enc = _encode(torch.randn(640))
    kept: list = []
    for r in range(5):
        kept = keep_replay(kept, r, enc, max_rounds=3, max_bytes=10**9)
    assert [r for r, _ in kept] == [2, 3, 4]
    assert [r for r, _ in keep_replay(kept, 6, enc, 3, 10**9)] == [6]  # round 5 not kept
    assert [r for r, _ in keep_replay(kept, 5, enc, 3, 2 * enc.nbytes)] == [4, 5]
    assert keep_replay(kept, 5, enc, 0, 10**9) == []


class _Int4Pair:
    """A collective whose "group" averages our value with itself through int4, and keeps
    the encoded result as the network collective does."""

    def begin(self, request, flat, *, encoded=None, state=None):
        enc = _encode(flat.detach().clone())
        result = ReduceResult(enc.decode(), RoundReport(2, 0, 0), encoded=enc)

        class _Done:
            def done(self):
                return True

            def wait(self, timeout=None):
                return result
        return _Done()


@pytest.mark.parametrize(("keep", "schedule"), [(16, "constant"), (1, "constant"),
                                               (16, "cosine")])
def test_a_workers_exported_state_replays_its_last_rounds_from_the_state_before(keep, schedule):
    """The keeper's replayer steps each round at the outer rate its members used, the one
    of the reference step it started at, so a replay ends on the members' exact bytes with
    the outer rate on a schedule too."""
    from tests.unit.test_checkpoint import _h4_p2_config

    cfg = _h4_p2_config()
    cfg = cfg.model_copy(update={
        "statesync": cfg.statesync.model_copy(update={"replay_rounds": keep}),
        "diloco": cfg.diloco.model_copy(update={"outer_lr_schedule": schedule}),
        "total_steps": 12})
    replay = StateKeeper(cfg)._replayer()
    worker = Worker(cfg, load_data(cfg.data), _Int4Pair(), identity=0)
    states = {}
    while worker.step < 11:  # fragment 0 lands at 3, 7, 11; fragment 1 at 5, 9
        worker.train_step()
        worker.launch()
        worker.land()
        states[worker.step] = worker.export_state()
    after = states[11]
    assert after.rounds == (3, 2)
    assert {p: len(kept) for p, kept in after.replays.items()} == {0: min(keep, 3),
                                                                  1: min(keep, 2)}
    before = next(s for s in states.values() if s.rounds[0] == 3 - len(after.replays[0]))
    w, m = before.tensors["outer.0.weights"], before.tensors["outer.0.momentum"]
    for r, enc in enumerate(after.replays[0], start=3 - len(after.replays[0])):  # oldest first
        w, m = replay(0, r, w, m, enc)
    assert torch.equal(w, after.tensors["outer.0.weights"])
    assert torch.equal(m, after.tensors["outer.0.momentum"])
    # A state adopted from elsewhere has no round of ours to offer.
    worker.import_state(after)
    assert worker.export_state().replays == {}


def test_a_replay_is_not_planned_from_rounds_the_servers_may_drop_before_it_is_fetched():
    """Servers keep the last results within `keep_rounds` and the fragment's state bytes:
    a derivation from further back than that, less the rounds expected to land while its
    results are fetched, would lose its first results before it got them."""
    states = _history(rounds=3)
    new = states[3]
    m_new = manifest_of(new, "run", DIGEST, CB)

    def bank() -> ChunkBank:
        held = ChunkBank(CB)
        _banked(held, states[0])  # three rounds behind, everything held
        return held

    assert [j.start for j in bank().plan(Assembler(m_new))] == [1]
    assert bank().plan(Assembler(m_new), keep_rounds=2) == []
    rate = 3 * m_new.replays[0].nbytes  # the three results take a second to fetch
    # Two rounds land meanwhile: the first result is gone before it is fetched.
    assert bank().plan(Assembler(m_new), keep_rounds=4, rate=rate, rounds_per_s=2.0) == []
    assert [j.start for j in bank().plan(Assembler(m_new), keep_rounds=4, rate=rate,
                                         rounds_per_s=1.0)] == [1]
    # Once too old, a version stays too old (it only gets older), whatever the estimate.
    held = bank()
    assert held.plan(Assembler(m_new), keep_rounds=4, rate=rate, rounds_per_s=2.0) == []
    assert held.plan(Assembler(m_new), keep_rounds=4) == []
    result = m_new.replays[0].nbytes
    assert kept_rounds(16, 6001, result) == 8 * 6001 // result == 14


def test_results_fetched_for_an_earlier_target_still_derive_after_the_servers_drop_them():
    """A joiner three rounds behind fetches the results of rounds 1-2, then round 3 lands
    and its servers, keeping one round, now serve round 3's result alone: the results it
    holds (with the manifest entries that listed them) still bring its state to the new
    target, at the cost of round 3's result; a joiner holding none has nothing to derive."""
    states = _history(rounds=3)  # fragment 1 at rounds 1 (states[0]) .. 4 (states[3])
    bank = ChunkBank(CB)
    _banked(bank, states[0])
    m_mid = manifest_of(states[2], "run", DIGEST, CB)
    (job,) = bank.plan(Assembler(m_mid))
    assert (job.fragment, job.start) == (1, 1)
    blobs = {d: blob[i * CB:(i + 1) * CB] for r, blob in _served(states[2], m_mid)
             for i, d in enumerate(r.chunks)}
    for d in job.wants(bank):
        bank.put_result(d, blobs[d])
    m_new = manifest_of(states[3], "run", DIGEST, CB)
    last_only = m_new.model_copy(update={"replays": [r for r in m_new.replays
                                                     if r.round == 3]})
    asm = Assembler(last_only)
    bank.fill(asm)
    (job,) = bank.plan(asm, keep_rounds=1)
    assert [r.round for r in job.rounds] == [1, 2, 3]
    assert set(job.wants(bank)) == set(last_only.replays[0].chunks)
    served = {d: blob[i * CB:(i + 1) * CB] for r, blob in _served(states[3], m_new)
              for i, d in enumerate(r.chunks) if r.round == 3}
    for d in job.wants(bank):
        bank.put_result(d, served[d])
    filled, why = job.run(bank, asm, REPLAYER)
    assert why == "" and filled > 0
    assert asm.needed() == []
    assert torch.equal(asm.state().tensors["outer.1.weights"],
                       states[3].tensors["outer.1.weights"])
    fresh = ChunkBank(CB)
    _banked(fresh, states[0])
    assert fresh.plan(Assembler(last_only), keep_rounds=1) == []


def test_rounds_replay_as_their_results_arrive_and_a_later_target_goes_on_from_there():
    """A slow joiner's fetch: each round is replayed once its result is held, while the
    rest is still coming; when a round lands mid-fetch the next pass's derivation goes on
    from the rounds replayed, replaying only what is new, and ends on the target's bytes."""
    states = _history(rounds=4)  # fragment 1 at rounds 1 (states[0]) .. 5 (states[4])
    calls: list[int] = []

    def counting(p: int, r: int, w: torch.Tensor, m: torch.Tensor, result: EncodedResult):
        calls.append(result.numel)
        return REPLAYER(p, r, w, m, result)

    bank = ChunkBank(CB)
    _banked(bank, states[0])
    m_mid = manifest_of(states[2], "run", DIGEST, CB)
    asm = Assembler(m_mid)
    bank.fill(asm)
    (job,) = bank.plan(asm)
    assert [r.round for r in job.rounds] == [1, 2] and not job.ready(bank)
    first, second = _served(states[2], m_mid)
    for i, d in enumerate(first[0].chunks):
        bank.put_result(d, first[1][i * CB:(i + 1) * CB])
    assert job.ready(bank) and job.advance(bank, asm, counting) == 1
    assert not job.ready(bank) and job.advance(bank, asm, counting) == 0  # round 2 not held
    assert bank.progress[1].done == [(1, tuple(first[0].chunks))]

    m_new = manifest_of(states[4], "run", DIGEST, CB)
    asm = Assembler(m_new)
    bank.fill(asm)
    (job,) = bank.plan(asm)
    assert [r.round for r in job.rounds] == [1, 2, 3, 4]
    assert len(bank.progress[1].done) == 1  # the same start and chunks: kept
    blobs = {d: blob[i * CB:(i + 1) * CB] for r, blob in _served(states[4], m_new)
             for i, d in enumerate(r.chunks)}
    for d in job.wants(bank):
        bank.put_result(d, blobs[d])
    filled, why = job.run(bank, asm, counting)
    assert why == "" and filled > 0 and asm.needed() == []
    assert len(calls) == 4 and job.late == 3  # rounds 1, 2, 3 and 4 once each
    for name, t in states[4].tensors.items():
        assert torch.equal(asm.state().tensors[name], t), name

    # Held chunks of another version make another derivation: it starts afresh.
    other = ChunkBank(CB)
    _banked(other, states[1])
    other.progress[1] = bank.progress[1]
    (job,) = other.plan(Assembler(m_new))
    assert job.start == 2 and 1 not in other.progress
