"""The CUDA path on a real GPU: training with bf16 autocast, the simulator against the CPU,
pseudo-gradients through every codec, checkpoints and resume across devices, and the
all-reduce fed with CUDA tensors (in-memory network, then the daemon's NetworkCollective).

Skipped where torch sees no GPU (CI). Each test is seconds on a GPU; the simulator test also
runs the same config on the CPU to compare against.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dilonode.algo.butterfly import butterfly_average
from dilonode.algo.codecs import CODEC_NAMES, get_codec, max_abs_error_bound
from dilonode.algo.fragments import flatten
from dilonode.algo.outer import pseudo_gradient
from dilonode.algo.pacing import final_rounds
from dilonode.algo.schedule import SyncPlan
from dilonode.allreduce.memnet import MemNet
from dilonode.allreduce.network_collective import NetworkCollective
from dilonode.allreduce.retry import RoundPolicy
from dilonode.allreduce.round import AllReduceRound, Done, GroupSpec, group_digest
from dilonode.collective import (
    FormedGroup,
    GroupRequest,
    PendingReduce,
    ReduceResult,
    RoundRequest,
    SyncKey,
)
from dilonode.config import RunConfig
from dilonode.sim.local_group import LocalGroup
from dilonode.sim.training import simulate
from dilonode.statesync.keeper import StateKeeper
from dilonode.train import worker as worker_module
from dilonode.train.checkpoint import Checkpointer
from dilonode.train.data import TokenData, load_data
from dilonode.train.device import autocast
from dilonode.train.loop import train_loop
from dilonode.train.state import config_digest
from dilonode.train.worker import Worker
from tests.support.config import merged, nano_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = torch.device("cuda")
WAIT = 60.0  # deadline for any cross-thread wait


def _cfg(**over: Any) -> RunConfig:
    """A nano model on the built-in corpus: seconds per test on a GPU."""
    return nano_config(**merged({
        "device": "cuda", "total_steps": 24, "eval_every": 12,
        "data": {"seq_len": 64, "batch_size": 8, "eval_batches": 8},
        "codec": {"name": "float32"}, "sim": {"workers": 2},
        "statesync": {"enabled": False}, "checkpoint": {"every_steps": 0},
    }, over))


@pytest.fixture(scope="module")
def data() -> TokenData:
    return load_data(_cfg().data)


def _solo(cfg: RunConfig, data: TokenData) -> Worker:
    """One worker averaging with nobody (its own value comes back, float32 exact)."""
    return Worker(cfg, data, LocalGroup(1, get_codec("float32")).view(0), identity=0)


def _steps(w: Worker, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        losses.append(w.train_step())
        w.launch()
        w.land()
    return losses


def test_worker_trains_on_cuda_in_bf16_autocast_and_loss_falls(data: TokenData) -> None:
    w = _solo(_cfg(diloco={"mode": "diloco", "sync_every": 10}), data)
    assert all(p.is_cuda and p.dtype == torch.float32 for p in w.model.parameters())
    x, _ = next(data.train_batches(99, 64, 2, 0))
    with torch.no_grad(), autocast(w.device):
        assert w.model(x.to(CUDA)).dtype == torch.bfloat16  # the matmuls really ran in bf16
    losses = _steps(w, 30)
    # Untrained: ~ln(256) = 5.55 on bytes. The same config on the CPU (float32) reaches ~3.3
    # by step 30, so a bf16 path that trains at all clears 1.0 nats with a wide margin.
    assert abs(losses[0] - 5.55) < 0.3
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0
    assert all(p.is_cuda and p.dtype == torch.float32 for p in w.model.parameters())
    assert w.stats.rounds == {0: 3} and w.stats.rejected == 0


def _sim_outer(cfg: RunConfig) -> tuple[Any, list[torch.Tensor]]:
    """simulate(cfg) and every worker's outer weights (CPU float32) after the last step."""
    finals: list[torch.Tensor] = []

    def grab(step: int, workers: list[Worker]) -> None:
        if step == cfg.total_steps:
            finals.extend(w.outer_flat() for w in workers)

    return simulate(cfg, on_step=grab), finals


