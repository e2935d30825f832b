"""Checkpoints: crash-safe writes, verified reads with fallback, pruning, background saves,
and the worker's state export/import they are made of."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from dilonode.algo.codecs import get_codec
from dilonode.config import load_config
from dilonode.sim.local_group import LocalGroup
from dilonode.statesync.server import SnapshotSource
from dilonode.train.checkpoint import (
    Checkpointer,
    latest_checkpoints,
    load_checkpoint,
    load_data_position,
    load_latest,
    resume_data,
    save_checkpoint,
)
from dilonode.train.data import load_data
from dilonode.train.state import WorkerState, config_digest
from dilonode.train.worker import Worker
from tests.support.config import nano_config
from tests.support.waiting import wait_until

RUN, DIGEST = "ckpt-test", "ab" * 32


def _state(step: int, numel: int = 100) -> WorkerState:
    g = torch.Generator().manual_seed(step)
    tensors = {f"outer.{p}.{k}": torch.randn(numel + p, generator=g)
               for p in range(2) for k in ("weights", "momentum")}
    return WorkerState(step, (step // 10, step // 10), (step // 10, step // 10), tensors)


def _same(a: WorkerState, b: WorkerState) -> bool:
    return a.meta() == b.meta() and all(torch.equal(t, b.tensors[n])
                                        for n, t in a.tensors.items())


def test_roundtrip_and_metadata(tmp_path):
    path = save_checkpoint(tmp_path, _state(30), RUN, DIGEST, keep=3)
    meta = json.loads(path.read_text())
    assert meta["run_id"] == RUN and meta["config_digest"] == DIGEST
    assert meta["state"] == {"step": 30, "rounds": [3, 3], "outer_steps": [3, 3], "chains": []}
    loaded, where = load_latest(tmp_path, RUN, DIGEST)
    assert where == path and _same(loaded, _state(30))


def test_keeps_only_the_newest_k(tmp_path):
    for step in (10, 20, 30, 40, 50):
        save_checkpoint(tmp_path, _state(step), RUN, DIGEST, keep=3)
    assert [p.name for p in latest_checkpoints(tmp_path)] == [
        "ckpt-0000000050.json", "ckpt-0000000040.json", "ckpt-0000000030.json"]
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [
        f"ckpt-00000000{s}.safetensors" for s in (30, 40, 50)]


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path, caplog, damage):
    save_checkpoint(tmp_path, _state(10), RUN, DIGEST, keep=3)
    save_checkpoint(tmp_path, _state(20), RUN, DIGEST, keep=3)
    blob = tmp_path / "ckpt-0000000020.safetensors"
    raw = bytearray(blob.read_bytes())
    if damage == "flip":
        raw[len(raw) // 2] ^= 0x40
    else:
        raw = raw[: len(raw) // 2]
    blob.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING):
        loaded, where = load_latest(tmp_path, RUN, DIGEST)
    assert where.name == "ckpt-0000000010.json" and _same(loaded, _state(10))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "ckpt-0000000020" in lines[0] and "torn or corrupt" in lines[0]
    assert "\n" not in lines[0]


def test_other_run_or_config_is_refused_with_a_reason(tmp_path):
    path = save_checkpoint(tmp_path, _state(10), RUN, DIGEST, keep=3)
    with pytest.raises(ValueError, match="run id 'ckpt-test' != 'other'"):
        load_checkpoint(path, "other", DIGEST)
    with pytest.raises(ValueError, match="config digest differs"):
        load_checkpoint(path, RUN, "cd" * 32)
    assert load_latest(tmp_path, RUN, "cd" * 32) is None


@pytest.mark.parametrize("point", ["tensors-written", "tensors-renamed", "meta-written"])
def test_a_failure_mid_save_leaves_the_previous_checkpoint(tmp_path, point):
    save_checkpoint(tmp_path, _state(10), RUN, DIGEST, keep=3)

    def fail(at: str) -> None:
        if at == point:
            raise OSError(f"injected at {at}")

    with pytest.raises(OSError, match="injected"):
        save_checkpoint(tmp_path, _state(20), RUN, DIGEST, keep=3, hook=fail)
    loaded, where = load_latest(tmp_path, RUN, DIGEST)
    assert where.name == "ckpt-0000000010.json" and _same(loaded, _state(10))
    # the next save clears what the failed one left behind
    save_checkpoint(tmp_path, _state(30), RUN, DIGEST, keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-0000000010.json", "ckpt-0000000010.safetensors",
        "ckpt-0000000030.json", "ckpt-0000000030.safetensors"]


_CHILD = """
import sys, time, torch
from pathlib import Path
sys.path.insert(0, {root!r})
from dilonode.train.checkpoint import save_checkpoint
from dilonode.train.state import WorkerState
d, point = Path(sys.argv[1]), sys.argv[2]
def state(step):
    return WorkerState(step, (1,), (1,), {{"outer.0.weights": torch.full((1000,), float(step)),
                                          "outer.0.momentum": torch.zeros(1000)}})
