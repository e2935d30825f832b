"""One training worker: model, inner AdamW, data stream and the per-fragment outer state,
driven step by step against a `Collective`.

The simulator runs M of these over a `LocalGroup`; the daemon runs one over the network.
Each step has three phases so both drivers can interleave workers: `train_step()`
(forward/backward and, outside DDP, the inner update), `launch()` (start the rounds its
pacer says are due, landing first a round of the same fragment still in flight), `land()`
(apply the results that are due). When rounds start and land is decided by the worker's
pacer (`algo/pacing.py`): its own steps, or the swarm's clock, so that workers of different
speeds meet in every round and each contributes the tokens it trained. No networking here.
Each fragment's outer state, counters, chain and round in flight are one `FragmentState`
(dilonode/train/fragment_state.py) in `frags`; the phases loop over them.

A node with several local devices runs one Worker per rank (`ranks`, a `Ranks`:
dilonode/train/ranks/protocol.py): the methods marked `@node_op` run on every rank together
(the leader announces them; the others look them up in `NODE_OPS`), and the tensor work of a
fragment goes through `ranks` (outer slices, the inner model's DDP or FSDP2 layout). With
the default `SingleRank` the arithmetic is the one-process arithmetic.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, TypeVar

import torch
from torch import nn

from dilonode.algo.chain import chain_start
from dilonode.algo.fragments import assign_fragments, flatten, unflatten_into
from dilonode.algo.outer import NonFiniteError, OuterState, pseudo_gradient
from dilonode.algo.pacing import (
    Pacer,
    StepPacer,
    TimePacer,
    due_starts,
    final_rounds,
    rounds_before,
)
from dilonode.algo.schedule import SyncPlan, SyncStart
from dilonode.collective import (
    Collective,
    PendingReduce,
    ReduceResult,
    RoundReport,
    RoundRequest,
    SyncKey,
)
from dilonode.config import InnerOptConfig, RunConfig
from dilonode.train.contribution import Contributions
from dilonode.train.data import TrainData
from dilonode.train.device import autocast, pick_device
from dilonode.train.fragment_state import FragmentState
from dilonode.train.lr import inner_lr, outer_lr
from dilonode.train.model import build_model, lm_loss, loss_sum
from dilonode.train.ranks.protocol import Ranks
from dilonode.train.ranks.single import SingleRank
from dilonode.train.state import (
    OuterCopy,
    WorkerState,
    adoption_step,
    config_digest,
    settled_step,
)

__all__ = ["NODE_OPS", "Interrupted", "Worker", "WorkerStats", "build_inner_optimizer",
           "micro_batches", "node_op"]

log = logging.getLogger(__name__)

_STOP_POLL_S = 0.25  # how often a blocked `land` checks `should_stop`


_F = TypeVar("_F", bound=Callable[..., Any])

_NODE_OPS: dict[str, Callable[..., Any]] = {}
# Op name -> the op, called as `op(worker, *args)`: what a follower rank runs when the
# leader announces that name (`follow`); nothing else is run by name.
NODE_OPS: Mapping[str, Callable[..., Any]] = MappingProxyType(_NODE_OPS)


def node_op(fn: _F) -> _F:
    """A Worker method every rank of a node runs together: on the leader it is announced
    to the other ranks (name and arguments) before it runs (`ranks.op`); it is registered
    in `NODE_OPS` under its name."""
    name = fn.__name__
    assert name not in _NODE_OPS, f"two node ops named {name!r}"

    @functools.wraps(fn)
    def wrapper(self: Worker, *args: Any) -> Any:
        with self.ranks.op(name, args):
            return fn(self, *args)
    _NODE_OPS[name] = wrapper
    return wrapper  # type: ignore[return-value]


class Interrupted(Exception):
    """`land` gave up waiting because the node is stopping; the round stays pending."""


@dataclass
class WorkerStats:
    """What one worker has done and sent so far."""

    steps: int = 0
    tokens: int = 0
    last_loss: float = float("nan")
    bytes_sent: int = 0
    bytes_received: int = 0
    peak_sync_bytes: int = 0  # most payload bytes this worker sent for one sync
    syncs: int = 0
    rounds: dict[int, int] = field(default_factory=dict)  # fragment -> rounds applied
    rejected: int = 0  # averaged results refused (non-finite)
    skipped: int = 0  # rounds where every attempt failed and the worker went on alone
    alone: int = 0  # fragment rounds that ended in a group of one (skipped or nobody came)
    retried: int = 0  # rounds that needed more than one attempt
    dropped: list[str] = field(default_factory=list)  # recent "peer: reason" exclusions
    sync_wait_s: float = 0.0  # time the training thread spent blocked on a sync result
    # Time the training thread spent between steps fetching the swarm's state (after a
    # lone round or a diverged one: `StateKeeper.resync_if_behind`), not training either.
    catch_up_s: float = 0.0
    # The training thread's compute for rounds: starting them (pseudo-gradient, handing it
    # to the collective) and applying results (outer step, merge into the local weights).
    start_s: float = 0.0
    apply_s: float = 0.0
    abandoned: int = 0  # rounds left unfinished when stopping (drain timeout)
    missed: int = 0  # rounds this worker's pacer jumped over (paused, or slower than H)
    diverged: int = 0  # rounds matchmaking left us out of: our outer state differed
    grouped: int = 0  # fragment rounds averaged with at least one peer
    largest_group: int = 0  # the most members of a fragment round (bounded groups)
    late: int = 0  # rounds whose result was not there when the fragment's next was due
    # fragment (-1: DDP gradients) -> (rounds, total s, max s) from begin to result
    latency: dict[int, tuple[int, float, float]] = field(default_factory=dict)
    # fragment -> total s of that latency spent forming groups (`RoundReport.forming_s`)
    forming: dict[int, float] = field(default_factory=dict)
    # The last fragment rounds' times as the clock should see them (`RoundReport.pace_s`:
    # faults of other peers left out); the swarm's clock is retuned so that rounds land
    # well inside a period (`node.py`, `swarm/clock.py`).
    recent_latency: deque[float] = field(default_factory=lambda: deque(maxlen=30))
    # fragment -> who averaged its last round (networked rounds): whom the end-of-run
    # agreement check expects to hold the same weights.
    members: dict[int, tuple[str, ...]] = field(default_factory=dict)

    _MAX_DROPPED = 50

    def record(self, fragment: int, rep: RoundReport) -> None:
        self.bytes_sent += rep.payload_bytes_sent
        self.bytes_received += rep.payload_bytes_received
        self.peak_sync_bytes = max(self.peak_sync_bytes, rep.payload_bytes_sent)
        self.syncs += 1
        self.skipped += int(rep.skipped)
        # Alone with others around, except when they were left out for holding another
        # state than ours (ours stands; they adopt it).
        self.alone += int(fragment >= 0 and rep.group_size < 2 and not rep.outvoted)
        self.diverged += int(bool(rep.diverged))
        self.grouped += int(fragment >= 0 and rep.group_size >= 2)
        if fragment >= 0:
            self.largest_group = max(self.largest_group, rep.group_size)
        self.retried += int(rep.attempts > 1)
        self.dropped = (self.dropped + list(rep.dropped))[-self._MAX_DROPPED:]
        if fragment >= 0 and rep.pace_s is not None and rep.pace_s > 0:
            self.recent_latency.append(rep.pace_s)
        n, total, worst = self.latency.get(fragment, (0, 0.0, 0.0))
        self.latency[fragment] = (n + 1, total + rep.latency_s, max(worst, rep.latency_s))
        self.forming[fragment] = self.forming.get(fragment, 0.0) + rep.forming_s
        if fragment >= 0:
            self.rounds[fragment] = self.rounds.get(fragment, 0) + 1
            if rep.members:
                self.members[fragment] = rep.members


def build_inner_optimizer(model: nn.Module, cfg: InnerOptConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm gains and biases are not decayed).
    On CUDA the fused implementation: one kernel per step and no temporaries the size of
    the parameters (the per-parameter loop, the CPU's, is kept there bit for bit)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    fused = all(p.device.type == "cuda" for g in groups for p in g["params"]) or None
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr,
                             betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused)


def micro_batches(x: torch.Tensor, y: torch.Tensor, size: int | None
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(x, y) [B, T] cut into micro-batches of `size` sequences (None: the whole batch)."""
    if size is None or size >= x.shape[0]:
        return [(x, y)]
    if x.shape[0] % size:
        raise ValueError(f"data.micro_batch_size = {size}: does not divide this rank's "
                         f"{x.shape[0]} sequences per step (data.batch_size / ranks)")
    return list(zip(x.split(size), y.split(size), strict=True))


