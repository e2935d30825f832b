"""The learning rates of a run at a point of the swarm's progress: the inner (AdamW) rate of
a step and the outer (Nesterov) rate of a round, from the config's schedules
(`algo/lr_schedule.py`).

Both read reference steps of the swarm clock, so every node sets the same rates at the same
point of the run, whatever its speed or when it joined; the outer rate of a round is that of
the reference step the round starts at, the same on every member, so the members' outer
states stay bit-identical (and a joiner replaying the round uses it too).
"""

from __future__ import annotations

from dilonode.algo.lr_schedule import lr_factor
from dilonode.config import InnerOptConfig, RunConfig

__all__ = ["inner_lr", "outer_lr"]


def inner_lr(cfg: InnerOptConfig, step: float, total: int,
             since_adoption: int | None = None) -> float:
    """The inner rate at 1-based reference step `step` of a run of `total`: warm-up, then
    the schedule. `since_adoption`: own steps since this worker adopted a state with a fresh
    AdamW (joined, resumed), which warms up again over `cfg.rewarm_steps`: zero moments make
    the first updates about lr * sign(gradient) on every weight at once, which spikes the
    loss above an untrained model's."""
    lr = cfg.lr * lr_factor(cfg.schedule, step, total, cfg.warmup_steps, cfg.decay_fraction,
                            cfg.min_lr_ratio)
    if since_adoption is not None and cfg.rewarm_steps and since_adoption <= cfg.rewarm_steps:
        lr = min(lr, cfg.lr * since_adoption / cfg.rewarm_steps)
    return lr


def outer_lr(cfg: RunConfig, start_step: int) -> float:
    """The outer rate of a round that starts at reference step `start_step`."""
    a = cfg.diloco
    return a.outer_lr * lr_factor(a.outer_lr_schedule, max(start_step, 1), cfg.total_steps,
                                  0, cfg.inner.decay_fraction, a.outer_min_lr_ratio)
