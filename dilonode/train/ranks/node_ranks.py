"""One node on N local devices: the ranks of a node, as the `Worker` sees them.

A node with several devices runs one process per device (a *rank*; `dilonode run --nproc N`
or torchrun). All ranks train: inner steps are synchronous inside the node (DDP, or FSDP2
`fully_shard` per transformer block). Rank 0, the *leader*, also owns the node's network
side (DHT, data plane, state sync, status): to the swarm the node is one peer.

The leader decides everything that depends on time or on the network (when a round starts,
when it lands, when to stop, what to import) and announces each `Worker` operation that
touches the model or the outer state to the other ranks (`NodeRanks.op`: its name and
arguments, tensors left out, over a gloo *control* group); they run the same operation
(`follow`), so their bookkeeping mirrors the leader's. The tensors move with collectives
inside the node (`dilonode/train/ranks/slices.py` says which values go where):

* each rank keeps the outer weights and momentum of its contiguous slice of every
  fragment (host RAM per rank ~1/N) and computes its slice of the pseudo-gradient;
* the leader gathers the slices into the node's contribution and hands it to the swarm
  (`begin`), then scatters the averaged result (`localize`); each rank applies the outer
  step to its slice, then the new global weights go back into the inner model (DDP: an
  all-gather; FSDP: an all-to-all into each rank's parameter shards);
* snapshots (checkpoints, state for joiners, digests) are gathered on the leader one
  fragment at a time; a state to import is scattered from it.

`SingleRank` (`ranks/single.py`) is the one-process case: no collectives; both implement
`Ranks` (`ranks/protocol.py`), which says what every member does. A collective that
fails (a rank died) raises `RankFailure` and the node stops (dilonode/cli/launch_ranks.py then
stops every rank).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import math
import threading
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dilonode.algo.fragments import flatten, unflatten_into
from dilonode.algo.outer import OuterState, merge
from dilonode.algo.sliced_encoding import SplicedEncoding, splice_supported
from dilonode.collective import (
    Collective,
    PendingReduce,
    ReduceResult,
    RoundRequest,
    StateSource,
)
from dilonode.config import RunConfig
from dilonode.train.device import device_info
from dilonode.train.ranks.slices import (
    Plan,
    RankEnv,
    choose_strategy,
    exchange_plan,
    fsdp_segments,
    slice_bounds,
)
from dilonode.train.state import OuterCopy, WorkerState, reusable_fragments

__all__ = ["NodeRanks", "RankEnv", "RankFailure", "follow", "init_node_ranks", "rank_device",
           "used_process_groups"]

log = logging.getLogger(__name__)

_CONTROL_TIMEOUT = timedelta(days=1)  # followers wait between ops as long as the leader works
_used_groups = False  # set once this process joined a torch.distributed process group


def used_process_groups() -> bool:
    """Whether this process joined a process group (`init_node_ranks`)."""
    return _used_groups


class RankFailure(RuntimeError):
    """A collective inside the node failed (a rank died or hung): the node stops."""


def rank_device(name: str, local_rank: int) -> torch.device:
    """The device of local rank `local_rank`: cuda:local_rank when CUDA is used, else cpu."""
    use_cuda = name == "cuda" or (name == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ValueError(f"rank {local_rank} needs GPU {local_rank}, but only {count} are "
                         "visible; use --nproc <= the number of GPUs or device = 'cpu'")
    return torch.device("cuda", local_rank)


class _NoResult:
    """A follower's handle of a round: only the leader waits for the swarm."""

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> ReduceResult:
        raise AssertionError("followers never wait for a round (the leader does)")


@dataclasses.dataclass(frozen=True)
class _Layout:
    """One fragment inside the node: its size, every rank's outer slice, and (FSDP) the
    all-to-all between parameter shards and outer slices."""

    numel: int
    bounds: tuple[tuple[int, int], ...]
    plan: Plan | None

    @property
    def sizes(self) -> list[int]:
        return [hi - lo for lo, hi in self.bounds]

    @property
    def width(self) -> int:
        return self.bounds[0][1] - self.bounds[0][0]


def _portable(arg: Any) -> Any:
    """What an op's argument looks like to the other ranks: results and states without
    their tensors (those travel by collectives)."""
    if isinstance(arg, ReduceResult):
        return dataclasses.replace(arg, mean=None, encoded=None)
    if isinstance(arg, WorkerState):
        return dataclasses.replace(arg, tensors={}, replays={})
    return arg


