"""One training worker: model, inner AdamW, data stream and the per-fragment outer state,
driven step by step against a `Collective`.

The simulator runs M of these in lockstep over a `LocalGroup`; the daemon runs one over the
network. Each step has three phases so both drivers can interleave workers:
`train_step()` (forward/backward and, outside DDP, the inner update), `launch()` (start the
syncs the schedule asks for), `land()` (apply the results that are due). No networking here.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from dilonode.algo.fragments import Fragment, assign_fragments, flatten, unflatten_into
from dilonode.algo.outer import NonFiniteError, OuterState, merge, pseudo_gradient
from dilonode.algo.replay import EncodedResult
from dilonode.algo.schedule import SyncLand, SyncPlan, SyncStart
from dilonode.collective import Collective, PendingReduce, ReduceResult, SyncKey
from dilonode.config import InnerOptConfig, RunConfig
from dilonode.train.data import TokenData
from dilonode.train.device import autocast, pick_device
from dilonode.train.model import build_model, lm_loss
from dilonode.train.state import WorkerState, adoption_step, settled_step

__all__ = ["Interrupted", "Worker", "WorkerStats", "build_inner_optimizer", "inner_lr"]

log = logging.getLogger(__name__)

_STOP_POLL_S = 0.25  # how often a blocked `land` checks `should_stop`


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
    abandoned: int = 0  # rounds left unfinished when stopping (drain timeout)
    # fragment (-1: DDP gradients) -> (rounds, total s, max s) from begin to result
    latency: dict[int, tuple[int, float, float]] = field(default_factory=dict)

    _MAX_DROPPED = 50

    def record(self, fragment: int, result: ReduceResult) -> None:
        self.bytes_sent += result.payload_bytes_sent
        self.bytes_received += result.payload_bytes_received
        self.peak_sync_bytes = max(self.peak_sync_bytes, result.payload_bytes_sent)
        self.syncs += 1
        self.skipped += int(result.skipped)
        self.alone += int(fragment >= 0 and result.group_size < 2)
        self.retried += int(result.attempts > 1)
        self.dropped = (self.dropped + list(result.dropped))[-self._MAX_DROPPED:]
        n, total, worst = self.latency.get(fragment, (0, 0.0, 0.0))
        self.latency[fragment] = (n + 1, total + result.latency_s, max(worst, result.latency_s))
        if fragment >= 0:
            self.rounds[fragment] = self.rounds.get(fragment, 0) + 1


def build_inner_optimizer(model: nn.Module, cfg: InnerOptConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm gains and biases are not decayed)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr,
                             betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def inner_lr(cfg: InnerOptConfig, step: int) -> float:
    """Learning rate for 1-based `step`: linear warm-up, then constant."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    return cfg.lr