save_checkpoint(d, state(10), "r", "d", keep=3)
def hook(at):
    if at == point:
        (d / "ready").touch()
        time.sleep(600)  # parked here until the parent SIGKILLs us
save_checkpoint(d, state(20), "r", "d", keep=3, hook=hook)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("point", ["tensors-renamed"])
def test_sigkill_during_a_save_leaves_the_previous_checkpoint(tmp_path, point):
    root = str(Path(__file__).parents[2])
    child = subprocess.Popen([sys.executable, "-c", _CHILD.format(root=root),
                              str(tmp_path), point])

    def parked() -> bool:
        if (tmp_path / "ready").exists():
            return True
        assert child.poll() is None, "child exited before reaching the save point"
        return False

    try:
        wait_until(parked, 45, interval=0.05, what="the child at the save point")
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
    finally:
        if child.poll() is None:
            child.kill()
    loaded, where = load_latest(tmp_path, "r", "d")
    assert loaded.step == 10 and torch.equal(loaded.tensors["outer.0.weights"],
                                             torch.full((1000,), 10.0))


class _FakeWorker:
    def __init__(self) -> None:
        self.step, self.pending, self.exportable = 0, {}, True

    def export_state(self) -> WorkerState:
        if not self.exportable:
            raise RuntimeError("no step without a round in flight")
        return _state(self.step)


def test_checkpointer_saves_in_background_at_boundaries_and_skips_when_busy(tmp_path):
    release, entered = threading.Event(), threading.Event()

    def slow_disk(at: str) -> None:
        if at == "tensors-written":
            entered.set()
            assert release.wait(30)

    ck = Checkpointer(tmp_path, RUN, DIGEST, every_steps=5, keep=10, hook=slow_disk)
    w = _FakeWorker()
    w.step = 4
    assert not ck.maybe_save(w)  # not due
    w.step, w.exportable = 5, False
    assert not ck.maybe_save(w) and ck.skipped == 1  # due, but no consistent state
    w.step, w.exportable = 6, True
    assert not ck.maybe_save(w)  # next one due at 10
    w.step = 10
    t0 = time.perf_counter()
    assert ck.maybe_save(w)
    assert entered.wait(30)
    w.step = 15
    assert not ck.maybe_save(w) and ck.skipped == 2  # previous still writing: skipped
    assert time.perf_counter() - t0 < 5, "maybe_save must not wait for the disk"
    release.set()
    ck.wait(30)
    w.step = 20
    assert ck.maybe_save(w)
    ck.wait(30)
    assert [p.name for p in latest_checkpoints(tmp_path)] == [
        "ckpt-0000000020.json", "ckpt-0000000010.json"]


