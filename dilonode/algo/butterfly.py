"""Butterfly all-reduce arithmetic: how a flat tensor is split among group members, and how
the owner of a part reduces the contributions it received.

Pure functions shared by the in-process simulator and the networked all-reduce, so both
produce bit-identical averages: every member computes the same partition from the same
(numel, weights, align), and owners sum decoded contributions in float32 in member order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dilonode.algo.codecs import Codec

__all__ = ["butterfly_average", "part_bounds", "reduce_mean", "wire_bytes_ideal"]


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
    return acc.div_(len(contributions))


def wire_bytes_ideal(payload_bytes: int, group_size: int) -> float:
    """Bytes one member sends in an ideal butterfly all-reduce: 2 (N-1)/N x payload."""
    if group_size <= 1:
        return 0.0
    return 2.0 * (group_size - 1) / group_size * payload_bytes


def butterfly_average(contributions: Sequence[torch.Tensor], weights: Sequence[float],
                      codec: Codec, *,
                      reduce: Callable[[list[torch.Tensor]], torch.Tensor] = reduce_mean,
                      chunk_numel: int | None = None, align: int | None = None,
                      ) -> tuple[torch.Tensor, list[int], list[int]]:
    """The whole butterfly all-reduce computed in one place (the simulator's data path).

    Same arithmetic as the networked round: every contribution to part j is quantized
    (the owner's too), the owner j combines the decoded chunks in member order with
    `reduce` (one call per chunk of `chunk_numel` values, as the networked round reduces;
    None: the whole part at once), quantizes the result and everyone, the owner included,
    keeps decode(encode(result)). Parts are aligned to `align` (default: the codec's block;
    the daemon aligns to the configured block size even for float codecs). Returns the
    averaged flat tensor and, per member, the payload bytes it would send and receive.
    """
    n = len(contributions)
    numel = contributions[0].numel()
    bounds = part_bounds(numel, weights, align=align or codec.block_size)
    out = torch.empty(numel, dtype=torch.float32)  # [numel]
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
            data, meta = codec.encode(reduce(decoded))
            out[lo:hi] = codec.decode(data, meta)
            sent[owner] += len(data) * (n - 1)
            for i in range(n):
                if i != owner:
                    received[i] += len(data)
    return out, sent, received