def _rounds_per_fragment(cfg: RunConfig) -> dict[int, int]:
    """Each fragment's rounds in `cfg`'s run: the schedule's, and the end-of-run sync's for
    a fragment that trained after its last scheduled round."""
    a = cfg.diloco
    plan = SyncPlan(a.sync_every, a.num_fragments, a.fragment_sync_delay)
    started = [plan.rounds_started(p, cfg.total_steps) for p in range(a.num_fragments)]
    final = {s.fragment for s in final_rounds(plan, started, cfg.total_steps)}
    return {p: n + (p in final) for p, n in enumerate(started)}


def _init_flat(cfg: RunConfig, data: TokenData) -> torch.Tensor:
    return _solo(cfg.model_copy(update={"device": "cpu"}), data).outer_flat()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_simulator_on_cuda_agrees_and_tracks_the_cpu_run(
        data: TokenData, monkeypatch: pytest.MonkeyPatch) -> None:
    cpu_rep, cpu = _sim_outer(_cfg(device="cpu"))
    bf16_rep, bf16 = _sim_outer(_cfg())
    # Outer state on the GPU too, and no autocast: float32 end to end, so only the order of
    # float32 sums differs from the CPU run (TF32 off explicitly: it would round to 10 bits).
    monkeypatch.setattr(worker_module, "autocast", lambda _device: contextlib.nullcontext())
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        f32_rep, f32 = _sim_outer(_cfg(diloco={"outer_state_on_cpu": False}))
    finally:
        torch.set_float32_matmul_precision(precision)
    init = _init_flat(_cfg(), data)
    for rep, finals in ((cpu_rep, cpu), (bf16_rep, bf16), (f32_rep, f32)):
        assert rep.workers_agree and len(finals) == 2 and torch.equal(finals[0], finals[1])
        # Starts at 2, 8, 14, 20 | 4, 10, 16, 22 | 6, 12, 18, 24, and the end-of-run rounds
        # of fragments 0 and 1 (fragment 2's last round started at the end, step 24).
        assert rep.rounds_per_fragment == cpu_rep.rounds_per_fragment == {0: 5, 1: 5, 2: 4}
    assert _rounds_per_fragment(_cfg()) == cpu_rep.rounds_per_fragment
    moved = cpu[0] - init  # what 24 steps and 14 outer rounds did to the weights
    f32_err, bf16_err = _rel(f32[0] - init, moved), _rel(bf16[0] - init, moved)
    cos = float(torch.nn.functional.cosine_similarity(bf16[0] - init, moved, dim=0))
    print(f"cuda-vs-cpu: f32 rel {f32_err:.2e}, bf16 rel {bf16_err:.3f} cos {cos:.4f}, "
          f"eval loss cpu {cpu_rep.final_eval_loss:.4f} f32 {f32_rep.final_eval_loss:.4f} "
          f"bf16 {bf16_rep.final_eval_loss:.4f}")
    # Measured on an H100 (torch 2.11, 2026-11-23): f32 rel 7e-6, bf16 rel 0.043, cos 0.9991,
    # eval losses within 7e-4. The bounds leave 5-15x of that for other GPUs and kernels.
    # float32 on both devices: the same trajectory up to summation-order rounding.
    assert f32_err < 1e-4
    assert abs(f32_rep.final_eval_loss - cpu_rep.final_eval_loss) < 1e-3
    # bf16 autocast rounds every matmul input to 8 bits of mantissa (~0.4%), and AdamW's
    # normalised steps turn small gradient differences into whole-lr ones, so the weights
    # drift apart; they must still have moved the same way, to the same loss.
    assert cos > 0.99 and bf16_err < 0.2
    assert abs(bf16_rep.final_eval_loss - cpu_rep.final_eval_loss) < 0.03


def test_ddp_on_cuda_agrees(data: TokenData) -> None:
    rep, finals = _sim_outer(_cfg(total_steps=6, eval_every=6, diloco={"mode": "ddp"}))
    assert rep.workers_agree and torch.equal(finals[0], finals[1])
    assert rep.final_eval_loss < 5.3  # below the untrained ~5.55 after 6 averaged steps