def _worker(cfg, identity=0) -> tuple[Worker, LocalGroup]:
    group = LocalGroup(1, get_codec(cfg.codec.name, cfg.codec.block_size))
    return Worker(cfg, load_data(cfg.data), group.view(0), identity=identity), group


def _h4_p2_config():
    """nano, H = 4, two fragments, tau = 1: fragment 0's rounds start at steps 2, 6, 10, ...,
    fragment 1's at 4, 8, ...; each lands one step after it starts."""
    return nano_config(data={"seq_len": 16, "batch_size": 2, "eval_batches": 8},
                       diloco={"sync_every": 4, "num_fragments": 2},
                       codec={"name": "float32"})


def _run_to(worker, step: int) -> None:
    """Train, start and land rounds as the training loop does, up to `step`."""
    while worker.step < step:
        worker.train_step()
        worker.launch()
        worker.land()


def test_worker_export_import_roundtrip():
    cfg = _h4_p2_config()
    a, _ = _worker(cfg)
    while a.step < 9:
        a.train_step()
        a.launch()
        if a.step == 8:  # fragment 1 starts at 8 and lands at 9: in flight now, so the
            mid = a.export_state()  # state is the one a worker holds at the end of step 7
            assert (mid.step, mid.rounds) == (7, (2, 1))
        a.land()
    state = a.export_state()
    assert state.step == 9 and state.rounds == (2, 2)
    b, _ = _worker(cfg, identity=1)
    b.import_state(state)
    assert b.step == 9 and torch.equal(b.outer_flat(), a.outer_flat())
    # local weights start at the outer weights; inner AdamW starts empty
    for local, outer in zip(b.model.parameters(), b.outer_model().parameters(), strict=True):
        assert torch.equal(local, outer)
    assert not b.opt.state
    assert config_digest(cfg) != config_digest(cfg.model_copy(update={"seed": 1}))
    bad = WorkerState(10, state.rounds, state.outer_steps, state.tensors)
    with pytest.raises(ValueError, match="round counters"):
        b.import_state(bad)  # at step 10 fragment 0 has started its third round


def test_a_checkpoint_after_drain_resumes_without_rounds_due_again(tmp_path):
    """Training ends at step 8, where fragment 1's round starts (it lands at 9): `drain`
    lands it early. The checkpoint must resume at 9, not at 8, where the schedule would
    land that round again with nothing in flight (found resuming a GPU swarm's node)."""
    cfg = _h4_p2_config()
    a, _ = _worker(cfg)
    _run_to(a, 8)
    a.drain()
    save_checkpoint(tmp_path, a.export_state(), RUN, DIGEST, keep=1)
    state, path = load_latest(tmp_path, RUN, DIGEST)
    assert path.name == "ckpt-0000000009.json" and (state.step, state.rounds) == (9, (2, 2))
    b, _ = _worker(cfg)
    b.import_state(state)
    _run_to(b, 14)  # fragment 0 lands at 11, fragment 1 at 13
    assert b.stats.rounds == {0: 1, 1: 1}


def test_a_joiners_floor_leaves_out_only_the_rounds_in_flight_that_count_it():
    """While fragment 1's round is in flight (step 8), a joiner that round counts may adopt
    the state from before it (step 7: it takes part in the round), and the snapshot served
    meanwhile reaches that floor; a joiner it does not count must wait for it to land."""
    cfg = _h4_p2_config()
    w, _ = _worker(cfg)
    while w.step < 8:
        w.train_step()
        w.launch()
        if w.step < 8:
            w.land()
    assert w.in_flight() == [1]
    round_1 = w.frags[1].pending.round
    src = SnapshotSource()
    src.attach(w, lambda frag, rnd, joiner: joiner == "J" and (frag, rnd) == (1, round_1))
    served = src.request(1.0)  # not training: taken at once, without the round in flight
    assert served.step == 7
    assert src.step_now("J") == 7 <= served.step  # counted: no waiting on each other
    assert src.step_now("K") == 8 > served.step  # not counted: wait for the landing
    assert src.step_now() == 8
    w.train_step()
    w.land()  # step 9: the round landed
    assert not w.in_flight() and src.step_now("J") == src.step_now("K") == 9


