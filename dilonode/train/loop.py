"""The training thread's loop for one networked node: step a `Worker`, account compute vs
waiting time, evaluate, and stop promptly when asked.

No networking here: the Worker's `Collective` hides it. The daemon (`dilonode.node.daemon`) runs
this
on the main thread while the all-reduce runs in the background.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dilonode.train.worker import Interrupted, Worker

__all__ = ["PHASES", "LoopReport", "train_loop"]


PHASES = ("step_s", "start_s", "apply_s", "wait_s", "hooks_s", "train_cpu_s", "other_cpu_s")


@dataclass
class LoopReport:
    """What one node's training thread did."""

    steps: int = 0
    tokens: int = 0
    step_s: float = 0.0  # time inside train_step (forward, backward, inner update)
    sync_s: float = 0.0  # time in launch/land: extraction, outer step, merge and any wait
    sync_wait_s: float = 0.0  # the part of sync_s blocked on a result from the network
    catch_up_s: float = 0.0  # between steps, fetching the swarm's state (inside hooks)
    wall_s: float = 0.0
    # The training steps' wall time: from the first step to the end of the last one, hooks
    # included, evaluations and the end-of-run rounds not (what tokens/s is measured over).
    train_s: float = 0.0
    eval_s: float = 0.0  # evaluations inside the loop
    # Where `train_s` went, in seconds (`PHASES`): train_step, starting rounds, applying
    # results, blocked on a result, the per-step hook (status, checkpoints); and the CPU
    # time of the training thread and of the process's other threads meanwhile (the
    # network thread: codecs, hashing, transport), which on a single core is taken from it.
    phases: dict[str, float] = field(default_factory=dict)
    eval_history: list[tuple[int, float]] = field(default_factory=list)  # (step, eval loss)
    stopped_early: bool = False

    @property
    def compute_utilization(self) -> float:
        """Share of wall time the training thread was not blocked on the network: neither
        waiting on a round's result nor fetching the swarm's state to catch up."""
        blocked = self.sync_wait_s + self.catch_up_s
        return 1.0 - blocked / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def step_share(self) -> float:
        """Share of wall time inside train_step alone (a stricter view of the same thing)."""
        return self.step_s / self.wall_s if self.wall_s > 0 else 0.0


def train_loop(worker: Worker, total_steps: int | None, eval_every: int,
               eval_batches: list[tuple[torch.Tensor, torch.Tensor]], stop: threading.Event,
               on_step: Callable[[Worker, LoopReport], None] | None = None,
               leave_timeout: float | None = None) -> LoopReport:
    """Run until the run's end (`total_steps`: own steps when paced by steps, reference
    steps of the swarm clock when paced by time; None: until `stop`), then land syncs still
    in flight (when stopped early, for at most `leave_timeout` s) and, at a regular end,
    run the end-of-run rounds (`Worker.final_sync`)."""
    rep = LoopReport()
    t_start = time.perf_counter()
    worker.should_stop = stop.is_set
    worker.end_step = total_steps
    st = worker.stats
    wait0, start0, apply0, catch0 = st.sync_wait_s, st.start_s, st.apply_s, st.catch_up_s
    cpu0, proc0 = time.thread_time(), time.process_time()
    hooks_s = 0.0
    eval_s = 0.0  # the last evaluation's duration
    while not stop.is_set() and not worker.at_end():
        t0 = time.perf_counter()
        worker.train_step()
        t1 = time.perf_counter()
        evaluating = worker.step % eval_every == 0
        worker.pause_s = eval_s if evaluating else 0.0
        try:
            worker.launch()
            worker.land()
        except Interrupted:
            break  # stopping: drain() below finishes or abandons the pending rounds
        t2 = time.perf_counter()
        rep.step_s += t1 - t0
        rep.sync_s += t2 - t1
        rep.sync_wait_s = worker.stats.sync_wait_s - wait0
        rep.catch_up_s = worker.stats.catch_up_s - catch0
        rep.steps, rep.tokens = worker.step, worker.stats.tokens
        rep.wall_s = time.perf_counter() - t_start
        if evaluating:
            t_eval = time.perf_counter()
            rep.eval_history.append((worker.step, worker.evaluate(eval_batches)))
            eval_s = time.perf_counter() - t_eval
            rep.eval_s += eval_s
        if on_step:
            t_hook = time.perf_counter()
            on_step(worker, rep)
            hooks_s += time.perf_counter() - t_hook
        rep.train_s = time.perf_counter() - t_start - rep.eval_s
    # Read once, here: the end-of-run rounds below are not training steps.
    train_cpu, proc = time.thread_time() - cpu0, time.process_time() - proc0
    rep.phases = {"step_s": rep.step_s, "start_s": st.start_s - start0,
                  "apply_s": st.apply_s - apply0, "wait_s": rep.sync_wait_s,
                  "hooks_s": hooks_s, "train_cpu_s": train_cpu,
                  "other_cpu_s": max(proc - train_cpu, 0.0)}
    rep.stopped_early = stop.is_set()
    rep.steps, rep.tokens = worker.step, worker.stats.tokens
    t0 = time.perf_counter()
    try:
        if not rep.stopped_early and total_steps is not None:
            worker.final_sync()  # lands the rounds in flight too, overlapping the last ones
        else:
            worker.drain(leave_timeout if rep.stopped_early else None)
    except Interrupted:
        rep.stopped_early = True
        worker.drain(leave_timeout)
    rep.sync_s += time.perf_counter() - t0
    rep.sync_wait_s = worker.stats.sync_wait_s - wait0
    rep.catch_up_s = worker.stats.catch_up_s - catch0
    # Always evaluated again: the drained and end-of-run rounds moved the outer weights.
    if rep.eval_history and rep.eval_history[-1][0] == worker.step:
        rep.eval_history.pop()
    rep.eval_history.append((worker.step, worker.evaluate(eval_batches)))
    rep.wall_s = time.perf_counter() - t_start
    return rep