def test_cuda_pseudo_gradient_through_every_codec(data: TokenData) -> None:
    w = _solo(_cfg(diloco={"outer_state_on_cpu": False}), data)
    _steps(w, 5)  # before fragment 0's first sync: the outer state is still the init
    for p, f in enumerate(w.frags):
        delta = pseudo_gradient(f.outer.weights, flatten(f.params))  # [numel_p]
        assert delta.is_cuda and delta.dtype == torch.float32 and bool(delta.abs().max() > 0)
        for name in CODEC_NAMES:
            codec = get_codec(name, 64)
            back = codec.decode(*codec.encode(delta)).to(CUDA)
            bound = max_abs_error_bound(codec, delta.cpu()).to(CUDA)
            assert back.is_cuda and back.shape == delta.shape
            assert bool(((back - delta).abs().double() <= bound).all()), (name, p)
            if name == "float32":
                assert torch.equal(back, delta)
    # An averaged result arrives on the CPU; the outer step moves it onto the GPU.
    last = w.frags[-1]
    delta = pseudo_gradient(last.outer.weights, flatten(last.params))
    before = last.outer.weights.clone()
    codec = get_codec("int4", 64)
    new = last.outer.step(codec.decode(*codec.encode(delta)))
    assert new.is_cuda and not torch.equal(new, before)


def test_checkpoint_from_cuda_worker_resumes_on_cuda_and_on_cpu(
        data: TokenData, tmp_path: Path) -> None:
    cfg = _cfg(diloco={"outer_state_on_cpu": False}, checkpoint={"dir": str(tmp_path)})
    w = _solo(cfg, data)
    _steps(w, 14)  # rounds of all three fragments have landed by then
    saved = Checkpointer(tmp_path, cfg.run_id, config_digest(cfg), 0, 3).save_now(w)
    assert saved is not None
    exported = w.export_state()
    for device in ("cuda", "cpu"):
        other = _solo(cfg.model_copy(update={"device": device}), data)
        keeper = StateKeeper(other.cfg, resume=True)  # what `dilonode run --resume` does
        keeper.prepare(other, None, None, publish=lambda: None)
        assert keeper.resumed_from == saved and other.step == exported.step
        assert torch.equal(other.outer_flat(), w.outer_flat())
        for f in other.frags:
            assert all(q.device.type == device for q in f.params)
            assert torch.equal(flatten(f.params), f.outer.weights.cpu())
        losses = _steps(other, 6)  # and it trains on from there, landing rounds
        assert all(torch.isfinite(torch.tensor(losses)))
        assert sum(other.stats.rounds.values()) >= 2


def _round_spec(numel: int) -> GroupSpec:
    members = ("peer-0", "peer-1", "peer-2")
    return GroupSpec(run_id="cuda", fragment=0, round=1, members=members,
                     weights=(1.0, 1.0, 2.0), numel=numel, codec="int8", block_size=64,
                     chunk_numel=2048, group_digest=group_digest(members))


def _memnet_results(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    spec = _round_spec(xs[0].numel())
    rounds = [AllReduceRound(spec, i, x, timeout=30.0) for i, x in enumerate(xs)]
    outcomes = MemNet(rounds, start=10.0).run()
    assert all(isinstance(o, Done) for o in outcomes.values()) and len(outcomes) == 3
    return [r.result for r in rounds]


def test_allreduce_round_over_memnet_takes_cuda_tensors() -> None:
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(10_001, generator=gen) for _ in range(3)]  # odd: a short last block
    from_cuda = _memnet_results([x.to(CUDA) for x in xs])
    from_cpu = _memnet_results(xs)
    for got in from_cuda:  # quantized and reduced on the GPU (the torch data path)
        assert got.device.type == "cuda" and torch.equal(got.cpu(), from_cpu[0])
    expected, _, _ = butterfly_average(xs, [1.0, 1.0, 2.0], get_codec("int8", 64),
                                       chunk_numel=2048, align=64)
    assert torch.equal(from_cuda[0].cpu(), expected)