def test_a_joiners_floor_leaves_out_a_round_due_but_not_launched_yet():
    """Between a step and the launch of the round due at it, the round has not started: it
    will count the joiner asking now (its record is visible), so the floor must not wait
    for it to land (the two would wait on each other for the matchmaking window)."""
    cfg = _h4_p2_config()
    w, _ = _worker(cfg)
    _run_to(w, 7)
    w.train_step()  # step 8: fragment 1's round 1 is due, not launched
    src = SnapshotSource()
    src.attach(w, lambda frag, rnd, joiner: False)  # nothing in flight counts anyone
    assert not w.in_flight() and w.step == 8
    assert src.step_now("J") == 7 and src.step_now() == 8
    w.launch()  # launched without counting the joiner (it was not visible yet): wait for it
    assert w.in_flight() == [1] and src.step_now("J") == 8


def test_a_joiners_first_round_sets_the_step_its_state_must_reach():
    """A joiner that names reference step J as its first round (`PeerRecord.joins_from`)
    needs every round that starts before J landed, and none from J on: the state a peer
    exports once exactly those rounds landed is at its floor, and the state one round
    short of them is below it. Rounds due but not launched yet do not lower it (they
    start before J: no peer counts the joiner in them), though a peer's own floor, which
    expects them to count the joiner, leaves them out."""
    from dilonode.algo.pacing import rounds_before

    cfg = _h4_p2_config()  # fragment 0 starts at 2, 6, 10, ...; fragment 1 at 4, 8, ...
    w, _ = _worker(cfg)
    assert rounds_before(w.plan, 8.0) == [2, 1]  # 2, 6 and 4: the round at 8 counts it
    assert rounds_before(w.plan, 8.5) == rounds_before(w.plan, 9.0) == [2, 2]
    assert rounds_before(w.plan, 0.0) == [0, 0]
    floor = w.joining_floor(8.5)
    _run_to(w, 7)
    short = w.export_state()  # fragment 1's round at 8 has not landed
    assert list(short.rounds) == [2, 1] and short.step < floor
    w.train_step()  # step 8: that round is due, not launched
    assert w.floor_step(lambda _f, _r: False) == 7 < floor == w.joining_floor(8.5) == 9
    w.launch()
    w.train_step()
    w.land()  # step 9: it landed
    full = w.export_state()
    assert list(full.rounds) == rounds_before(w.plan, 8.5) and full.step >= floor


def test_the_end_of_run_rounds_start_while_the_rounds_in_flight_land():
    """A run that ends at step 8: fragment 1's round (started at 8) is in flight and
    fragment 0 has trained since its round at 6. The training loop starts fragment 0's
    end-of-run round before it waits for fragment 1's round, so on a slow link the two
    overlap instead of following each other; the outer state comes out the same, bit for
    bit, as landing everything first and then running the end-of-run rounds."""
    from dilonode.train.loop import train_loop

    cfg = _h4_p2_config()
    w, _ = _worker(cfg)
    events: list[tuple[str, int]] = []
    start, land = w._start, w._land_fragment
    w._start = lambda p, r: (events.append(("start", p)), start(p, r))[1]  # type: ignore
    w._land_fragment = lambda p: (events.append(("land", p)), land(p))[1]  # type: ignore
    evals = load_data(cfg.data).eval_batches(16, 2, 1)
    train_loop(w, 8, 100, evals, threading.Event())
    assert events[-3:] == [("start", 0), ("land", 1), ("land", 0)], events
    assert w.step == 8 and not w.in_flight() and w.stats.rounds == {0: 3, 1: 2}

    before, _ = _worker(cfg)  # the same run, landing everything before the last rounds
    before.end_step = 8
    _run_to(before, 7)
    before.train_step()
    before.launch()
    assert before.in_flight() == [1]
    before.drain()
    before.start_final()
    before.drain()
    for a, b in zip(w.frags, before.frags, strict=True):
        assert torch.equal(a.outer.weights, b.outer.weights)
        assert torch.equal(a.outer.momentum_buf, b.outer.momentum_buf)


