"""Butterfly all-reduce arithmetic: how a flat tensor is split among group members, and how
the owner of a part reduces the contributions it received.

Pure functions shared by the in-process simulator and the networked all-reduce, so both
produce bit-identical averages: every member computes the same partition from the same
(numel, weights, align), and owners sum decoded contributions in float32 in member order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from dilonode.algo.codecs import Codec

__all__ = ["CHUNKING", "CHUNK_FLOOR", "PIPELINE_CHUNKS", "butterfly_average", "part_bounds",
           "reduce_mean", "reduce_weighted", "reduction_steps", "round_chunk_numel",
           "weight_coefficients", "wire_bytes_ideal"]


# A part is cut into at least this many chunks, so that while the owner reduces one chunk
# the next is on the wire (on a slow link a part sent whole leaves the uplink idle while
# the owner waits for it and reduces); and no chunk is smaller than CHUNK_FLOOR values,
# because every chunk costs fixed work (codec calls, a thread hop, GPU launches and syncs).
PIPELINE_CHUNKS = 3
CHUNK_FLOOR = 1 << 18
# The rule's name, compared at matchmaking: members that cut rounds differently must not
# form a group.
CHUNKING = f"part/{PIPELINE_CHUNKS}, >= {CHUNK_FLOOR}"


def round_chunk_numel(numel: int, members: int, cap: int, block: int) -> int:
    """Values per chunk in a round of `numel` values among `members`: about a part's worth
    divided by PIPELINE_CHUNKS, at least CHUNK_FLOOR and at most `cap` (the configured
    `network.chunk_numel`; a cap at or below the floor is taken as it is), a multiple of
    `block`. Every member derives the same from the round's spec (protocol section 4)."""
    if cap <= CHUNK_FLOOR:
        return cap
    per_part = -(-numel // max(members, 1))
    want = max(-(-per_part // PIPELINE_CHUNKS), CHUNK_FLOOR)
    want = -(-want // block) * block  # chunks are whole codec blocks
    return min(cap, want)


def part_bounds(numel: int, weights: Sequence[float], align: int = 1) -> list[tuple[int, int]]:
    """Split [0, numel) into len(weights) contiguous [start, end) parts sized by weight.

    Boundaries fall on multiples of `align` (codec blocks never straddle two owners); a member
    with weight 0 gets an empty part. Exact rational arithmetic with largest-remainder
    rounding, so every peer derives the same split from the same inputs.
    """
    if numel < 0 or align < 1:
        raise ValueError(f"part_bounds: numel={numel}, align={align}: need numel >= 0, align >= 1")
    if not weights or any(not (w >= 0) for w in weights) or not any(w > 0 for w in weights):
        raise ValueError(f"part_bounds: weights={list(weights)}: need >= 1 weight, all >= 0, "
                         "one > 0")
    units = -(-numel // align)  # ceil: number of align-sized units to hand out
    fracs = [Fraction(w) for w in weights]
    total = sum(fracs)
    shares = [f * units / total for f in fracs]
    counts = [int(s) for s in shares]
    # Largest remainder; ties go to the lower index so the result is fully determined.
    order = sorted(range(len(shares)), key=lambda i: (-(shares[i] - counts[i]), i))
    for i in order[: units - sum(counts)]:
        counts[i] += 1
    bounds, start = [], 0
    for c in counts:
        end = min(start + c * align, numel)
        bounds.append((start, end))
        start = end
    return bounds


def reduce_mean(contributions: Sequence[torch.Tensor],
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of equally shaped float32 tensors, summed in the given (member) order.

    The order is part of the protocol: float32 addition is not associative, and every
    implementation must sum in ascending member index to agree bit for bit. `out` (float32,
    the same shape, overlapping no contribution) receives the mean instead of a new tensor.
    """
    if not contributions:
        raise ValueError("reduce_mean: no contributions")
    if out is None:
        acc = contributions[0].to(torch.float32, copy=True)
    else:
        acc = out.copy_(contributions[0])
    for c in contributions[1:]:
        acc.add_(c)
    return acc.div_(_divisor(acc, len(contributions)))


def _divisor(acc: torch.Tensor, n: int) -> float | torch.Tensor:
    """n as the divisor of `acc.div_`: a number on the CPU, a tensor on other devices,
    where torch computes `t / number` as `t * (1 / number)`, which can differ in the last
    bit from the division the protocol specifies."""
    if acc.device.type == "cpu":
        return float(n)
    return torch.full((), float(n), dtype=acc.dtype, device=acc.device)


def reduction_steps(weights: Sequence[float] | None, n: int) -> list[tuple[str, float]]:
    """`reduce_weighted(contributions, weights)` as one step per contribution, in member
    order, for owners that fold each contribution into the result as it is decoded.

    Each step is (name, coefficient) applied to the decoded values v of that member:
    "write" (acc = v), "add" (acc += v), "add_divide" (acc = (acc + v) / coefficient),
    "write_scaled" (acc = float32(v * c)), "add_scaled" (acc += float32(v * c)). The plain
    mean is write, add..., add_divide by N; the weighted mean write_scaled then
    add_scaled with `weight_coefficients`: the same operations in the same order as
    `reduce_weighted`, so the same bits (tested against it and the golden reductions).
    """
    if n < 1:
        raise ValueError("reduction_steps: no contributions")
    coef = None if weights is None else weight_coefficients(weights)
    if coef is None:
        if n == 1:
            return [("write", 1.0)]  # x / 1 == x
        return [("write", 1.0)] + [("add", 1.0)] * (n - 2) + [("add_divide", float(n))]
    if len(coef) != n:
        raise ValueError(f"reduction_steps: {len(coef)} weights for {n} contributions")
    return [("write_scaled", coef[0])] + [("add_scaled", c) for c in coef[1:]]


def weight_coefficients(weights: Sequence[float]) -> list[float] | None:
    """Per-member coefficients of a token-weighted mean, or None for the plain mean.

    None when every weight is equal (or all are 0): the mean is then `reduce_mean`, sum then
    divide by N, exactly as for unweighted rounds. Otherwise `w_i / sum(w)`, summed in
    member order in float64 and each rounded to float32 (protocol/README.md section 5), so
    every implementation derives the same coefficients.
    """
    if not weights:
        raise ValueError("weight_coefficients: no weights")
    if any(not (w >= 0 and math.isfinite(w)) for w in weights):
        raise ValueError(f"weight_coefficients: weights={list(weights)}: need finite >= 0")
    total = 0.0
    for w in weights:
        total += float(w)
    if total == 0 or all(w == weights[0] for w in weights):
        return None
    return [float(np.float32(float(w) / total)) for w in weights]


def reduce_weighted(contributions: Sequence[torch.Tensor], weights: Sequence[float] | None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Token-weighted mean of equally shaped float32 tensors, in member order.

    `weights` None or all equal: `reduce_mean`. Otherwise, with `c = weight_coefficients`:
    `acc = x_0 * c_0`, then `acc += x_i * c_i` for i = 1..N-1, every product rounded to
    float32 before the addition (no fused multiply-add), so the result does not depend on
    the CPU or the kernel. `out` as in `reduce_mean`.
    """
    coef = None if weights is None else weight_coefficients(weights)
    if coef is None:
        return reduce_mean(contributions, out=out)
    if len(coef) != len(contributions):
        raise ValueError(f"reduce_weighted: {len(coef)} weights for "
                         f"{len(contributions)} contributions")
    first = contributions[0].to(torch.float32)
    acc = torch.mul(first, coef[0]) if out is None else torch.mul(first, coef[0], out=out)
    tmp = torch.empty_like(acc)
    for c, k in zip(contributions[1:], coef[1:], strict=True):
        acc.add_(torch.mul(c, k, out=tmp))
    return acc


def wire_bytes_ideal(payload_bytes: int, group_size: int) -> float:
    """Bytes one member sends in an ideal butterfly all-reduce: 2 (N-1)/N x payload."""
    if group_size <= 1:
        return 0.0
    return 2.0 * (group_size - 1) / group_size * payload_bytes


Reducer = Callable[[list[torch.Tensor], list[float]], torch.Tensor]


def _default_reduce(chunks: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    return reduce_weighted(chunks, weights)


def butterfly_average(contributions: Sequence[torch.Tensor], weights: Sequence[float],
                      codec: Codec, *,
                      reduce: Reducer | None = None,
                      chunk_numel: int | None = None, align: int | None = None,
                      token_weights: Sequence[float] | None = None,
                      ) -> tuple[torch.Tensor, list[int], list[int]]:
    """The whole butterfly all-reduce computed in one place (the simulator's data path).

    Same arithmetic as the networked round: every contribution to part j is quantized
    (the owner's too), the owner j combines the decoded chunks in member order with
    `reduce(chunks, token_weights)` (default `reduce_weighted`; one call per chunk of
    `chunk_numel` values, as the networked round reduces; `chunk_numel` None: the whole
    part at once), quantizes the result and everyone, the owner included,
    keeps decode(encode(result)). Parts are aligned to `align` (default: the codec's block;
    the daemon aligns to the configured block size even for float codecs). Returns the
    averaged flat tensor and, per member, the payload bytes it would send and receive.
    `weights` size the parts (bandwidth); `token_weights` (default: all equal) weight the
    mean, as each contribution's `weight` does on the wire.
    """
    n = len(contributions)
    reduce = reduce or _default_reduce
    tokens = list(token_weights) if token_weights is not None else [1.0] * n
    numel = contributions[0].numel()
    bounds = part_bounds(numel, weights, align=align or codec.block_size)
    # On the contributions' device: a codec with torch ops keeps the whole reduction there.
    out = torch.empty(numel, dtype=torch.float32, device=contributions[0].device)  # [numel]
    sent = [0] * n
    received = [0] * n
    for owner, (s, e) in enumerate(bounds):
        step = chunk_numel or max(e - s, 1)
        for lo in range(s, e, step):
            hi = min(lo + step, e)
            decoded = []
            for i, c in enumerate(contributions):
                data, meta = codec.encode(c[lo:hi])
                decoded.append(codec.decode(data, meta))
                if i != owner:
                    sent[i] += len(data)
                    received[owner] += len(data)
            data, meta = codec.encode(reduce(decoded, tokens))
            out[lo:hi] = codec.decode(data, meta)
            sent[owner] += len(data) * (n - 1)
            for i in range(n):
                if i != owner:
                    received[i] += len(data)
    return out, sent, received
