"""Error feedback: what a lossy round did not carry of a node's pseudo-gradient goes into the
node's next round of the same fragment instead of being lost.

Per fragment a node keeps a residual r (float32, the fragment's size, zero at the start).
At round t with pseudo-gradient d_t:

    a_t   = d_t + r_{t-1}                  what the node owes the swarm
    s_t   = decode(encode(a_t))            what the round carries of it (sparse: zeros off
                                           the round's positions)
    r_t   = beta * (a_t - s_t)             what it still owes, decayed by beta in (0, 1]

With beta = 1 nothing is lost, only delayed: s_1 + ... + s_t + r_t = d_1 + ... + d_t
exactly in real arithmetic (float32 rounds each subtraction once). beta < 1 is SparseLoCo's
decay (arXiv 2508.15706): a stale remainder counts less the longer it waits. The decay is
applied when the remainder is stored, so the residual held (and checkpointed) is exactly
what the next round adds.

The residual is the node's own unsent contribution: a checkpoint keeps it (a node that
resumes still owes it), a joiner starts at zero (it owes nothing), a node that adopts a
peer's state resets it (its debt was against a state it gave up). Pure: no I/O.
"""

from __future__ import annotations

import torch

from dilonode.algo.codecs import Codec, all_finite

__all__ = ["carried", "owed", "remainder"]


def owed(delta: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """delta: (n,) float32, residual: (n,) or None -> (n,) a_t = delta + residual (a new
    tensor; delta when there is no residual yet)."""
    if residual is None:
        return delta
    if residual.shape != delta.shape:
        raise ValueError(f"residual of {residual.numel()} values for a pseudo-gradient of "
                         f"{delta.numel()}")
    return delta + residual


def carried(codec: Codec, values: torch.Tensor) -> torch.Tensor:
    """(m,) -> (m,) float32 decode(encode(values)) on the CPU: what the round carries of
    `values` when its parts are block-aligned (they are: `butterfly` cuts parts at block
    boundaries, so encoding the whole vector gives each part's blocks)."""
    data, meta = codec.encode(values.detach().to("cpu", torch.float32).contiguous())
    return codec.decode(data, meta)


def remainder(owed_now: torch.Tensor, sent: torch.Tensor, decay: float) -> torch.Tensor:
    """(n,), (n,) -> (n,) r_t = decay * (a_t - s_t); zeros when a_t is not finite (the round
    refuses such a contribution, and a NaN residual would poison every later round)."""
    if not all_finite(owed_now):
        return torch.zeros_like(owed_now)
    rest = owed_now - sent
    if decay != 1.0:
        rest.mul_(decay)
    return rest