def test_a_joiner_takes_part_in_the_round_its_state_leaves_it_at_if_one_round_behind():
    """Paced by the clock, a joiner adopts a state without the rounds in flight that count
    it (the floor above): when it starts, the next round of that fragment may have started
    too. It takes part in the round its state leaves it at (its group waits for it in
    matchmaking) instead of skipping to the newer one; further behind, it skips as a paused
    worker does."""
    from dilonode.algo.pacing import SwarmClock, TimePacer
    from dilonode.algo.schedule import SyncStart

    cfg = _h4_p2_config()
    src, _ = _worker(cfg)
    _run_to(src, 7)
    state = src.export_state()
    assert list(state.rounds) == [2, 1]  # fragment 0: rounds 2, 6; fragment 1: round 4
    timed = cfg.model_copy(update={"diloco": cfg.diloco.model_copy(update={"pacing": "time"})})
    now = [14.5]  # fragment 0's round 3 started at reference step 14, fragment 1's 2 at 12

    def joiner() -> Worker:
        group = LocalGroup(1, get_codec(cfg.codec.name, cfg.codec.block_size))
        w = Worker(timed, load_data(cfg.data), group.view(0), identity=1,
                   pacer=TimePacer(lambda: now[0], SwarmClock(t0=0.0, step_seconds=1.0)))
        w.import_state(state)
        return w

    w = joiner()
    assert w.due() == [SyncStart(0, 2), SyncStart(1, 1)]
    w.start_due(w.due())
    assert w.stats.missed == 0 and w.in_flight() == [0, 1]
    w.land()
    now[0] = 22.5  # two rounds of each fragment since: behind as a paused worker is
    w.pacer.restart()  # (no step time measured: no lead)
    assert w.due() == [SyncStart(0, 5), SyncStart(1, 4)]
    now[0] = 17.5  # a fresh joiner one round behind on fragment 0, two on fragment 1
    assert joiner().due() == [SyncStart(0, 2), SyncStart(1, 3)]


class _ResumingWorker:
    step, pending, wait_hook = 0, {}, None

    def __init__(self) -> None:
        self.imported: list[WorkerState] = []

    def import_state(self, state: WorkerState) -> None:
        self.imported.append(state)
        self.step = state.step


def test_resume_skips_a_torn_newest_checkpoint_then_publishes(tmp_path):
    from dilonode.statesync.keeper import StateKeeper

    cfg = load_config(overrides={"run_id": RUN, "paths": {"out_dir": str(tmp_path)},
                                 "statesync": {"enabled": False}})
    digest = config_digest(cfg)
    save_checkpoint(tmp_path / "ckpt", _state(10), RUN, digest, keep=3)
    save_checkpoint(tmp_path / "ckpt", _state(20), RUN, digest, keep=3)
    (tmp_path / "ckpt" / "ckpt-0000000020.safetensors").write_bytes(b"torn")
    worker, published = _ResumingWorker(), []
    keeper = StateKeeper(cfg, resume=True)
    keeper.prepare(worker, thread=None, dht=None, publish=lambda: published.append(True))
    assert [s.step for s in worker.imported] == [10] and _same(worker.imported[0], _state(10))
    assert keeper.resumed_from.name == "ckpt-0000000010.json" and published == [True]


