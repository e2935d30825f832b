"""Robust aggregation: which contributions an owner accepts, how it combines them, and
which peers are banned for being rejected again and again.

Pure (torch, no I/O, the clock is passed in). The owner of a butterfly part calls
`aggregate(chunks, spec)` once per chunk it reduces, with the decoded float32 chunk of every
member in member order; the networked round and the simulator's `butterfly_average` both do,
so they agree bit for bit. Since an owner sees only its own part of each contribution, every
check is per chunk: a contribution can be rejected in one chunk and accepted in another.
The owner sends the rejected members with the result chunk, so every member learns the same
rejections; `convicted` keeps those a majority of owners agree on, which every member then
feeds to the same `BanTracker`.

Checks (`check_contributions`): a chunk holding NaN/Inf is rejected; with `norm_bound > 0`,
a chunk whose L2 norm exceeds `norm_bound` times the median norm of the finite chunks is
rejected (the lower median, so with two members the smaller one is the reference).

Token weights. Every contribution carries the tokens its sender trained on since it last
synced that fragment (rounds are paced by the swarm's clock, so a slow node contributes
fewer tokens, not fewer rounds), and the aggregate is a token-weighted mean. A weight is a
claim nobody can verify directly, so it is checked against the group (`check_claims`): a
member claiming more than `max_weight_ratio` times the lower median of the group's
positive claims is rejected, as a non-finite chunk is. Rounds are opened by a shared clock,
so every member trained for the same wall time: a claim of 1,000x the median is a GPU
1,000x faster than the group's median one, or a lie. With the default ratio of 16, a
swarm whose speeds span up to 16x is never refused (with two members the slower one is the
reference); members that are a majority of a group can still shift the median (as they
can every robust statistic here).

Aggregators (applied to the accepted chunks, in member order):

* `mean`: `reduce_weighted`, the protocol's float32 token-weighted mean in member order
  (`reduce_mean`, sum divided by the count, when all weights are equal).
* `trimmed_mean`: per coordinate, drop the `trim` largest and `trim` smallest values and
  average the rest, weighted by their senders' tokens; `trim` shrinks to `(n - 1) // 2`
  for small groups, so three members give the coordinate-wise median and two the mean.
* `centered_clip` (Karimireddy, He, Jaggi, ICML 2021): start from the coordinate-wise
  median `v` and repeat `clip_iters` times `v <- v + sum_i(c_i (x_i - v) * min(1, tau /
  ||x_i - v||))`, `c_i` the token coefficients (1/n when equal). One member moves `v` by
  at most `c_i tau` per iteration. `tau` is
  `clip_tau` times the median of `||x_i - v_0||`: chunks differ in size and pseudo-gradient
  scales drift over training, so a radius relative to the honest spread is one setting
  that fits every chunk of a run, where an absolute radius would not.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from dilonode.algo.butterfly import reduce_weighted, weight_coefficients

__all__ = [
    "AGGREGATORS",
    "Aggregated",
    "AggregatorSpec",
    "BanTracker",
    "aggregate",
    "centered_clip",
    "check_claims",
    "check_contributions",
    "convicted",
    "trimmed_mean",
]

AggregatorName = Literal["mean", "trimmed_mean", "centered_clip"]
AGGREGATORS: tuple[AggregatorName, ...] = ("mean", "trimmed_mean", "centered_clip")


@dataclass(frozen=True)
class AggregatorSpec:
    """How an owner combines the contributions to a chunk (see the module docstring).

    `norm_bound` 0 disables the norm check (the finite check always applies).
    """

    name: AggregatorName = "mean"
    norm_bound: float = 0.0
    trim: int = 1
    clip_tau: float = 1.0
    clip_iters: int = 3
    max_weight_ratio: float = 16.0  # 0: token claims are not checked

    def __post_init__(self) -> None:
        problems = []
        if self.name not in AGGREGATORS:
            problems.append(f"name={self.name!r}: need one of {', '.join(AGGREGATORS)}")
        if not (math.isfinite(self.norm_bound) and (self.norm_bound == 0 or
                                                     self.norm_bound >= 1)):
            problems.append(f"norm_bound={self.norm_bound}: need 0 (off) or >= 1")
        if self.trim < 0:
            problems.append(f"trim={self.trim}: need >= 0")
        if not (math.isfinite(self.clip_tau) and self.clip_tau > 0):
            problems.append(f"clip_tau={self.clip_tau}: need > 0")
        if not (math.isfinite(self.max_weight_ratio) and (self.max_weight_ratio == 0
                                                           or self.max_weight_ratio >= 1)):
            problems.append(f"max_weight_ratio={self.max_weight_ratio}: need 0 (off) or >= 1")
        if self.clip_iters < 1:
            problems.append(f"clip_iters={self.clip_iters}: need >= 1")
        if problems:
            raise ValueError("AggregatorSpec: " + "; ".join(problems))


@dataclass(frozen=True)
class Aggregated:
    """The combined chunk and the member indices whose chunk was left out."""

    value: torch.Tensor  # [numel] float32
    rejected: tuple[int, ...]


def _norm(x: torch.Tensor) -> float:
    # float64 so that large but finite float32 values cannot overflow the sum of squares.
    return float(torch.linalg.vector_norm(x.to(torch.float64)))


def _lower_median(values: Sequence[float]) -> float:
    return sorted(values)[(len(values) - 1) // 2]


def check_contributions(chunks: Sequence[torch.Tensor], norm_bound: float = 0.0, *,
                        assume_finite: bool = False) -> list[int]:
    """Indices of the chunks to reject: non-finite, or norm > norm_bound x median norm.

    `assume_finite` skips the finite scan for callers that already checked every chunk
    (the networked round refuses non-finite payloads when it decodes them).
    """
    finite = [assume_finite or bool(torch.isfinite(c).all()) for c in chunks]
    rejected = [i for i, ok in enumerate(finite) if not ok]
    if norm_bound > 0:
        norms = {i: _norm(c) for i, c in enumerate(chunks) if finite[i]}
        if norms:
            limit = norm_bound * _lower_median(list(norms.values()))
            rejected += [i for i, n in norms.items() if n > limit]
    return sorted(rejected)


def check_claims(weights: Sequence[float], max_ratio: float) -> list[int]:
    """Indices of the members whose token claim exceeds `max_ratio` times the lower median
    of the group's positive claims (none when `max_ratio` is 0 or nobody claimed anything);
    see the module docstring."""
    positive = [w for w in weights if w > 0]
    if max_ratio <= 0 or not positive:
        return []
    limit = max_ratio * _lower_median(positive)
    return [i for i, w in enumerate(weights) if w > limit]


def trimmed_mean(chunks: Sequence[torch.Tensor], trim: int,
                 weights: Sequence[float] | None = None) -> torch.Tensor:
    """Coordinate-wise mean after dropping the `trim` largest and smallest values, each kept
    value weighted by its sender's tokens (`weights`; None or equal: the plain mean)."""
    n = len(chunks)
    k = min(trim, (n - 1) // 2)
    coef = None if weights is None else weight_coefficients(weights)
    if k == 0:
        return reduce_weighted(chunks, weights)
    stacked = torch.stack([c.to(torch.float32) for c in chunks])  # [n, numel]
    ordered, order = torch.sort(stacked, dim=0, stable=True)
    if coef is None:
        return ordered[k:n - k].mean(dim=0)
    w = torch.tensor(coef, dtype=torch.float32)[order[k:n - k]]  # [n - 2k, numel]
    return (ordered[k:n - k] * w).sum(dim=0) / w.sum(dim=0)


def centered_clip(chunks: Sequence[torch.Tensor], clip_tau: float, iters: int,
                  weights: Sequence[float] | None = None) -> torch.Tensor:
    """CenteredClip from the coordinate-wise median with a radius relative to the spread;
    each member's clipped step weighted by its tokens (`weights`; None or equal: 1/n)."""
    stacked = torch.stack([c.to(torch.float32) for c in chunks])  # [n, numel]
    n = stacked.shape[0]
    coef = None if weights is None else weight_coefficients(weights)
    ordered = torch.sort(stacked, dim=0).values
    v = (ordered[(n - 1) // 2] + ordered[n // 2]) / 2  # [numel] coordinate-wise median
    tau = clip_tau * _lower_median([_norm(x - v) for x in stacked])
    for _ in range(iters):
        diff = stacked - v  # [n, numel]
        dist = torch.linalg.vector_norm(diff.to(torch.float64), dim=1)  # [n]
        # A member at the centre (dist 0) contributes nothing to move it; tau 0 (all
        # members agree) leaves v where it is.
        scale = torch.where(dist > tau, tau / dist.clamp_min(1e-300), torch.ones_like(dist))
        step = diff * scale.to(torch.float32)[:, None]  # [n, numel]
        if coef is None:
            v = v + step.mean(dim=0)
        else:
            v = v + (step * torch.tensor(coef, dtype=torch.float32)[:, None]).sum(dim=0)
    return v


def aggregate(chunks: Sequence[torch.Tensor], spec: AggregatorSpec, *,
              weights: Sequence[float] | None = None,
              assume_finite: bool = False) -> Aggregated:
    """Check then combine the members' chunks (member order), weighted by `weights` (each
    member's tokens; None: equal); ValueError if none is left."""
    if not chunks:
        raise ValueError("aggregate: no contributions")
    if weights is not None and len(weights) != len(chunks):
        raise ValueError(f"aggregate: {len(weights)} weights for {len(chunks)} chunks")
    rejected = check_contributions(chunks, spec.norm_bound, assume_finite=assume_finite)
    if weights is not None:
        rejected = sorted(set(rejected) | set(check_claims(weights, spec.max_weight_ratio)))
    drop = set(rejected)
    kept = [c for i, c in enumerate(chunks) if i not in drop]
    kept_w = None if weights is None else [w for i, w in enumerate(weights) if i not in drop]
    if not kept:
        raise ValueError(f"aggregate: all {len(chunks)} contributions rejected")
    if spec.name == "trimmed_mean":
        value = trimmed_mean(kept, spec.trim, kept_w)
    elif spec.name == "centered_clip":
        value = centered_clip(kept, spec.clip_tau, spec.clip_iters, kept_w)
    else:
        value = reduce_weighted(kept, kept_w)
    return Aggregated(value, tuple(rejected))


def convicted(rejected_by: Mapping[int, Iterable[int]], owners: Iterable[int]) -> set[int]:
    """Members that a strict majority of the other owners rejected in at least one chunk.

    `rejected_by` maps an owner to the members it left out; `owners` are the members with a
    non-empty part. What counts towards a ban: an owner's list cannot be checked by anyone
    else, so one malicious owner naming an honest member must not get it banned, while a
    member whose whole contribution is off is rejected by every honest owner.
    """
    owner_set = set(owners)
    votes = Counter(m for o, ms in rejected_by.items() if o in owner_set for m in set(ms)
                    if m != o)
    return {m for m, v in votes.items() if 2 * v > len(owner_set - {m})}


@dataclass
class BanTracker:
    """Bans a peer whose contributions were rejected in `max_rejections` rounds within
    `window` seconds, for `ban_seconds`. Pure: callers pass `now` (any monotonic clock).

    Every member of a round learns the same rejections (they travel in the result
    messages), so members that were in the same rounds ban the same peers.
    """

    max_rejections: int = 3
    window: float = 600.0
    ban_seconds: float = 300.0
    rejections_total: int = 0
    bans_total: int = 0
    _recent: dict[str, deque[float]] = field(default_factory=dict, repr=False)
    _until: dict[str, float] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.max_rejections < 1 or not self.window > 0 or not self.ban_seconds > 0:
            raise ValueError(f"BanTracker: max_rejections={self.max_rejections}, "
                             f"window={self.window}, ban_seconds={self.ban_seconds}: need "
                             ">= 1, > 0, > 0")

    def record(self, peer: str, now: float) -> bool:
        """Count one round in which `peer` was rejected; True if this bans it now."""
        self.rejections_total += 1
        if self.is_banned(peer, now):
            return False
        times = self._recent.setdefault(peer, deque())
        times.append(now)
        while times and times[0] <= now - self.window:
            times.popleft()
        if len(times) < self.max_rejections:
            return False
        del self._recent[peer]
        self._until[peer] = now + self.ban_seconds
        self.bans_total += 1
        return True

    def is_banned(self, peer: str, now: float) -> bool:
        return self._until.get(peer, float("-inf")) > now

    def banned(self, now: float) -> set[str]:
        """Peers banned at `now` (expired bans are forgotten)."""
        for peer in [p for p, t in self._until.items() if t <= now]:
            del self._until[peer]
        return set(self._until)