class Worker:
    """A worker's model and optimizers; see the module docstring for the step phases."""

    def __init__(self, cfg: RunConfig, data: TokenData, collective: Collective,
                 identity: int | str, device: torch.device | None = None) -> None:
        self.cfg = cfg
        self.algo = cfg.diloco.effective()
        self.identity = identity
        self.device = device or pick_device(cfg.device)
        self.collective = collective
        torch.manual_seed(cfg.seed)  # identical initial weights on every worker
        self.model = build_model(cfg.model, data.vocab_size).to(self.device)
        names, params = zip(*[(n, p) for n, p in self.model.named_parameters()
                              if p.requires_grad], strict=True)
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
        self.pending: dict[int, tuple[int, PendingReduce]] = {}
        self.plan: SyncPlan | None = None
        self.fragments: list[Fragment] = []
        self.outer: list[OuterState] = []
        # fragment -> (round, its result as the codec carried it): the last round applied,
        # when the collective keeps encoded results; served so joiners can replay it.
        self.replays: dict[int, tuple[int, EncodedResult]] = {}
        if self.algo.mode != "ddp":
            self._init_outer(list(names))

    def _init_outer(self, names: list[str]) -> None:
        a = self.algo
        self.plan = SyncPlan(a.sync_every, a.num_fragments, a.fragment_sync_delay)
        self.fragments = assign_fragments(names, a.num_fragments, a.fragment_pattern)
        outer_device = "cpu" if a.outer_state_on_cpu else self.device
        self.outer = [OuterState(flatten(self._frag_params(f)), a.outer_lr, a.outer_momentum,
                                 a.outer_nesterov, outer_device) for f in self.fragments]

    def _frag_params(self, frag: Fragment) -> list[nn.Parameter]:
        return [self.params[i] for i in frag.param_indices]

    # -- phase 1 -------------------------------------------------------------------------
    def train_step(self) -> float:
        """Forward/backward on the next batch; outside DDP also the inner AdamW update."""
        x, y = next(self.batches)
        x, y = x.to(self.device), y.to(self.device)
        with autocast(self.device):
            loss = lm_loss(self.model, x, y)
        loss.backward()
        self.step += 1
        self.stats.steps = self.step
        self.stats.tokens += x.numel()
        self.stats.last_loss = float(loss.detach())
        if self.algo.mode == "ddp":
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
            self._grad_pending = self.collective.begin(SyncKey("grad", 0, self.step),
                                                       flatten(grads))
        else:
            self._inner_update()
        return self.stats.last_loss

    def _inner_update(self) -> None:
        for group in self.opt.param_groups:
            group["lr"] = inner_lr(self.cfg.inner, self.step)
        if self.cfg.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.inner.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    # -- phase 2 -------------------------------------------------------------------------
    def launch(self) -> None:
        """Start every sync the schedule places at the current step."""
        if self.plan is None:
            return
        for act in self.plan.actions(self.step):
            if isinstance(act, SyncStart):
                self._start(act.fragment, act.round)

    def _start(self, p: int, r: int) -> None:
        if p in self.pending:
            raise RuntimeError(f"fragment {p} round {r} started while round "
                               f"{self.pending[p][0]} is still in flight")
        local = flatten(self._frag_params(self.fragments[p]))  # [numel_p]
        delta = pseudo_gradient(self.outer[p].weights, local)
        self.pending[p] = (r, self.collective.begin(SyncKey("fragment", p, r), delta))

    # -- phase 3 -------------------------------------------------------------------------
    def land(self) -> None:
        """Apply results due now: DDP gradients, or fragment outer steps and merges."""
        if self._grad_pending is not None:
            self._land_grads(self._wait(self._grad_pending))
            self._grad_pending = None
            return
        if self.plan is None:
            return
        for act in self.plan.actions(self.step):
            if isinstance(act, SyncLand):
                self._land_fragment(act.fragment)

    def drain(self, timeout: float | None = None) -> None:
        """Land every sync still in flight (end of training). With `timeout` (a node that
        is stopping), rounds not done by then are abandoned, never half-applied: the outer
        state stays at the last landed round and the other members retry without us."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for p in sorted(self.pending):
            r, handle = self.pending[p]
            if deadline is not None:
                try:
                    handle.wait(max(deadline - time.monotonic(), 0.0))
                except TimeoutError:
                    del self.pending[p]
                    self.stats.abandoned += 1
                    log.warning("fragment %d round %d abandoned: not done %.1f s after the "
                                "stop", p, r, timeout)
                    continue
            self._land_fragment(p)

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
        self.stats.record(-1, result)
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
        r, handle = self.pending[p]
        result = self._wait(handle)  # p stays pending while we wait: export_state sees it
        del self.pending[p]
        self.stats.record(p, result)
        params = self._frag_params(self.fragments[p])
        self.replays.pop(p, None)
        try:
            new_global = self.outer[p].step(result.mean)
        except NonFiniteError as exc:
            self.stats.rejected += 1
            log.warning("fragment %d round %d: %s", p, r, exc)
            return
        if result.encoded is not None and result.group_size > 1:
            self.replays[p] = (r, result.encoded)
        merged = merge(flatten(params), new_global, self.algo.fragment_update_alpha)
        unflatten_into(merged, params)

    # -- state (checkpoints, joiners) ----------------------------------------------------
    def export_state(self, reuse: WorkerState | None = None) -> WorkerState:
        """A copy of the outer state after the rounds landed so far, tagged with the step at
        which a worker has landed exactly those (peers that took part in the same rounds
        export the same bytes). Between steps or while blocked in `land` (`wait_hook`).
        `reuse`: an earlier export whose unchanged fragments need no new copy."""
        if self.plan is None:
            raise RuntimeError("export_state: mode=ddp has no outer state to export")
        # Outer state moves only when a round lands: it is the state after `landed` rounds.
        landed = [self.plan.rounds_started(p, self.step) - (p in self.pending)
                  for p in range(len(self.outer))]
        step = adoption_step(self.plan, landed)
        if step is None:
            raise RuntimeError(f"export_state: no step of this schedule has landed exactly "
                               f"{landed} rounds with none in flight (tau >= H/P?)")
        # After `drain` (end of training) rounds may have landed before their scheduled step;
        # a checkpoint named by our own step would then resume with them due again.
        taken_at = max(self.step, settled_step(self.plan, landed))
        replays = {p: enc for p, (r, enc) in self.replays.items() if r == landed[p] - 1}
        return WorkerState.capture(step, landed, self.outer, reuse, taken_at=taken_at,
                                   replays=replays)

    def floor_step(self, counts_joiner: Callable[[int, int], bool]) -> int:
        """For a joiner: the step its adopted state must reach. Every round started by now
        must be in it, except rounds still in flight that count it (`counts_joiner(fragment,
        round)`: they expected it in matchmaking or grouped it), which it takes part in.
        Read from another thread: a plain snapshot of `step` and `pending`."""
        step, pending = self.step, dict(self.pending)
        if self.plan is None:
            return step
        started = [self.plan.rounds_started(p, step) for p in range(len(self.outer))]
        needed = [n - (p in pending and counts_joiner(p, pending[p][0]))
                  for p, n in enumerate(started)]
        if needed == started:
            return step
        floor = adoption_step(self.plan, needed)
        return step if floor is None else floor

    def import_state(self, state: WorkerState) -> None:
        """Adopt `state` (joining or resuming): outer state, step, and local weights set to
        the outer weights; inner AdamW starts fresh (docs/architecture.md says why)."""
        if self.plan is None or self.pending:
            raise RuntimeError("import_state: only with no sync in flight, outside mode=ddp")
        expected = [self.plan.rounds_started(p, state.step) for p in range(len(self.outer))]
        if list(state.rounds) != expected:
            raise ValueError(f"state at step {state.step} has round counters "
                             f"{list(state.rounds)}, this config's schedule gives {expected}")
        state.apply_to(self.outer)
        self.replays.clear()
        for frag, outer in zip(self.fragments, self.outer, strict=True):
            unflatten_into(outer.weights, self._frag_params(frag))
        self.opt = build_inner_optimizer(self.model, self.cfg.inner)
        self.step = self.stats.steps = state.step

    # -- evaluation ----------------------------------------------------------------------
    def outer_model(self) -> nn.Module:
        """A copy of the model holding the outer (global) weights; DDP: the weights."""
        model = copy.deepcopy(self.model)
        if self.algo.mode != "ddp":
            params = [p for p in model.parameters() if p.requires_grad]
            for frag, state in zip(self.fragments, self.outer, strict=True):
                unflatten_into(state.weights, [params[i] for i in frag.param_indices])
        return model

    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss of the outer weights over fixed held-out batches."""
        model = self.outer_model().eval()
        total = 0.0
        for x, y in batches:
            with autocast(self.device):
                total += float(lm_loss(model, x.to(self.device), y.to(self.device)))
        return total / max(len(batches), 1)

    def outer_flat(self) -> torch.Tensor:
        """All outer weights as one flat float32 vector (for comparisons and digests)."""
        if self.algo.mode == "ddp":
            return flatten(self.params)
        return torch.cat([s.weights.to("cpu") for s in self.outer])