def _data_config(tmp_path: Path, source: str):
    """The H = 4, P = 2 run of `_h4_p2_config`, checkpointing under tmp_path, on the builtin
    corpus or on a small Parquet file written here."""
    data: dict[str, object] = {"seq_len": 16, "batch_size": 2}
    if source == "parquet":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        docs = [f"document {i}: " + "the quick brown fox " * (i % 7 + 1) for i in range(400)]
        pq.write_table(pa.table({"text": docs}), tmp_path / "c.parquet", row_group_size=20)
        data.update(source="parquet", path=str(tmp_path / "c.parquet"), eval_batches=2)
    return load_config(overrides={
        "run_id": RUN, "model": {"preset": "nano"}, "device": "cpu", "data": data,
        "diloco": {"sync_every": 4, "num_fragments": 2, "fragment_sync_delay": 1},
        "codec": {"name": "float32"}, "paths": {"out_dir": str(tmp_path)},
        "statesync": {"enabled": False}})


@pytest.mark.parametrize("source", ["builtin", "parquet"])
def test_a_resumed_worker_goes_on_with_the_batches_an_uninterrupted_one_would(tmp_path,
                                                                               source):
    from dilonode.statesync.keeper import StateKeeper

    cfg = _data_config(tmp_path, source)
    a, _ = _worker(cfg)
    _run_to(a, 6)
    path = Checkpointer(tmp_path / "ckpt", RUN, config_digest(cfg), 0, 3).save_now(a)
    assert path is not None and path.with_name(f"{path.stem}.data.json").is_file()
    b, _ = _worker(cfg)  # a restarted node: a fresh worker, resumed by its keeper
    StateKeeper(cfg, resume=True).prepare(b, thread=None, dht=None, publish=lambda: None)
    assert b.step == a.export_state().step
    for _ in range(5):
        (xa, ya), (xb, yb) = next(a.batches), next(b.batches)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


@pytest.mark.parametrize("damage", ["missing", "torn", "another stream", "old checkpoint"])
def test_a_missing_or_torn_data_position_restarts_the_stream_with_one_warning(tmp_path,
                                                                              caplog, damage):
    cfg = _data_config(tmp_path, "builtin")
    a, _ = _worker(cfg)
    _run_to(a, 3)
    position = a.data_position()
    if damage == "another stream":
        position = _worker(cfg, identity=5)[0].data_position()
    path = save_checkpoint(tmp_path, a.export_state(), RUN, DIGEST, keep=3,
                           position=None if damage == "old checkpoint" else position)
    data_file = path.with_name(f"{path.stem}.data.json")
    if damage == "missing":
        data_file.unlink()
    elif damage == "torn":
        data_file.write_bytes(data_file.read_bytes()[:20])
    b, _ = _worker(cfg)
    state, where = load_latest(tmp_path, RUN, DIGEST)
    b.import_state(state)
    with caplog.at_level(logging.WARNING, logger="dilonode.train.checkpoint"):
        assert not resume_data(b, where)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "starts from its beginning" in lines[0] and "\n" not in lines[0]
    first = next(_worker(cfg)[0].batches)
    assert torch.equal(next(b.batches)[0], first[0])


def test_data_positions_are_pruned_and_a_failed_save_leaves_none(tmp_path):
    position = {"kind": "windows", "key": 1}
    for step in (10, 20, 30, 40):
        save_checkpoint(tmp_path, _state(step), RUN, DIGEST, keep=2, position=position)
    assert sorted(p.name for p in tmp_path.glob("*.data.json")) == [
        "ckpt-0000000030.data.json", "ckpt-0000000040.data.json"]
    assert load_data_position(tmp_path / "ckpt-0000000040.json") == position

    def fail(at: str) -> None:
        if at == "data-written":
            raise OSError(f"injected at {at}")

    with pytest.raises(OSError, match="injected"):
        save_checkpoint(tmp_path, _state(50), RUN, DIGEST, keep=2, hook=fail, position=position)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"ckpt-00000000{s}{ext}" for s in (30, 40) for ext in (".data.json", ".json",
                                                              ".safetensors")]