def _values_digest(mean: torch.Tensor) -> str:
    """A digest of a result tensor, for collectives that carry none (tests, fakes)."""
    return hashlib.sha256(mean.detach().to("cpu", torch.float32).contiguous().numpy()
                          .tobytes()).hexdigest()


class Worker:
    """A worker's model and optimizers; see the module docstring for the step phases."""

    def __init__(self, cfg: RunConfig, data: TrainData, collective: Collective,
                 identity: int | str, device: torch.device | None = None,
                 pacer: Pacer | None = None, ranks: Ranks | None = None) -> None:
        self.cfg = cfg
        self.algo = cfg.diloco.effective()
        self.identity = identity
        self.device = device or pick_device(cfg.device)
        self.collective = collective
        # This node's ranks (dilonode/train/ranks/node_ranks.py); one process: SingleRank.
        self.ranks: Ranks = ranks if ranks is not None else SingleRank()
        torch.manual_seed(cfg.seed)  # identical initial weights on every worker
        self.model = build_model(cfg.model, data.vocab_size)  # on the CPU
        # On our device; inside a multi-rank node wrapped in DDP or FSDP2 (which moves one
        # block at a time, so a model larger than one device still starts).
        self.train_module = self.ranks.wrap(self.model, self.device)
        if cfg.model.compile:  # forward only: names and parameters stay the model's
            self.train_module = torch.compile(self.train_module)  # type: ignore[assignment]
        names, params = zip(*[(n, p) for n, p in self.model.named_parameters()
                              if p.requires_grad], strict=True)
        self.param_names: list[str] = list(names)
        self.params: list[nn.Parameter] = list(params)
        self.opt = build_inner_optimizer(self.model, cfg.inner)
        self.batches = data.train_batches(identity, cfg.data.seq_len, cfg.data.batch_size,
                                          cfg.data.seed)
        self.step = 0
        self.stats = WorkerStats()
        self._grad_pending: PendingReduce | None = None
        # Told True before blocking on a sync result and False after (state snapshots).
        self.wait_hook: Callable[[bool], None] | None = None
        # Polled while blocked on a sync result; True makes `land` raise `Interrupted`.
        self.should_stop: Callable[[], bool] | None = None
        # Drivers pass the pacer the run uses (the daemon: the swarm clock when
        # diloco.pacing = "time"); built alone, a worker follows its own steps.
        self.pacer: Pacer = pacer or StepPacer()
        self.ref_now, self.lead = 0.0, 0.0  # the pacer's last reading (reference steps)
        self.end_step: int | None = None  # the run ends at this reference step (set by drivers)
        # Seconds of other work (an evaluation) before the next step, told by the driver so
        # the pacer knows when the next boundary comes.
        self.pause_s = 0.0
        self._rewarm_from: int | None = None  # own step of the last adoption with fresh AdamW
        self.plan: SyncPlan | None = None
        # Per fragment, by index: its parameters, outer state, counters and round in flight
        # (none in mode=ddp).
        self.frags: list[FragmentState] = []
        # When set (a list), every round started and landed is recorded here in order
        # (own step, fragment, round, tokens or group size): `sim.replay_traces` re-runs a
        # daemon's schedule exactly, and operators can see why a round was missed.
        self.trace: list[dict[str, int | str]] | None = None
        # The peers holding the state that stands, after a round left us out for holding
        # another (the node re-syncs from them between steps, then clears it).
        self.diverged_from: tuple[str, ...] = ()
        # The swarm averages in bounded groups (the last landed round said so): replicas
        # differ between groups by design, the end of the run mixes states first.
        self.grouped = False
        self._mixes_done = 0  # end-of-run mixing rounds started
        self.contributions = Contributions(cfg)  # error feedback and sparse rounds
        if self.algo.mode != "ddp":
            self._init_outer(list(names))

    def _init_outer(self, names: list[str]) -> None:
        a = self.algo
        self.plan = SyncPlan(a.sync_every, a.num_fragments, a.fragment_sync_delay)
        fragments = assign_fragments(names, a.num_fragments, a.fragment_pattern)
        outer_device = "cpu" if a.outer_state_on_cpu else self.device
        groups = [[self.params[i] for i in f.param_indices] for f in fragments]
        self.ranks.setup_fragments(groups, self.cfg.codec.block_size)
        digest = config_digest(self.cfg)
        # Each rank keeps its slice of every fragment (SingleRank: all of it).
        self.frags = [FragmentState(p, frag, g, OuterState(self.ranks.local_flat(p, g),
                                                           a.outer_lr, a.outer_momentum,
                                                           a.outer_nesterov, outer_device),
                                    chain_start(digest, p))
                      for p, (frag, g) in enumerate(zip(fragments, groups, strict=True))]

    def in_flight(self) -> list[int]:
        """The fragments with a round in flight, in order."""
        return [f.index for f in self.frags if f.pending is not None]

    def unfinished(self) -> list[PendingReduce]:
        """The rounds in flight whose result is not there yet (what `drain` waits for)."""
        return [f.pending.handle for f in self.frags
                if f.pending is not None and not f.pending.handle.done()]

    # -- phase 1 -------------------------------------------------------------------------
    @node_op
    def train_step(self) -> float:
        """Forward/backward on the next batch; outside DDP also the inner AdamW update.
        A node's batch is split over its ranks; it counts the node's tokens."""
        x, y = next(self.batches)
        tokens = x.numel()
        loss = self._forward_backward(self.ranks.rows(x), self.ranks.rows(y))
        self.step += 1
        self.stats.steps = self.step
        self.stats.tokens += tokens
        for f in self.frags:
            f.tokens_since += tokens
        self.stats.last_loss = self.ranks.node_loss(loss)
        if self.algo.mode == "ddp":
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
            self._grad_pending = self.collective.begin(
                RoundRequest(SyncKey("grad", 0, self.step)), flatten(grads))
        else:
            self._inner_update()
        return self.stats.last_loss

    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """This rank's rows [b, T]: the loss and its gradients, one micro-batch at a time
        (`data.micro_batch_size`), the gradients adding up to the whole batch's; returns
        the batch's mean loss (detached when cut)."""
        parts = micro_batches(x, y, self.cfg.data.micro_batch_size)
        if len(parts) == 1:
            with autocast(self.device):
                loss = lm_loss(self.train_module, x.to(self.device), y.to(self.device))
            loss.backward()
            return loss
        total = torch.zeros((), device=self.device)
        for i, (xm, ym) in enumerate(parts):
            with self.ranks.accumulating(self.train_module, last=i == len(parts) - 1), \
                    autocast(self.device):
                part = lm_loss(self.train_module, xm.to(self.device), ym.to(self.device))
            (part / len(parts)).backward()  # equal parts: the mean of means is the mean
            total += part.detach() / len(parts)
        return total

    def schedule_step(self) -> float:
        """The 1-based reference step being trained, for the learning-rate schedule: our own
        step when paced by steps, the swarm clock's step at the last boundary otherwise
        (every node at the same point of the schedule, whatever its speed)."""
        if isinstance(self.pacer, StepPacer):
            return float(self.step)
        return float(self.swarm_step + 1)

    def _inner_update(self) -> None:
        since = None if self._rewarm_from is None else self.step - self._rewarm_from
        for group in self.opt.param_groups:
            group["lr"] = inner_lr(self.cfg.inner, self.schedule_step(), self.cfg.total_steps,
                                   since)
        if self.cfg.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.inner.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    # -- phase 2 -------------------------------------------------------------------------
    @property
    def swarm_step(self) -> int:
        """Where this worker stands on the schedule, in reference steps: its own step when
        paced by steps, the swarm clock's reading at its last step boundary otherwise."""
        if isinstance(self.pacer, StepPacer):
            return self.step
        return max(math.floor(self.ref_now), 0) if math.isfinite(self.ref_now) else 0

    def at_end(self) -> bool:
        """Whether the run's end (`end_step`, reference steps) is reached at this boundary."""
        if self.end_step is None:
            return False
        if isinstance(self.pacer, StepPacer) or self.plan is None:
            return self.step >= self.end_step
        return self.ref_now + self.lead >= self.end_step

    def launch(self) -> None:
        """Start every round the pacer says is due at this step boundary. A round of the
        same fragment still in flight lands first (blocking: its result is truly late)."""
        self.start_due(self.due())

    def due(self) -> list[SyncStart]:
        """Read the pacer at this step boundary: the rounds due to start now."""
        if self.plan is None:
            return []
        self.ref_now, self.lead = self.pacer.at_step(self.step, self.pause_s)
        ref, lead = self.ref_now, self.lead
        if self.end_step is not None and ref + lead >= self.end_step:
            ref, lead = float(self.end_step), 0.0  # nothing past the end starts
        return due_starts(self.plan, [f.next_round for f in self.frags], ref, lead)

    def start_due(self, due: list[SyncStart]) -> None:
        """Start `due` (from `due()`), landing first any round of those fragments still
        in flight (the only place a clock-paced worker waits for a result)."""
        for act in due:
            pending = self.frags[act.fragment].pending
            if pending is not None:
                self.stats.late += int(not pending.handle.done())
                self._land_fragment(act.fragment)
            self._start(act.fragment, act.round)

    def blocking(self, due: list[SyncStart] | None = None) -> list[PendingReduce]:
        """The results `start_due(due)` (or, with `due` None, `land()`) would wait for: what
        a driver that advances virtual time (the simulator) must let finish first."""
        if due is not None:
            waits = [self.frags[a.fragment].pending for a in due]
        else:
            waits = [f.pending for f in self.frags if self._lands_now(f, block=True)]
        return [w.handle for w in waits if w is not None and not w.handle.done()]

    @node_op
    def _start(self, p: int, r: int) -> None:
        f = self.frags[p]
        if f.pending is not None:
            raise RuntimeError(f"fragment {p} round {r} started while round "
                               f"{f.pending.round} is still in flight")
        t0 = time.perf_counter()
        local = self.ranks.local_flat(p, f.params)  # [slice_p]
        delta = pseudo_gradient(f.outer.weights, local)
        missed, tokens = f.claim(r)
        if missed:
            self.stats.missed += missed
            log.warning("fragment %d: rounds %d..%d missed (this node was paused or is slower "
                        "than one round period); contributing to round %d", p,
                        r - missed, r - 1, r)
        if self.trace is not None:
            self.trace.append({"step": self.step, "event": "start", "fragment": p, "round": r,
                               "tokens": tokens})
        # The node's contribution: the ranks' slices gathered on the leader. `state`: our
        # packed outer state, for the state round of a grouped swarm (`Ranks.begin`).
        request = self._request(f, SyncKey("fragment", p, r), float(tokens))
        send = self.contributions.outgoing(f, r, delta)  # error feedback, sparse positions
        f.launched(r, self.ranks.begin(self.collective, request, send, state=f.packed),
                   self.step)
        self.stats.start_s += time.perf_counter() - t0

    def _request(self, f: FragmentState, key: SyncKey, weight: float = 1.0) -> RoundRequest:
        """Round `key` of fragment `f`, with what matchmaking compares: the fragment's chain
        (it cannot move while the round is in flight), the tokens trained so far and,
        paced by the swarm clock, where the round starts on it."""
        assert self.plan is not None
        start = None
        if isinstance(self.pacer, TimePacer):
            start = float(self.plan.start_step(f.index, key.round))
        return RoundRequest(key, weight, f.chain, self.stats.tokens, start)

    # -- phase 3 -------------------------------------------------------------------------
    def land(self) -> None:
        """Apply results due now: DDP gradients, or fragment outer steps and merges. A round
        is due tau own steps after it started (tau = 0: at once, waiting for it); paced by
        the clock, a round past tau lands once its result is there, never waited for."""
        if self._grad_pending is not None:
            self._land_grads(self._wait(self._grad_pending))
            self._grad_pending = None
            return
        for f in self.frags:
            if self._lands_now(f):
                self._land_fragment(f.index)

    def _lands_now(self, f: FragmentState, block: bool = False) -> bool:
        """Whether fragment f has a round in flight that lands at this boundary (`block`:
        waiting for it).
        Paced by steps: tau own steps after its round started. Paced by the clock: once its
        result is there (never awaited) and the clock is tau reference steps past the
        round's scheduled start (the same moment on every node, whatever its speed; the
        lead as for starts: at the last boundary before that moment)."""
        pending = f.pending
        if pending is None:
            return False
        tau = self.algo.fragment_sync_delay
        if tau and self.pacer.timed and self.plan is not None:
            due = self.plan.start_step(f.index, pending.round) + tau
            return self.ref_now + self.lead >= due and not block and pending.handle.done()
        return self.step - pending.launched_at >= tau

    def final_sync(self) -> None:
        """The end of the run: land the rounds still in flight and run one more round of
        every fragment trained since its last round (`pacing.final_rounds`), landed at
        once, so the outer weights hold everything every worker trained and all members
        end on the same state. A fragment with no round in flight starts its end-of-run
        round at once; one with a round in flight starts it once that round landed, so
        matchmaking and transfers overlap the landing instead of following it (where the
        link's bytes set the time, they still share it). Each fragment's rounds move only
        its own weights: the order changes no result."""
        in_flight = self.in_flight()
        self.start_final()
        for p in in_flight:
            self._land_fragment(p)
            self.start_final()  # p's own, now that its round landed
        for p in self.in_flight():
            self._land_fragment(p)
        while self.final_mix_due():
            self.start_mix()
            for p in self.in_flight():
                self._land_fragment(p)

    def final_mix_due(self) -> bool:
        """Whether another end-of-run mixing round is due (grouped swarms only:
        `network.final_mix_rounds` of them, after the end-of-run rounds)."""
        return (self.grouped and self.plan is not None and self.end_step is not None
                and not self.in_flight()
                and self._mixes_done < self.cfg.network.final_mix_rounds)

    def start_mix(self) -> None:
        """One end-of-run round of every fragment that only averages outer states in this
        round's group, numbered after the schedule's rounds (the round counters stay)."""
        for f in self.frags:
            r = f.next_round + self._mixes_done
            request = self._request(f, SyncKey("mix", f.index, r))
            f.launched(r, self.collective.begin(request, f.packed()), self.step, mix=True)
        self._mixes_done += 1

    def start_round(self, p: int, r: int) -> None:
        """Start round r of fragment p now (a driver replaying a recorded schedule)."""
        self._start(p, r)

    def land_round(self, p: int) -> None:
        """Land fragment p's round in flight now, waiting for it (replaying a schedule)."""
        self._land_fragment(p)

    def start_final(self) -> None:
        """Start the end-of-run rounds of `final_sync` of the fragments with no round in
        flight (a fragment's comes after its last round landed): call it again once the
        rounds in flight landed. Rounds started or landed already are not started again
        (`pacing.final_rounds` counts them). The simulators drive the end this way too."""
        if self.plan is None or self.end_step is None or not self.algo.final_sync:
            return
        for act in final_rounds(self.plan, [f.next_round for f in self.frags], self.end_step):
            if self.frags[act.fragment].pending is None:
                self._start(act.fragment, act.round)

    def drain(self, timeout: float | None = None) -> None:
        """Land every sync still in flight (end of training). With `timeout` (a node that
        is stopping), rounds not done by then are abandoned, never half-applied: the outer
        state stays at the last landed round and the other members retry without us."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for p in self.in_flight():
            pending = self.frags[p].pending
            assert pending is not None
            r = pending.round
            if deadline is not None:
                try:
                    pending.handle.wait(max(deadline - time.monotonic(), 0.0))
                except TimeoutError:
                    self._abandon(p, r)
                    log.warning("fragment %d round %d abandoned: not done %.1f s after the "
                                "stop", p, r, timeout)
                    continue
            self._land_fragment(p)

    @node_op
    def _abandon(self, p: int, r: int) -> None:
        self.frags[p].abandon()  # not landed: the state must not claim round r
        self.stats.abandoned += 1

    def _wait(self, handle: PendingReduce) -> ReduceResult:
        # Only this is waiting on the network; extraction, outer step and merge are compute.
        t0 = time.perf_counter()
        hook = self.wait_hook if not handle.done() else None
        if hook is not None:
            hook(True)  # the outer state cannot change until we return
        try:
            while True:
                try:
                    result = handle.wait(None if self.should_stop is None else _STOP_POLL_S)
                    break
                except TimeoutError:
                    if handle.done():
                        raise  # the round itself failed this way
                    if self.should_stop():
                        raise Interrupted("stop requested while waiting for a sync") from None
        finally:
            if hook is not None:
                hook(False)
        self.stats.sync_wait_s += time.perf_counter() - t0
        return result

    def _land_grads(self, result: ReduceResult) -> None:
        self.stats.record(-1, result.report)
        if not bool(torch.isfinite(result.mean).all()):
            self.stats.rejected += 1
            log.warning("step %d: averaged gradient is non-finite; update skipped", self.step)
            self.opt.zero_grad(set_to_none=True)
            return
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        unflatten_into(result.mean, [p.grad for p in self.params])
        self._inner_update()

    def _land_fragment(self, p: int) -> None:
        pending = self.frags[p].pending
        assert pending is not None, f"fragment {p}: no round in flight to land"
        r = pending.round
        result = self._wait(pending.handle)  # p stays pending while we wait: export_state sees it
        if not result.digest:
            result = replace(result, digest=_values_digest(result.mean))
        self._apply_round(p, r, result)

    @node_op
    def _apply_round(self, p: int, r: int, result: ReduceResult) -> None:
        """Apply round r's result to fragment p (every rank: its slice of the mean)."""
        t0 = time.perf_counter()
        try:
            self._apply_result(p, r, result)
        finally:
            self.stats.apply_s += time.perf_counter() - t0

    def _apply_result(self, p: int, r: int, result: ReduceResult) -> None:
        result = self.ranks.localize(p, result)
        f = self.frags[p]
        positions = f.sparse_positions  # a sparse round's: only these values step
        if f.pending is not None and not f.pending.mix:
            result = self.contributions.incoming(f, result)  # a sparse mean at full size
        if f.take_landing().mix:
            self._land_mix(f, r, result)
            return
        rep = result.report
        if rep.group_size > 1:  # a round alone says nothing about the swarm
            self.grouped = rep.grouped
        self.stats.record(p, rep)
        if self.trace is not None:
            self.trace.append({"step": self.step, "event": "land", "fragment": p, "round": r,
                               "group": rep.group_size, "members": list(rep.members)})
        if rep.diverged:
            self.diverged_from = rep.diverged
        try:
            lr = outer_lr(self.cfg, self.plan.start_step(p, r)) if self.plan else None
            new_global = f.outer_step(r, result, self.cfg.statesync.replay_rounds, lr,
                                      positions)
        except NonFiniteError as exc:
            self.stats.rejected += 1
            log.warning("fragment %d round %d: %s", p, r, exc)
            return
        alpha = self.algo.fragment_update_alpha
        if self.contributions.feeds_back:  # the merge keeps what the round left unsent
            merged = self.contributions.merged(f, self.ranks.local_flat(p, f.params),
                                               new_global, alpha)
            self.ranks.set_local(p, f.params, merged)
        else:
            self.ranks.apply(p, f.params, new_global, alpha)

    def _land_mix(self, f: FragmentState, r: int, result: ReduceResult) -> None:
        """An end-of-run mixing round landed: adopt the group's mean state and merge it
        into the local weights as a round's new global weights are."""
        self.stats.bytes_sent += result.report.payload_bytes_sent
        self.stats.bytes_received += result.report.payload_bytes_received
        if self.trace is not None:
            self.trace.append({"step": self.step, "event": "mix", "fragment": f.index,
                               "round": r, "group": result.report.group_size})
        f.adopt_mixed(result.mean, result.digest or _values_digest(result.mean))
        # A mix averages outer states, not pseudo-gradients: what the node owes stays owed.
        merged = self.contributions.merged(f, flatten(f.params), f.outer.weights,
                                           self.algo.fragment_update_alpha)
        unflatten_into(merged, f.params)

    # -- state (checkpoints, joiners) ----------------------------------------------------
    def export_state(self, reuse: WorkerState | None = None) -> WorkerState:
        """A copy of the outer state after the rounds landed so far, tagged with the step at
        which a worker has landed exactly those (peers that took part in the same rounds
        export the same bytes). Between steps or while blocked in `land` (`wait_hook`).
        `reuse`: an earlier export whose unchanged fragments need no new copy."""
        if self.plan is None:
            raise RuntimeError("export_state: mode=ddp has no outer state to export")
        # Outer state moves only when a round lands: it is the state after `landed` rounds.
        landed = [f.landed() for f in self.frags]
        step = adoption_step(self.plan, landed)
        if step is None and isinstance(self.pacer, StepPacer):
            raise RuntimeError(f"export_state: no step of this schedule has landed exactly "
                               f"{landed} rounds with none in flight (tau >= H/P?)")
        if step is None:
            # Paced by the clock, a worker that jumped over rounds of one fragment holds
            # counters no schedule step gives; name the state by its last landing instead
            # (the same for every worker holding it). It differs from its peers' (its chain
            # says so) and adopts theirs at its next round.
            step = settled_step(self.plan, landed)
        # After `drain` (end of training) rounds may have landed before their scheduled step;
        # a checkpoint named by our own step would then resume with them due again.
        taken_at = max(self.swarm_step, settled_step(self.plan, landed))
        replays = {f.index: kept for f in self.frags if (kept := f.replayable())}
        # Chains move only when a round lands, so a pending round is not in them yet.
        chains = [f.chain for f in self.frags]
        need = self.ranks.fragments_to_gather(reuse, landed, [f.outer.steps for f in self.frags],
                                              chains)
        # Residuals of the landed state: a round in flight holds the one from before it.
        residuals = {f.index: r.clone() for f in self.frags
                     if (r := f.residual_before if f.pending and not f.pending.mix
                         else f.residual) is not None}
        return WorkerState.capture(step, landed, self._gather_outer(need), reuse,
                                   taken_at=taken_at, replays=replays, chains=chains,
                                   residuals=residuals)

    @node_op
    def _gather_outer(self, need: list[int]) -> Sequence[OuterState | OuterCopy]:
        return self.ranks.full_outer([f.outer for f in self.frags], need)

    def floor_step(self, counts_joiner: Callable[[int, int], bool]) -> int:
        """For a joiner: the step its adopted state must reach. Every round started by now
        must be in it, except rounds still in flight that count it (`counts_joiner(fragment,
        round)`: they expected it in matchmaking or grouped it), which it takes part in, and
        rounds due by now but not launched yet (the step boundary is still being passed):
        launched once the joiner asks, after its record is visible, they count it too,
        unless they start before the first round its record names (`joining_floor`, which
        the joiner itself takes as its floor too, covers those).
        Read from another thread: a plain snapshot of `step` and each fragment's round in
        flight and counter."""
        step = self.swarm_step
        pending = [f.pending for f in self.frags]
        launched = [f.next_round for f in self.frags]
        if self.plan is None:
            return step
        started = [self.plan.rounds_started(p, step) for p in range(len(self.frags))]
        needed = [min(n, launched[p])
                  - (pending[p] is not None and counts_joiner(p, pending[p].round))
                  for p, n in enumerate(started)]
        if needed == started:
            return step
        floor = adoption_step(self.plan, needed)
        return step if floor is None else floor

    def joining_floor(self, joins_from: float) -> int | None:
        """For a joiner whose first round is reference step `joins_from`
        (`PeerRecord.joins_from`): the step its adopted state must reach, every round that
        starts before it landed; None without a schedule (mode=ddp)."""
        if self.plan is None:
            return None
        needed = rounds_before(self.plan, joins_from)
        step = adoption_step(self.plan, needed)
        return settled_step(self.plan, needed) if step is None else step

    def import_state(self, state: WorkerState) -> None:
        """Adopt `state` (joining, resuming, re-syncing): outer state, round counters and
        chains, and local weights set to the outer weights. A worker that has trained keeps
        its inner AdamW moments (its gradient statistics still fit weights this close); a
        fresh one starts them at zero and re-warms its learning rate
        (docs/architecture.md says why)."""
        if self.plan is None or self.in_flight():
            raise RuntimeError("import_state: only with no sync in flight, outside mode=ddp")
        expected = [self.plan.rounds_started(p, state.step) for p in range(len(self.frags))]
        if isinstance(self.pacer, StepPacer) and list(state.rounds) != expected:
            # Paced by steps the worker jumps to the state's step: it must be one at which
            # the schedule has exactly these rounds. Paced by the clock, the counters say
            # which round of each fragment comes next, whatever the label.
            raise ValueError(f"state at step {state.step} has round counters "
                             f"{list(state.rounds)}, this config's schedule gives {expected}")
        if len(state.rounds) != len(self.frags):
            raise ValueError(f"state has {len(state.rounds)} fragments, this worker "
                             f"{len(self.frags)} (diloco.num_fragments differs)")
        self.ranks.check_state(state)
        self._import(state)

    @node_op
    def _import(self, state: WorkerState) -> None:
        # Several ranks: scattered by the leader.
        self.ranks.apply_state(state, [f.outer for f in self.frags])
        for f in self.frags:
            f.adopt_counters(state.rounds[f.index],
                             state.chains[f.index] if state.chains else None)
            if (own := state.residuals.get(f.index)) is not None:  # a resumed checkpoint
                f.residual = own.to(f.outer.weights.device, torch.float32, copy=True)
            # The outer weights, less the residual a resumed node still owes (its local
            # weights hold it, algo/error_feedback.py).
            local = self.contributions.merged(f, f.outer.weights, f.outer.weights, 0.0)
            self.ranks.set_local(f.index, f.params, local)
        fresh = not self.opt.state  # no moments yet: nothing to keep, re-warm instead
        if isinstance(self.pacer, StepPacer):
            self.step = self.stats.steps = state.step  # the schedule counts own steps
        if fresh:
            self._rewarm_from = self.step
        if isinstance(self.pacer, TimePacer):
            self.pacer.restart()  # the fetch was no step: keep it out of the step time

    def data_position(self) -> dict[str, Any]:
        """Where the data stream stands (JSON-able; checkpoints keep it): between steps."""
        return self.batches.state()

    @node_op
    def restore_data(self, position: dict[str, Any]) -> str | None:
        """Continue the data stream from `position` (a `data_position`), on every rank; a
        position of another stream is refused, the reason returned, the stream unmoved."""
        why = self.batches.mismatch(position)
        if why is None:
            self.batches.restore(position)
        return why

    def adopt_outer(self, other: Worker) -> None:
        """Take another in-process worker's outer state and chains, keeping our counters
        and inner state (the simulator's end-of-run agreement; the daemon fetches it)."""
        if self.in_flight() or other.in_flight():
            raise RuntimeError("adopt_outer: only with no sync in flight")
        for mine, theirs in zip(self.frags, other.frags, strict=True):
            mine.outer.weights.copy_(theirs.outer.weights)
            mine.outer.momentum_buf.copy_(theirs.outer.momentum_buf)
            unflatten_into(mine.outer.weights, mine.params)
            mine.chain = theirs.chain

    def import_fragments(self, state: WorkerState, fragments: list[int]) -> None:
        """Adopt `state` for `fragments` only (paced by the clock, a re-syncing worker has
        rounds of other fragments in flight nearly all the time): their outer state, round
        counters and chains, local weights set to the outer weights; AdamW moments kept."""
        if any(self.frags[p].pending is not None for p in fragments) or self.plan is None:
            raise RuntimeError(f"import_fragments: fragments {fragments} must not be in flight")
        self.ranks.check_state(state)
        self._import_fragments(state, list(fragments))

    @node_op
    def _import_fragments(self, state: WorkerState, fragments: list[int]) -> None:
        self.ranks.apply_state(state, [f.outer for f in self.frags], fragments)
        for p in fragments:
            f = self.frags[p]
            self.ranks.set_local(p, f.params, f.outer.weights)
            f.adopt_counters(state.rounds[p], state.chains[p] if state.chains else None)

    # -- evaluation ----------------------------------------------------------------------
    def outer_model(self) -> nn.Module:
        """A copy of the model holding the outer (global) weights; DDP: the weights. One
        process only (a multi-rank node: `outer_state_dict`)."""
        if self.ranks.world > 1:
            raise RuntimeError("outer_model: this rank holds a slice of the outer state; "
                               "use outer_state_dict()")
        model = copy.deepcopy(self.model)
        if self.algo.mode != "ddp":
            params = [p for p in model.parameters() if p.requires_grad]
            for f in self.frags:
                unflatten_into(f.outer.weights, [params[i] for i in f.fragment.param_indices])
        return model

    @node_op
    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss of the outer weights over fixed held-out batches. Every rank: the outer
        weights swapped into the inner model, each rank's rows of every batch, the node's
        mean; then the inner weights back. (Not `outer_model()`: deep-copying the module
        costs a small model more Python time than the evaluation itself.)"""
        # DDP has no outer state: its weights are the model's.
        saved = [t.clone() for t in self.ranks.local_tensors(self.params)] if self.frags else []
        for f in self.frags:
            self.ranks.set_local(f.index, f.params, f.outer.weights)
        self.model.eval()
        try:
            total = loss_sum(self.model, batches, self.device, self.ranks.rows)
        finally:
            self.model.train()
            if saved:
                for t, s in zip(self.ranks.local_tensors(self.params), saved, strict=True):
                    t.copy_(s)
        return self.ranks.mean(total) / max(len(batches), 1)

    @node_op
    def outer_flat(self) -> torch.Tensor:
        """All outer weights as one flat float32 vector (for comparisons and digests);
        on a node's other ranks, an empty tensor (the leader gathers it)."""
        if self.algo.mode == "ddp":
            return flatten(self.params)
        parts = [self.ranks.gather(f.index, f.outer.weights) for f in self.frags]
        if any(t is None for t in parts):
            return torch.empty(0)
        return torch.cat([t.to("cpu") for t in parts if t is not None])

    @node_op
    def outer_digest(self) -> str:
        """sha256 of `outer_flat()`'s bytes, gathered one fragment at a time."""
        if self.algo.mode == "ddp":
            return hashlib.sha256(flatten(self.params).numpy().tobytes()).hexdigest()
        h = hashlib.sha256()
        for f in self.frags:
            part = self.ranks.gather(f.index, f.outer.weights)
            if part is not None:
                h.update(part.to("cpu").contiguous().numpy().tobytes())
        return h.hexdigest()

    @node_op
    def outer_state_dict(self) -> dict[str, torch.Tensor]:
        """The outer weights by parameter name (CPU float32; {} on a node's other ranks)."""
        if self.ranks.world == 1:
            return self.outer_model().state_dict()
        out: dict[str, torch.Tensor] = {}
        for f in self.frags:
            flat = self.ranks.gather(f.index, f.outer.weights)
            offset = 0
            for i in f.fragment.param_indices:
                shape, n = self.params[i].shape, self.params[i].numel()
                if flat is not None:
                    out[self.param_names[i]] = flat[offset:offset + n].view(shape).clone()
                offset += n
        return out