class NodeRanks:
    """This process's view of its node's ranks (see the module docstring)."""

    def __init__(self, env: RankEnv, cfg: RunConfig, device: torch.device,
                 control: Any) -> None:
        self.rank, self.world = env.rank, env.world
        self.leader = env.rank == 0
        self.cfg, self.device = cfg, device
        self.control = control  # gloo: ops and outer-state exchanges (host memory)
        self.strategy: str = cfg.dist.strategy  # "auto" until `wrap` picks one
        self.devices: list[dict[str, Any]] = []
        self.broken = False
        self._stopped = False
        self._lock = threading.RLock()  # the leader's ops come from two threads
        self._depth = 0
        self._frag: list[_Layout] = []

    # -- control -------------------------------------------------------------------------
    def _bcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def receive(self) -> tuple[str, tuple[Any, ...]]:
        """Follower: the leader's next op (name, arguments)."""
        name, args = self._bcast(None)
        return name, args

    def handshake(self, identity: str | int | None, device: torch.device) -> str | int | None:
        """Every rank: the leader's data-stream identity; every rank's device."""
        identity = self._bcast(identity if self.leader else None)
        infos: list[Any] = [None] * self.world
        dist.all_gather_object(infos, device_info(device), group=self.control)
        self.devices = infos
        return identity

    def op(self, name: str, args: tuple[Any, ...]) -> contextlib.AbstractContextManager[None]:
        """Run a Worker operation on every rank: the leader announces it (once, however
        nested) and holds its lock meanwhile; a failed collective becomes `RankFailure`."""
        return self._announced(name, args)

    @contextlib.contextmanager
    def _announced(self, name: str, args: tuple[Any, ...]) -> Iterator[None]:
        with self._lock:
            if self.broken:
                raise RankFailure(f"{name}: a rank of this node failed earlier")
            top, self._depth = self._depth == 0, self._depth + 1
            try:
                if top and self.leader:
                    self._bcast((name, tuple(_portable(a) for a in args)))
                yield
            except RankFailure:
                self.broken = True
                raise
            except RuntimeError as exc:
                self.broken = True
                raise RankFailure(f"{name} failed inside the node (rank {self.rank}): "
                                  f"{exc}") from exc
            finally:
                self._depth -= 1

    def stop(self) -> None:
        """Leader: tell the other ranks to exit (idempotent; skipped once broken)."""
        if not self.leader or self.broken or self._stopped:
            return
        self._stopped = True
        try:
            with self._lock:
                self._bcast(("stop", ()))
        except RuntimeError as exc:
            self.broken = True
            log.warning("could not tell the other ranks to stop: %s", exc)

    # -- the inner model -----------------------------------------------------------------
    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        """DDP or FSDP2 (`dist.strategy`; auto: by size against the smallest device), on
        `device`. FSDP2 shards the CPU-built model block by block, moving each block's
        shards to the device as it goes, so the whole model is never on one GPU."""
        from dilonode.train.model import param_count, transformer_blocks

        if self.strategy == "auto":
            mem = [d["memory_bytes"] for d in self.devices]
            cuda = bool(self.devices) and all(d["kind"] == "cuda" for d in self.devices)
            self.strategy = choose_strategy(param_count(model), min(mem) if cuda else None,
                                            self.world)
        if self.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            model.to(device)
            ids = [device.index] if device.type == "cuda" else None
            # Buffers (rotary tables) are alike on every rank: no sync at each forward.
            named = inspect.signature(DistributedDataParallel).parameters
            opt = "forward_sync_buffers" if "forward_sync_buffers" in named \
                else "broadcast_buffers"
            return DistributedDataParallel(model, device_ids=ids, **{opt: False})
        from torch.distributed.fsdp import fully_shard

        for block in transformer_blocks(model):
            fully_shard(block)
        fully_shard(model)
        return model.to(device)  # what FSDP2 did not manage (none, normally)

    def accumulating(self, module: nn.Module,
                     last: bool) -> contextlib.AbstractContextManager[None]:
        """Reduce gradients over the ranks on the `last` micro-batch of a step only."""
        return self._accumulating(module, last)

    @staticmethod
    @contextlib.contextmanager
    def _accumulating(module: nn.Module, last: bool) -> Iterator[None]:
        if last:
            yield
        elif hasattr(module, "no_sync"):  # DDP
            with module.no_sync():
                yield
        else:  # FSDP2
            module.set_requires_gradient_sync(False)  # type: ignore[operator]
            try:
                yield
            finally:
                module.set_requires_gradient_sync(True)  # type: ignore[operator]

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a node batch [B, ...] -> [B / N, ...]."""
        b = t.shape[0] // self.world
        return t[self.rank * b:(self.rank + 1) * b]

    def node_loss(self, loss: torch.Tensor) -> float:
        """The node's mean loss (every rank holds the same share of the batch)."""
        v = loss.detach().float().reshape(1).clone()
        dist.all_reduce(v)
        return float(v) / self.world

    def mean(self, value: float) -> float:
        v = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(v, group=self.control)
        return float(v) / self.world

    def local_tensors(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """What this rank holds of `params`: whole (DDP) or its FSDP shards."""
        if self.strategy == "fsdp":
            return [p.to_local() for p in params]  # type: ignore[attr-defined]
        return [p.data for p in params]

    # -- fragments -----------------------------------------------------------------------
    def setup_fragments(self, groups: Sequence[Sequence[nn.Parameter]], align: int) -> None:
        """Plan every fragment: outer slices and, under FSDP, the shard exchange."""
        self._frag = []
        for params in groups:
            shapes = [tuple(p.shape) for p in params]  # global shapes (DTensors too)
            numel = sum(math.prod(s) for s in shapes)
            bounds = tuple(slice_bounds(numel, self.world, align))
            plan = None
            if self.strategy == "fsdp":
                local = [fsdp_segments(shapes, self.world, r) for r in range(self.world)]
                held = sum(t.numel() for t in self.local_tensors(params))
                assert held == sum(n for _, n in local[self.rank]), \
                    f"FSDP shards hold {held} values, ranks.py expects another split"
                plan = exchange_plan(local, bounds)
            self._frag.append(_Layout(numel, bounds, plan))

    def local_flat(self, p: int, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """This rank's outer slice of fragment p's local weights, float32 CPU [slice]."""
        lay = self._frag[p]
        if lay.plan is None:
            lo, hi = lay.bounds[self.rank]
            return _flat_range(params, lo, hi)
        local = flatten(self.local_tensors(params))  # [local]
        recv = self._all_to_all(local, lay.plan.send_sizes(self.rank),
                                lay.plan.recv_sizes(self.rank))
        out = torch.empty(lay.sizes[self.rank])
        pos = 0
        for s in range(self.world):
            for piece in lay.plan.pieces[s][self.rank]:
                out[piece.dst:piece.dst + piece.length] = recv[pos:pos + piece.length]
                pos += piece.length
        return out

    def apply(self, p: int, params: Sequence[torch.Tensor], new_global: torch.Tensor,
              alpha: float) -> None:
        """Merge the new global weights of our slice into every rank's local weights."""
        lay = self._frag[p]
        g = new_global.to("cpu", torch.float32)
        if lay.plan is None:
            full = self._all_gather(g, lay)
            unflatten_into(merge(flatten(params), full, alpha), params)
            return
        send = torch.cat([g[pc.dst:pc.dst + pc.length] for s in range(self.world)
                          for pc in lay.plan.pieces[s][self.rank]] or [g[:0]])
        local = self._all_to_all(send, lay.plan.recv_sizes(self.rank),
                                 lay.plan.send_sizes(self.rank))  # [local], the way back
        offset = 0
        with torch.no_grad():
            for t in self.local_tensors(params):
                n = t.numel()
                t.copy_(merge(t.reshape(-1), local[offset:offset + n], alpha).view_as(t))
                offset += n

    def set_local(self, p: int, params: Sequence[torch.Tensor], weights: torch.Tensor) -> None:
        """Local weights of fragment p := the outer weights (our slice given)."""
        self.apply(p, params, weights, 0.0)

    # -- the swarm's round ---------------------------------------------------------------
    def begin(self, collective: Collective, request: RoundRequest, delta: torch.Tensor,
              state: StateSource | None = None) -> PendingReduce:
        """Gather the slices into the node's contribution; the leader hands it on, with
        the ranks' encodings of their slices when they share the codec work (collectives
        that encode themselves ignore them). `state`, a grouped swarm's state round, goes
        unused: our outer state is sharded."""
        p = request.key.fragment
        encoded = self._gather_encoded(p, delta) if self._shares_codec() else None
        full = self.gather(p, delta)
        if not self.leader:
            return _NoResult()
        assert full is not None
        if self.device.type == "cuda":  # the round's codecs then run on our GPU, as a
            full = full.to(self.device)  # 1-rank CUDA node's do (allreduce/datapath.py)
        return collective.begin(request, full, encoded=encoded, state=state)

    def _shares_codec(self) -> bool:
        """Every rank decides alike, from the config: sharing on, a CPU node, a codec
        that has work to do."""
        codec = self.cfg.codec.name
        return (self.cfg.dist.share_codec and self.device.type == "cpu"
                and codec != "float32" and splice_supported(codec))

    def _gather_encoded(self, p: int, delta: torch.Tensor) -> SplicedEncoding | None:
        """Every rank encodes its slice (in parallel); the leader gets them all, or None
        when a slice could not be encoded (NaN/Inf: the round itself will refuse it)."""
        from dilonode.algo.codecs import CodecError, get_codec

        lay = self._frag[p]
        codec = get_codec(self.cfg.codec.name, self.cfg.codec.block_size)
        size = codec.encoded_size(lay.width)
        mine = torch.zeros(size + 1, dtype=torch.uint8)  # [ok, encoding..., padding]
        part = delta.to("cpu", torch.float32)
        if part.numel():
            try:
                data = codec.encode(part)[0]
                mine[0] = 1
                mine[1:1 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            except CodecError:
                pass
        else:
            mine[0] = 1
        if not self.leader:
            dist.gather(mine, None, dst=0, group=self.control)
            return None
        rows = torch.empty(self.world, size + 1, dtype=torch.uint8)
        dist.gather(mine, list(rows), dst=0, group=self.control)
        if not bool(rows[:, 0].all()):
            return None
        parts = tuple(memoryview(rows[r, 1:1 + codec.encoded_size(n)].numpy()).cast("B")
                      for r, n in enumerate(lay.sizes))
        return SplicedEncoding(codec.name, codec.block_size, lay.bounds, parts)

    def localize(self, p: int, result: ReduceResult) -> ReduceResult:
        """The round's result with `mean` cut to this rank's slice (scattered by the
        leader). A result with any NaN/Inf reaches every rank as NaN, so all refuse it."""
        lay = self._frag[p]
        full = None
        if self.leader:
            full = result.mean.to("cpu", torch.float32)
            if not bool(torch.isfinite(full).all()):
                full = torch.full_like(full, float("nan"))
        return dataclasses.replace(result, mean=self._scatter(full, lay))

    def gather(self, p: int, part: torch.Tensor) -> torch.Tensor | None:
        """Fragment p's slices -> the whole vector on the leader (None elsewhere)."""
        return self._gather(part.to("cpu", torch.float32), self._frag[p])

    def check_state(self, state: WorkerState) -> None:
        """Leader, before announcing an import: the state fits this model."""
        if state.num_fragments != len(self._frag):
            raise ValueError(f"state has {state.num_fragments} fragments, this worker "
                             f"{len(self._frag)} (diloco.num_fragments differs)")
        for p, lay in enumerate(self._frag):
            for kind in ("weights", "momentum"):
                t = state.tensors[f"outer.{p}.{kind}"]
                if t.dtype != torch.float32 or t.shape != (lay.numel,):
                    raise ValueError(f"state tensor outer.{p}.{kind}: {t.dtype} "
                                     f"{tuple(t.shape)} does not fit float32 ({lay.numel},) "
                                     "(a different model?)")

    def apply_state(self, state: WorkerState, outer: Sequence[OuterState],
                    fragments: Sequence[int] | None = None) -> None:
        """Scatter an imported state's fragments (all, or `fragments`) from the leader into
        every rank's slices."""
        for p, (lay, st) in enumerate(zip(self._frag, outer, strict=True)):
            if fragments is not None and p not in fragments:
                continue
            for kind, dst in (("weights", st.weights), ("momentum", st.momentum_buf)):
                full = state.tensors[f"outer.{p}.{kind}"] if self.leader else None
                dst.copy_(self._scatter(full, lay))
            st.steps = state.outer_steps[p]

    def fragments_to_gather(self, reuse: WorkerState | None, rounds: list[int],
                            outer_steps: list[int], chains: list[str]) -> list[int]:
        """The fragments whose state changed since `reuse`: gathering one costs a collective
        of its whole outer state."""
        keep = reusable_fragments(reuse, rounds, outer_steps, chains)
        return [p for p in range(len(outer_steps)) if p not in keep]

    def full_outer(self, outer: Sequence[OuterState],
                   need: Sequence[int]) -> Sequence[OuterState | OuterCopy]:
        """Leader: the whole outer state of the fragments in `need` (others: steps only)."""
        out: list[OuterState | OuterCopy] = []
        for p, st in enumerate(outer):
            w = m = None
            if p in need:
                w, m = self.gather(p, st.weights), self.gather(p, st.momentum_buf)
            out.append(OuterCopy(weights=w, momentum_buf=m, steps=st.steps))
        return out

    # -- collectives (control group, host memory) ----------------------------------------
    # Slices are equally wide (the last ones short or empty, padded here), so gathers land
    # straight in one [world, width] buffer whose first `numel` values are the vector.
    def _gather(self, part: torch.Tensor, lay: _Layout) -> torch.Tensor | None:
        buf = _padded(part, lay.width)
        if not self.leader:
            dist.gather(buf, None, dst=0, group=self.control)
            return None
        out = torch.empty(self.world * lay.width)
        dist.gather(buf, list(out.view(self.world, lay.width)), dst=0, group=self.control)
        return out[:lay.numel]

    def _scatter(self, full: torch.Tensor | None, lay: _Layout) -> torch.Tensor:
        w = lay.width
        out = torch.empty(w)
        parts = None
        if self.leader:
            assert full is not None
            parts = [_padded(full[r * w:(r + 1) * w], w) for r in range(self.world)]
        dist.scatter(out, parts, src=0, group=self.control)
        return out[:lay.sizes[self.rank]]

    def _all_gather(self, part: torch.Tensor, lay: _Layout) -> torch.Tensor:
        out = torch.empty(self.world * lay.width)
        dist.all_gather(list(out.view(self.world, lay.width)), _padded(part, lay.width),
                        group=self.control)
        return out[:lay.numel]

    def _all_to_all(self, send: torch.Tensor, send_sizes: list[int],
                    recv_sizes: list[int]) -> torch.Tensor:
        recv = torch.empty(sum(recv_sizes))
        dist.all_to_all_single(recv, send.contiguous(), recv_sizes, send_sizes,
                               group=self.control)
        return recv

    def close(self) -> None:
        """Leave the node's process groups (the node is done or failed)."""
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def _padded(t: torch.Tensor, width: int) -> torch.Tensor:
    """`t` (at most `width` values) as a contiguous tensor of exactly `width`."""
    if t.numel() == width:
        return t.contiguous()
    out = torch.zeros(width)
    out[:t.numel()] = t
    return out


def _flat_range(params: Sequence[torch.Tensor], lo: int, hi: int) -> torch.Tensor:
    """Values [lo, hi) of the parameters flattened and concatenated, float32 CPU, without
    building the whole vector."""
    pieces, offset = [], 0
    for t in params:
        n = t.numel()
        a, b = max(lo, offset), min(hi, offset + n)
        if a < b:
            pieces.append(t.detach().reshape(-1)[a - offset:b - offset].to("cpu", torch.float32))
        offset += n
    return torch.cat(pieces) if pieces else torch.empty(0)


def init_node_ranks(cfg: RunConfig, env: RankEnv) -> NodeRanks:
    """Join the node's process group (NCCL on GPUs, gloo on CPU) plus a gloo control group."""
    device = rank_device(cfg.device, env.local_rank)
    backend = "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "nccl"
    global _used_groups
    _used_groups = True
    dist.init_process_group(backend, init_method=f"tcp://{env.master}", rank=env.rank,
                            world_size=env.world,
                            timeout=timedelta(seconds=cfg.dist.timeout))
    control = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
    return NodeRanks(env, cfg, device, control)


def follow(cfg: RunConfig, ranks: NodeRanks) -> None:
    """A follower rank's whole life: build the same Worker as the leader, then run the
    leader's ops until it says stop (RankFailure if the leader or a collective fails)."""
    import time

    from dilonode.algo.pacing import StepPacer, TimePacer
    from dilonode.train.data import load_data
    from dilonode.train.worker import NODE_OPS, Worker

    identity = ranks.handshake(None, ranks.device)
    timed = cfg.diloco.pacing == "time" and cfg.diloco.mode != "ddp"
    worker = Worker(cfg, load_data(cfg.data), _NoCollective(), identity, device=ranks.device,
                    pacer=TimePacer(time.time) if timed else StepPacer(), ranks=ranks)
    while True:
        try:
            name, args = ranks.receive()
        except RuntimeError as exc:
            raise RankFailure(f"rank {ranks.rank}: lost the leader: {exc}") from exc
        if name == "stop":
            return
        op = NODE_OPS.get(name)
        if op is None:
            raise RankFailure(f"rank {ranks.rank}: the leader sent op {name!r}, which no "
                              "`node_op` of Worker defines")
        op(worker, *args)


class _NoCollective:
    """A follower's collective: the leader alone talks to the swarm."""

    def begin(self, request: RoundRequest, flat: torch.Tensor, *,
              encoded: SplicedEncoding | None = None,
              state: StateSource | None = None) -> PendingReduce:
        raise AssertionError("followers hand their slices to the leader (NodeRanks.begin)")
