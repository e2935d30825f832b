"""The arithmetic of a node's ranks (dilonode/train/ranks/slices.py), checked without processes:
outer slices, FSDP shard segments, the all-to-all plan between them, the strategy choice;
and that the outer step and merge on slices give the bits they give on the whole vector
(nodes with different rank counts must end with identical outer weights). Also that both
ranks classes provide the whole `Ranks` protocol, and how a follower rank dispatches ops."""

from __future__ import annotations

import ast
import inspect
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dilonode.algo.outer import OuterState, merge
from dilonode.cli.launch_ranks import EXIT_RANK_FAILED, RankEnv, _Supervisor, rank_environ
from dilonode.config import load_config
from dilonode.status.snapshot import device_summary
from dilonode.train import worker as worker_module
from dilonode.train.ranks.node_ranks import NodeRanks, RankFailure, follow
from dilonode.train.ranks.protocol import Ranks
from dilonode.train.ranks.single import SingleRank
from dilonode.train.ranks.slices import (
    choose_strategy,
    exchange_plan,
    fsdp_segments,
    shard_rows,
    slice_bounds,
)
from dilonode.train.worker import NODE_OPS, Worker


@pytest.mark.parametrize("numel", [0, 1, 63, 64, 65, 1000, 4097])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("align", [1, 64])
def test_slice_bounds_cover_the_vector_in_aligned_equal_slices(numel, world, align):
    bounds = slice_bounds(numel, world, align)
    assert len(bounds) == world and bounds[0][0] == 0 and bounds[-1][1] == numel
    for (_, hi), (lo, _) in zip(bounds, bounds[1:], strict=False):
        assert hi == lo and (lo % align == 0 or lo == numel)
    width = max(hi - lo for lo, hi in bounds)
    assert width <= align * math.ceil(math.ceil(numel / align) / world)
    # every slice is full width until the vector ends
    assert all(hi - lo == width or hi == numel for lo, hi in bounds)


@pytest.mark.parametrize("rows", [1, 2, 5, 7, 8, 64])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_rows_is_torch_chunk(rows, world):
    chunks = torch.arange(rows).chunk(world)
    for r in range(world):
        lo, hi = shard_rows(rows, world, r)
        expected = chunks[r].tolist() if r < len(chunks) else []
        assert list(range(lo, hi)) == expected


def _a2a(plan, sends):
    """What all_to_all_single does with each rank's send buffer and the plan's sizes."""
    world = len(sends)
    recvs = []
    for d in range(world):
        parts = []
        for s in range(world):
            sizes = plan.send_sizes(s)
            start = sum(sizes[:d])
            parts.append(sends[s][start:start + sizes[d]])
        recvs.append(torch.cat(parts))
    return recvs


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_exchange_plan_moves_shards_to_slices_and_back(world):
    shapes = [(7, 5), (7,), (3, 7), (1,), (9, 2, 2)]
    numel = sum(math.prod(s) for s in shapes)
    flat = torch.arange(numel, dtype=torch.float32)
    local = [fsdp_segments(shapes, world, r) for r in range(world)]
    bounds = slice_bounds(numel, world, 4)
    plan = exchange_plan(local, bounds)
    shards = [torch.cat([flat[o:o + n] for o, n in segs]) for segs in local]
    recvs = _a2a(plan, shards)
    for d, (lo, hi) in enumerate(bounds):  # unpack as NodeRanks.local_flat does
        out, pos = torch.empty(hi - lo), 0
        for s in range(world):
            for pc in plan.pieces[s][d]:
                out[pc.dst:pc.dst + pc.length] = recvs[d][pos:pos + pc.length]
                pos += pc.length
        assert torch.equal(out, flat[lo:hi])
    back_plan_sends = [torch.cat([flat[lo:hi][pc.dst:pc.dst + pc.length]
                                  for s in range(world) for pc in plan.pieces[s][d]]
                                 or [flat[:0]]) for d, (lo, hi) in enumerate(bounds)]
    # the way back: rank d sends what it received, to its senders
    for s in range(world):
        got = torch.cat([back_plan_sends[d][sum(plan.recv_sizes(d)[:s]):
                                            sum(plan.recv_sizes(d)[:s + 1])]
                         for d in range(world)])
        assert torch.equal(got, shards[s])


def test_strategy_ddp_when_a_replica_fits_else_fsdp():
    gib = 2**30
    assert choose_strategy(10**9, 80 * gib, 8) == "ddp"  # 16 GB of 80
    assert choose_strategy(8 * 10**9, 80 * gib, 8) == "fsdp"  # 128 GB
    assert choose_strategy(8 * 10**9, None, 8) == "ddp"  # CPU: unknown, replicas
    assert choose_strategy(8 * 10**9, 80 * gib, 1) == "ddp"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_outer_step_and_merge_on_slices_are_bit_identical(world):
    g = torch.Generator().manual_seed(0)
    numel = 10_007
    init = torch.randn(numel, generator=g)
    full = OuterState(init, lr=0.7, momentum=0.9)
    parts = [OuterState(init[lo:hi], lr=0.7, momentum=0.9)
             for lo, hi in slice_bounds(numel, world, 64)]
    bounds = slice_bounds(numel, world, 64)
    for _ in range(3):
        delta = torch.randn(numel, generator=g) * 1e-2
        new = full.step(delta).clone()
        pieces = [st.step(delta[lo:hi]) for st, (lo, hi) in zip(parts, bounds, strict=True)]
        assert torch.equal(torch.cat(pieces), new)
        local = torch.randn(numel, generator=g)
        merged = merge(local, new, 0.5)
        assert torch.equal(torch.cat([merge(local[lo:hi], p, 0.5)
                                      for p, (lo, hi) in zip(pieces, bounds, strict=True)]),
                           merged)