class _Recorder:
    """A worker's Collective that keeps what it sent and what came back, per key."""

    def __init__(self, inner: NetworkCollective) -> None:
        self.inner = inner
        self.sent: dict[SyncKey, torch.Tensor] = {}
        self.got: dict[SyncKey, ReduceResult] = {}
        self.devices: set[str] = set()

    def begin(self, request: RoundRequest, flat: torch.Tensor, *,
              encoded: object = None, state: object = None) -> PendingReduce:
        self.devices.add(flat.device.type)
        self.sent[request.key] = flat.detach().to("cpu", copy=True)
        return _RecordingPending(self, request.key, self.inner.begin(request, flat))


class _RecordingPending:
    def __init__(self, rec: _Recorder, key: SyncKey, inner: PendingReduce) -> None:
        self.rec, self.key, self.inner = rec, key, inner

    def done(self) -> bool:
        return self.inner.done()

    def wait(self, timeout: float | None = None) -> ReduceResult:
        result = self.inner.wait(timeout)
        self.rec.got[self.key] = result
        return result


@contextlib.contextmanager
def _network(ids: list[str], policy: RoundPolicy) -> Iterator[list[NetworkCollective]]:
    addrs: dict[str, str] = {}

    def static_group(me: str) -> Any:
        def form(req: GroupRequest) -> FormedGroup:
            members = sorted(addrs)
            return FormedGroup(members, addrs, [1.0] * len(members), members.index(me),
                               group_digest(members))
        return form

    nodes = [NetworkCollective(i, "cuda-net", static_group(i), policy) for i in ids]
    try:
        for pid, node in zip(ids, nodes, strict=True):
            addrs[pid] = node.start()
        yield nodes
    finally:
        for node in nodes:
            node.close()


@pytest.mark.timeout(120)
def test_cuda_workers_sync_over_the_network_collective(data: TokenData) -> None:
    """Two daemons' training threads on one GPU, averaging over TCP on 127.0.0.1: the
    pseudo-gradients handed over are CUDA tensors and the merged results land on CUDA."""
    cfg = _cfg(codec={"name": "int8"}, diloco={"outer_state_on_cpu": False})
    policy = RoundPolicy(codec="int8", block_size=64, chunk_numel=4096, timeout=20.0,
                         max_attempts=1)
    evals = data.eval_batches(64, 8, 1)
    with _network(["node-0", "node-1"], policy) as nodes:
        recs = [_Recorder(n) for n in nodes]
        workers = [Worker(cfg, data, r, identity=i) for i, r in enumerate(recs)]
        stop, errors = threading.Event(), []

        def run(w: Worker) -> None:
            try:
                train_loop(w, cfg.total_steps, cfg.total_steps, evals, stop)
            except BaseException as exc:  # surfaced by the assert below
                errors.append(exc)
                stop.set()

        threads = [threading.Thread(target=run, args=(w,)) for w in workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
        stop.set()
    assert not any(t.is_alive() for t in threads) and errors == []
    assert recs[0].devices == recs[1].devices == {"cuda"}
    rounds = sum(_rounds_per_fragment(cfg).values())  # 14: 12 and 2 at the end of the run
    assert set(recs[0].got) == set(recs[1].got) and len(recs[0].got) == rounds == 14
    codec = get_codec("int8", 64)
    for key, res in recs[0].got.items():
        expected, _, _ = butterfly_average([recs[0].sent[key], recs[1].sent[key]], [1.0, 1.0],
                                           codec, chunk_numel=4096, align=64)
        means = (res.mean, recs[1].got[key].mean)  # on the GPU, where the round reduced
        assert all(m.is_cuda and torch.equal(m.cpu(), expected) for m in means)
        assert res.report.group_size == 2 and not res.report.skipped
    assert torch.equal(workers[0].outer_flat(), workers[1].outer_flat())
    assert all(f.outer.weights.is_cuda for w in workers for f in w.frags)
