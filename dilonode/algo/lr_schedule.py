"""Learning-rate schedules as pure functions of the swarm's progress.

`lr_factor(kind, step, total, warmup, decay_fraction, min_ratio)` is the multiplier of the
peak learning rate at reference step `step` (1-based) of a run of `total` reference steps:

* ``constant``: linear warm-up over `warmup` steps, then 1;
* ``cosine``: warm-up, then a half cosine from 1 down to `min_ratio` at step `total`;
* ``wsd`` (warm-up, stable, decay): warm-up, 1 until the last `decay_fraction` of the run,
  then a linear decay to `min_ratio` at step `total`.

Steps count the swarm clock's reference steps, not a node's own: every node, fast, slow or
just joined, reads the same point of the schedule at the same moment (a node paced by its own
steps counts the same steps as every other, so the two agree). Past `total` the factor stays
at its final value. The same function drives the inner (AdamW) and, optionally, the outer
(Nesterov) learning rate.
"""

from __future__ import annotations

import math
from typing import Literal

__all__ = ["SCHEDULES", "Schedule", "lr_factor"]

Schedule = Literal["constant", "cosine", "wsd"]
SCHEDULES: tuple[Schedule, ...] = ("constant", "cosine", "wsd")


def lr_factor(kind: Schedule, step: float, total: int, warmup: int = 0,
              decay_fraction: float = 0.2, min_ratio: float = 0.0) -> float:
    """The multiplier of the peak rate at reference step `step` (see the module docstring)."""
    if total < 1 or warmup < 0 or not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"lr_factor: need total >= 1, warmup >= 0, 0 <= min_ratio <= 1; got "
                         f"total={total}, warmup={warmup}, min_ratio={min_ratio}")
    if warmup and step <= warmup:
        return max(step, 0.0) / warmup
    if kind == "constant":
        return 1.0
    if kind == "cosine":
        span = max(total - warmup, 1)
        done = min(max(step - warmup, 0.0) / span, 1.0)
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * done))
    if kind == "wsd":
        if not 0.0 < decay_fraction <= 1.0:
            raise ValueError(f"lr_factor: decay_fraction = {decay_fraction}: need (0, 1]")
        decay = max(round(total * decay_fraction), 1)
        start = max(total - decay, warmup)
        if step <= start:
            return 1.0
        done = min((step - start) / max(total - start, 1), 1.0)
        return 1.0 - (1.0 - min_ratio) * done
    raise ValueError(f"lr_factor: schedule {kind!r} unknown, expected one of "
                     f"{', '.join(SCHEDULES)}")
