"""State sync without sockets: adoption steps, manifests and their validation, choosing the
state to trust, scheduling chunks over peers, assembling, and the snapshot hand-off."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from dilonode.algo.outer import OuterState
from dilonode.algo.schedule import SyncPlan
from dilonode.statesync.bank import ChunkBank
from dilonode.statesync.plan import (
    Assembler,
    FetchPlan,
    choose_target,
    digests_of,
    fetch_order,
    manifest_of,
)
from dilonode.statesync.protocol import (
    Chunk,
    ChunkRequest,
    Manifest,
    ManifestRequest,
    decode_body,
    encode_frame,
)
from dilonode.statesync.server import SnapshotSource
from dilonode.train.state import WorkerState, adoption_step
from dilonode.wire.errors import RemoteProtocolError

CB = 4096
DIGEST = "ab" * 32


def _state(seed: int, rounds=(3, 3), step: int = 40, numel: int = 3000) -> WorkerState:
    g = torch.Generator().manual_seed(seed)
    tensors = {f"outer.{p}.{k}": torch.randn(numel + p, generator=g)
               for p in range(len(rounds)) for k in ("weights", "momentum")}
    return WorkerState(step, tuple(rounds), tuple(rounds), tensors)


def _manifest(state: WorkerState) -> Manifest:
    return manifest_of(state, "run", DIGEST, CB)


# -- adoption step -----------------------------------------------------------------------


def _in_flight(plan: SyncPlan, p: int, step: int) -> bool:
    started = plan.rounds_started(p, step)
    landed = plan.rounds_started(p, step - plan.delay) if step >= plan.delay else 0
    return started > landed


@pytest.mark.parametrize("h,n,tau", [(6, 3, 1), (6, 3, 0), (12, 4, 2), (30, 3, 5), (5, 1, 0)])
def test_adoption_step_is_the_latest_step_with_exactly_those_rounds(h, n, tau):
    plan = SyncPlan(h, n, tau)
    for step in range(0, 4 * h):
        if any(_in_flight(plan, p, step) for p in range(n)):
            continue
        landed = [plan.rounds_started(p, step) for p in range(n)]
        s = adoption_step(plan, landed)
        assert s is not None and s >= step
        assert [plan.rounds_started(p, s) for p in range(n)] == landed
        assert not any(_in_flight(plan, p, s) for p in range(n))
        assert [plan.rounds_started(p, s + 1) for p in range(n)] != landed  # the latest


def test_no_adoption_step_when_a_round_is_always_in_flight():
    plan = SyncPlan(6, 3, 5)  # fragments in flight 5 of every 6 steps, 2 steps apart
    assert adoption_step(plan, [1, 0, 0]) is None


# -- protocol ------------------------------------------------------------------------------


def test_messages_roundtrip_through_frames():
    m = _manifest(_state(1))
    for msg in (ManifestRequest(run_id="run"), ChunkRequest(digest=b"\1" * 32), m,
                Chunk(digest=b"\2" * 32, payload=b"xyz")):
        frame = encode_frame(msg)
        assert decode_body(frame[4:]) == msg


@pytest.mark.parametrize("body,reason", [
    (b"\xc1", "not msgpack"),
    (b"\x81\xa4type\xa4nope", "unknown message type"),
    (b"\x82\xa4type\xa6chunk?\xa6digest\xc4\x03abc", "digest"),
])
def test_bad_frames_are_remote_errors_with_one_line(body, reason):
    with pytest.raises(RemoteProtocolError, match=reason) as err:
        decode_body(body)
    assert "\n" not in str(err.value)


def test_manifest_with_wrong_chunk_count_is_refused():
    good = _manifest(_state(1)).model_dump()
    good["tensors"][0]["chunks"] = good["tensors"][0]["chunks"][:-1]
    with pytest.raises(ValueError, match="chunks for"):
        Manifest.model_validate(good)


def test_manifest_reuses_digests_of_unchanged_tensors():
    state, cache = _state(1), {}
    first = manifest_of(state, "run", DIGEST, CB, cache)
    marker = [b"\0" * 32] * len(cache["outer.0.weights"][1])
    cache["outer.0.weights"] = (state.tensors["outer.0.weights"], marker)  # same object
    again = manifest_of(state, "run", DIGEST, CB, cache)
    assert again.tensors[0].chunks == marker and again.tensors[1] == first.tensors[1]


# -- choosing the state ----------------------------------------------------------------------


def test_agreed_state_beats_a_newer_one_held_by_a_single_peer():
    old, new = _manifest(_state(1, (3, 3))), _manifest(_state(2, (4, 3)))
    t = choose_target({"a": old, "b": old, "c": new})
    assert t.manifest.content_key() == old.content_key() and t.supporters == ("a", "b")


def test_most_rounds_win_among_agreed_states_and_the_freshest_step_is_kept():
    old, new = _manifest(_state(1, (3, 3))), _manifest(_state(2, (4, 3), step=45))
    later = new.model_copy(update={"step": 47})
    t = choose_target({"a": old, "b": old, "c": new, "d": later})
    assert t.supporters == ("c", "d") and t.step == 47


def test_a_single_peer_is_trusted_when_nobody_agrees_and_none_means_none():
    a, b = _manifest(_state(1, (3, 3))), _manifest(_state(2, (2, 3)))
    assert choose_target({"a": a, "b": b}).supporters == ("a",)
    assert choose_target({}) is None


# -- scheduling chunks ------------------------------------------------------------------------


def _digests(n: int) -> list[bytes]:
    return [bytes([i]) * 32 for i in range(n)]


def test_chunks_are_spread_over_peers_and_each_asked_once():
    ds = _digests(6)
    plan = FetchPlan(ds + ds[:2], {"a": set(ds), "b": set(ds), "c": set(ds[3:])})
    got = {p: [plan.next_for(p), plan.next_for(p)] for p in ("a", "b", "c")}
    assert got["a"] == ds[0:2] and got["b"] == ds[2:4] and got["c"] == ds[4:6]
    assert plan.next_for("a") is None and plan.missing == 6


def test_a_dropped_peer_returns_its_chunks_to_the_others():
    ds = _digests(4)
    plan = FetchPlan(ds, {"a": set(ds), "b": set(ds)})
    a1, a2 = plan.next_for("a"), plan.next_for("a")
    plan.drop("a")
    assert plan.next_for("a") is None
    got = [plan.next_for("b") for _ in range(4)]
    assert set(got[:2]) == {a1, a2} and got[2:] == ds[2:]  # a's chunks go first


def test_a_peer_without_the_chunk_any_more_leaves_it_to_others_and_stuck_is_detected():
    ds = _digests(2)
    plan = FetchPlan(ds, {"a": set(ds), "b": {ds[1]}})
    d = plan.next_for("a")
    plan.failed("a", d)  # a's snapshot moved on: it no longer has ds[0]
    assert plan.next_for("a") == ds[1]
    assert plan.next_for("b") is None  # b never had ds[0]; ds[1] is with a
    plan.drop("a")
    assert not plan.stuck() and plan.next_for("b") == ds[1]
    plan.in_flight["b"].discard(ds[1])  # as if delivered
    assert plan.stuck() and not plan.complete  # only ds[0] is left, and nobody has it


def test_delivery_is_verified():
    payload = b"x" * 100
    import blake3

    d = blake3.blake3(payload).digest()  # the protocol's chunk digest
    plan = FetchPlan([d], {"a": {d}, "b": {d}})
    with pytest.raises(RemoteProtocolError, match="not asked for"):
        plan.delivered("a", d, payload)
    assert plan.next_for("a") == d
    with pytest.raises(RemoteProtocolError, match="does not match"):
        plan.delivered("a", d, b"y" * 100)
    plan.delivered("a", d, payload)
    assert plan.complete and plan.fetched_from == {"a": 100, "b": 0}


# -- assembling ------------------------------------------------------------------------------


def test_assembler_reuses_matching_chunks_and_fills_the_rest():
    truth, mine = _state(1), _state(2)
    mine.tensors["outer.1.weights"] = truth.tensors["outer.1.weights"].clone()
    m = _manifest(truth)
    asm = Assembler(m)
    reused = asm.reuse(mine)
    assert reused == truth.tensors["outer.1.weights"].numel() * 4
    for t in truth.tensors.values():
        for i, d in enumerate(digests_of(t, CB)):
            if d in asm.needed():
                asm.put(d, t.view(torch.uint8)[i * CB:(i + 1) * CB].numpy().tobytes())
    got = asm.state()
    assert got.meta() == truth.meta()
    assert all(torch.equal(got.tensors[n], t) for n, t in truth.tensors.items())


def test_assembler_refuses_an_incomplete_state_and_a_wrong_size_chunk():
    truth = _state(1)
    asm = Assembler(_manifest(truth))
    with pytest.raises(RuntimeError, match="missing"):
        asm.state()
    with pytest.raises(RemoteProtocolError, match="bytes"):
        asm.put(asm.needed()[0], b"short")


# -- snapshots --------------------------------------------------------------------------------


class _Worker:
    """Exports counted copies of one outer state."""

    def __init__(self) -> None:
        self.step, self.pending, self.exports = 7, {}, 0
        self.outer = [OuterState(torch.arange(10.0), 0.7, 0.9)]

    def export_state(self, reuse=None) -> WorkerState:
        self.exports += 1
        return WorkerState.capture(self.step, [1], self.outer, reuse)


def test_snapshot_waits_for_the_trainer_unless_it_is_idle_or_blocked():
    w, src = _Worker(), SnapshotSource()
    with pytest.raises(LookupError, match="no state"):
        src.request(0.1)
    src.attach(w)
    assert src.request(0.1).step == 7  # not training: taken by the caller
    src.training(True)
    with pytest.raises(TimeoutError, match="busy"):
        src.request(0.05)  # the trainer never came by
    got: list[WorkerState] = []
    w.step = 8
    t = threading.Thread(target=lambda: got.append(src.request(30)))
    t.start()
    deadline = time.monotonic() + 30
    while t.is_alive() and time.monotonic() < deadline:
        src.poll(w)  # the trainer passing steps; only a registered request makes it copy
        t.join(0.01)
    assert got and got[0].step == 8 and w.exports == 2
    src.blocked(True)  # trainer waits on a sync result: the state is frozen
    assert src.request(0.05).step == 8
    src.blocked(False)


def test_unchanged_fragments_are_shared_not_copied():
    w = _Worker()
    first = w.export_state()
    again = WorkerState.capture(9, [1], w.outer, first)
    assert again.tensors["outer.0.weights"] is first.tensors["outer.0.weights"]
    w.outer[0].step(torch.ones(10))  # a round landed
    moved = WorkerState.capture(10, [2], w.outer, first)
    assert moved.tensors["outer.0.weights"] is not first.tensors["outer.0.weights"]


# -- catching up with a round that lands mid-fetch -------------------------------------------


@pytest.mark.parametrize("rounds,last", [((3, 3, 3), 0), ((4, 3, 3), 1), ((4, 4, 3), 2)])
def test_fetch_order_puts_the_next_fragment_to_land_last(rounds, last):
    plan = SyncPlan(6, 3, 1)
    step = next(s for s in range(100)
                if [plan.rounds_started(p, s) for p in range(3)] == list(rounds))
    # the schedule agrees on which fragment starts its next round first
    nxt = min(range(3), key=lambda p: plan.start_step(p, rounds[p]))
    assert nxt == last and step < plan.start_step(nxt, rounds[nxt])
    m = _manifest(_state(1, rounds))
    order = fetch_order(m, [d for t in m.tensors for d in t.chunks])
    frag = {d: int(t.name.split(".")[1]) for t in m.tensors for d in t.chunks}
    tail = {frag[d] for d in order[-len(m.tensors[2 * last].chunks):]}
    assert tail == {last} and sorted(order) == sorted(frag)


def test_the_bank_carries_chunks_of_an_unfinished_fetch_to_a_newer_target():
    old, new = _state(1, (3, 3)), _state(1, (3, 3))
    new.tensors["outer.1.weights"] = new.tensors["outer.1.weights"] + 1.0  # a round landed
    first, bank = Assembler(_manifest(old)), ChunkBank(CB)
    for name in ("outer.0.weights", "outer.1.weights"):  # fetched before the switch
        t = old.tensors[name]
        for i, d in enumerate(digests_of(t, CB)):
            payload = bytes(t.view(torch.uint8).numpy()[i * CB:(i + 1) * CB])
            first.put(d, payload)
            bank.record_fetched(first, d, payload)
    second = Assembler(_manifest(new))
    carried = bank.fill(second)
    assert carried == old.tensors["outer.0.weights"].numel() * 4  # not the stale fragment 1
    left = set(second.needed())
    assert left == set(digests_of(new.tensors["outer.1.weights"], CB)) | \
        set(digests_of(new.tensors["outer.0.momentum"], CB)) | \
        set(digests_of(new.tensors["outer.1.momentum"], CB))


@pytest.mark.parametrize("h,n", [(30, 3), (12, 4), (7, 3), (6, 1), (10, 10)])
def test_snapshot_error_exactly_when_no_step_is_free_of_rounds(h, n):
    """`snapshot_error` (checked when a node starts) flags the schedules where every step has
    a round in flight, which `export_state` cannot snapshot: exactly those where no phase of
    the steady state has an adoption step."""
    from dilonode.train.state import snapshot_error

    for tau in range(h):
        plan = SyncPlan(h, n, tau)
        has_free_step = any(adoption_step(plan, [2] * k + [1] * (n - k)) is not None
                            for k in range(n))
        assert (snapshot_error(plan) == "") == has_free_step, (h, n, tau)


def test_a_node_refuses_a_schedule_it_could_never_snapshot():
    from dilonode.config import load_config
    from dilonode.statesync.keeper import StateKeeper

    cfg = load_config(overrides={"diloco": {"sync_every": 30, "num_fragments": 3,
                                            "fragment_sync_delay": 10}})
    with pytest.raises(ValueError, match=r"fragment_sync_delay = 10: a round is always in "
                                         r"flight.*use fewer than 10"):
        StateKeeper(cfg)
    StateKeeper(load_config(overrides={"diloco": {"sync_every": 30, "num_fragments": 3,
                                                  "fragment_sync_delay": 9}}))


def test_a_joiner_expects_its_fetch_to_end_later_when_rounds_keep_adding_results():
    from dilonode.statesync.rates import ResultRate, catch_up_seconds

    assert catch_up_seconds(10e6, 2e6, 0.0) == pytest.approx(5.0)
    assert catch_up_seconds(10e6, 2e6, 1e6) == pytest.approx(10.0)  # half the link chases
    assert catch_up_seconds(10e6, 1e6, 1e6) == float("inf")  # never catches up
    *_, m = _replaying_manifests()
    seen = ResultRate()
    seen.note([m[0]])
    assert seen.rate() == 0.0  # results listed at the start are history, not new rounds
    seen.since -= 4.0
    seen.note([m[1], m[1]])  # one new round's result, read from two peers
    new = m[1].replays[-1].nbytes
    assert seen.rate() == pytest.approx(new / 4.0, rel=0.05)


def _replaying_manifests() -> tuple[list[WorkerState], list[Manifest]]:
    from tests.unit.test_replay import _history

    states = _history(rounds=2)
    return states, [manifest_of(s, "run", DIGEST, CB) for s in states[1:]]


def test_a_slow_fetch_keeps_about_a_second_of_chunks_in_flight():
    """At 10 Mbit/s, 16 chunks of 1 MiB in flight (4 peers x window 4) take 13 s to arrive,
    and a fetch that a round cuts short waits for them all before it goes on."""
    from dilonode.statesync.rates import RateMeter

    mib = 1 << 20
    meter = RateMeter()
    assert meter.window(mib, peers=4, most=4) == 1  # no rate yet
    for k in range(5):  # 10 Mbit/s: a chunk every 0.84 s
        meter.add(mib, now=100.0 + 0.84 * k)
    assert meter.rate(now=103.4) == pytest.approx(1.25e6, rel=0.05)
    assert meter.window(mib, peers=4, most=4, now=103.4) == 1  # 4 in all, not 16
    assert meter.window(mib, peers=1, most=4, now=103.4) == 2  # never fewer than 2 in all
    fast = RateMeter()
    for k in range(200):  # 100 MB/s: 96 chunks a second
        fast.add(mib, now=10.0 + k * 0.0105)
    assert fast.window(mib, peers=3, most=4, now=12.1) == 4  # statesync.window binds
    assert fast.window(mib, peers=3, most=64, now=12.1) == 32


def test_a_stop_abandons_a_recovery_in_progress(monkeypatch, tmp_path):
    """A node told to stop while it fetches the state (minutes over a slow link) stops
    then: the recovery is cancelled and the node starts from what it had."""
    from types import SimpleNamespace

    from dilonode.config import load_config
    from dilonode.net.loop_thread import LoopThread
    from dilonode.statesync import keeper as keeper_mod

    started, cancelled = threading.Event(), threading.Event()

    async def never_done(*args, **kwargs):
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    monkeypatch.setattr(keeper_mod, "recover", never_done)
    cfg = load_config(overrides={"paths": {"out_dir": str(tmp_path)}})
    keeper = keeper_mod.StateKeeper(cfg)
    worker = SimpleNamespace(export_state=lambda: SimpleNamespace(step=0, rounds=[0, 0, 0]))
    stop = threading.Event()
    thread = LoopThread("test-recover", use_uvloop=False)
    thread.start()
    try:
        def stop_once_fetching() -> None:
            started.wait(10)
            stop.set()

        helper = threading.Thread(target=stop_once_fetching)
        helper.start()
        keeper._recover(worker, thread, {"peer": "127.0.0.1:1"}, None, None, stop=stop)
        helper.join()
        assert cancelled.wait(10), "the recovery was not cancelled"
        assert keeper.recovery is None
    finally:
        thread.stop()