def test_rank_env_reads_torchrun_variables():
    assert RankEnv.from_environ({}) is None
    assert RankEnv.from_environ({"WORLD_SIZE": "1", "RANK": "0"}) is None
    env = RankEnv.from_environ(rank_environ({}, 2, 4, 1234))
    assert env == RankEnv(2, 4, 2, "127.0.0.1:1234")


def test_device_summary_groups_devices():
    d = {"kind": "cuda", "name": "H100", "memory_bytes": 80 * 2**30}
    assert device_summary([d, d]) == "2 x cuda H100 (80.0 GiB each)"
    assert device_summary([]) == ""


def _proc(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def _leader(ready: Path, on_term: str) -> str:
    """A leader that handles SIGTERM with `on_term`, then says so by creating `ready`."""
    return (f"import pathlib, signal, sys, time\nsignal.signal(signal.SIGTERM, {on_term})\n"
            f"pathlib.Path({str(ready)!r}).touch()\ntime.sleep(60)\n")


def _fails_once_ready(ready: Path, status: int) -> str:
    """A rank that exits with `status` once the leader's handler is in place (`ready`)."""
    return (f"import pathlib, sys, time\ndeadline = time.monotonic() + 30\n"
            f"while not pathlib.Path({str(ready)!r}).exists() and time.monotonic() < deadline:\n"
            f"    time.sleep(0.01)\nsys.exit({status})\n")


@pytest.mark.timeout(60)
def test_a_dead_rank_stops_the_leader_and_the_node(tmp_path):
    ready = tmp_path / "ready"
    procs = [_proc(_leader(ready, "lambda *a: sys.exit(0)")), _proc(_fails_once_ready(ready, 7))]
    t0 = time.monotonic()
    assert _Supervisor(procs, grace=10.0).wait() == EXIT_RANK_FAILED
    assert procs[0].returncode == 0  # it was asked (SIGTERM) and left on its own
    assert time.monotonic() - t0 < 8


@pytest.mark.timeout(60)
def test_a_leader_that_does_not_leave_is_killed_after_the_grace(tmp_path):
    ready = tmp_path / "ready"
    procs = [_proc(_leader(ready, "signal.SIG_IGN")), _proc(_fails_once_ready(ready, 1))]
    t0 = time.monotonic()
    assert _Supervisor(procs, grace=1.0).wait() == EXIT_RANK_FAILED
    assert procs[0].returncode == -9 and time.monotonic() - t0 < 10


@pytest.mark.timeout(60)
def test_the_node_exits_with_the_leaders_status():
    procs = [_proc("raise SystemExit(3)"), _proc("import time; time.sleep(0.3)")]
    assert _Supervisor(procs, grace=5.0).wait() == 3


# -- the Ranks protocol ------------------------------------------------------------------------

def _protocol_methods() -> list[str]:
    return sorted(n for n, v in vars(Ranks).items() if callable(v) and not n.startswith("_"))


def _ranks_of(cls: type) -> object:
    if cls is SingleRank:
        return SingleRank()
    # Constructing NodeRanks joins no process group: that is `init_node_ranks`.
    return NodeRanks(RankEnv(0, 2, 0, "127.0.0.1:1"), load_config(), torch.device("cpu"),
                     control=None)


@pytest.mark.parametrize("cls", [SingleRank, NodeRanks])
def test_both_ranks_classes_provide_every_member_of_the_protocol(cls):
    ranks = _ranks_of(cls)
    for name in Ranks.__annotations__:
        assert hasattr(ranks, name), f"{cls.__name__} has no attribute {name!r}"
    for name in _protocol_methods():
        theirs = getattr(cls, name, None)
        assert callable(theirs), f"{cls.__name__} lacks {name}()"
        want, got = inspect.signature(getattr(Ranks, name)), inspect.signature(theirs)
        assert got == want, f"{cls.__name__}.{name}{got} differs from Ranks.{name}{want}"


def test_the_worker_uses_only_members_the_protocol_declares():
    tree = ast.parse(Path(worker_module.__file__).read_text())
    used = {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
            and node.value.attr == "ranks"}
    declared = set(Ranks.__annotations__) | set(_protocol_methods())
    assert used and used <= declared, f"not in Ranks: {sorted(used - declared)}"


def test_node_ops_are_registered_by_name():
    assert {"train_step", "evaluate", "_start", "_apply_round", "_import"} <= set(NODE_OPS)
    for name, op in NODE_OPS.items():
        assert getattr(Worker, name) is op


class _FollowerRanks(SingleRank):
    """A follower's ranks replaying a fixed list of the leader's ops."""

    rank, leader = 1, False
    device = torch.device("cpu")

    def __init__(self, ops: list[tuple[str, tuple]]) -> None:
        super().__init__()
        self.ops = list(ops)

    def receive(self) -> tuple[str, tuple]:
        return self.ops.pop(0)


_TINY = {"model": {"preset": "nano"}, "device": "cpu", "data": {"seq_len": 16, "batch_size": 2},
         "codec": {"name": "float32"}}


def test_a_follower_runs_the_leaders_ops_until_stop():
    ranks = _FollowerRanks([("train_step", ()), ("outer_digest", ()), ("stop", ())])
    follow(load_config(overrides=_TINY), ranks)
    assert ranks.ops == []


def test_a_follower_refuses_an_op_it_does_not_know():
    ranks = _FollowerRanks([("train_step", ()), ("__init__", ()), ("stop", ())])
    with pytest.raises(RankFailure, match=r"rank 1: the leader sent op '__init__'"):
        follow(load_config(overrides=_TINY), ranks)
