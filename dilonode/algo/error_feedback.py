"""Error feedback: what a lossy round did not carry of a node's pseudo-gradient stays with
the node for its next round of the same fragment instead of being lost.

The node's local weights w hold it. Per fragment, at round t with global weights g:

    a_t   = g - w                          what the node owes the swarm: its pseudo-gradient,
                                           which already holds what earlier rounds left
    s_t   = decode(encode(a_t))            what the round carries of it (sparse: zeros off
                                           the round's positions)
    r_t   = beta * (a_t - s_t)             what it still owes, decayed by beta in (0, 1]

and when the round lands with new global weights g', the merge takes only the carried part
of the local weights toward g' and keeps the rest off it:

    w    <- merge(w + r_t / beta, g', alpha) - r_t

so that g' - w holds r_t exactly, plus alpha times what the merge keeps of the carried
part, as without error feedback. The residual is therefore never added to a pseudo-gradient
on top of local weights that still hold it: whatever alpha, each value a node trained is
owed once. With beta = 1, s_1 + ... + s_t + r_t = u_1 + ... + u_t exactly in real
arithmetic, u_t = a_t - r_{t-1} being round t's own part of its pseudo-gradient (alpha = 0:
the inner steps' movement since the last merge); a node alone with outer SGD at lr 1 ends
each merge with its local weights exactly r_t off the global weights. beta < 1 is
SparseLoCo's decay (arXiv 2508.15706): a stale remainder counts less the longer it waits;
the local weights let go of the decayed part at the merge.

Why not keep r beside the weights and add it to the next pseudo-gradient: the merge keeps
alpha of the local weights' offset, unsent part included, so the next round would owe that
part 1 + alpha times, and more each round it stays unsent; and with alpha = 0 the reset
local weights train the unsent movement again, which the residual then holds twice. Either
way what a value owes grows with every round it waits, and rand-k at a few percent leaves
most values out of dozens of rounds.

The other way, SparseLoCo's (arXiv 2508.15706, `codec.error_store = "buffer"`): the
residual lives beside the weights as an accumulator, and the merge is the plain one.

    a_t   = (g - w) + r_{t-1}              the round's pseudo-gradient plus what earlier
                                           rounds left unsent (`owed`)
    s_t, r_t                               as above

Inner steps then start from the merged weights, not off them by the residual, so gradients
are taken where the swarm's weights are; the price is the double count argued above (with
alpha = 0 the inner steps may move a value the residual still holds). Which serves is
measured in the compression frontier (docs/reports/), not argued.

The residual is the node's own unsent contribution: a checkpoint keeps it (a node that
resumes starts its local weights r off the global weights, so it still owes it; with the
buffer, at the global weights with the buffer restored), a joiner
starts at zero (it owes nothing), a node that adopts a peer's state resets it (its debt was
against a state it gave up). Pure: no I/O.
"""

from __future__ import annotations

import torch

from dilonode.algo.codecs import Codec, all_finite
from dilonode.algo.outer import merge

__all__ = ["carried", "merge_keeping", "owed", "remainder"]


def merge_keeping(local: torch.Tensor, new_global: torch.Tensor, alpha: float,
                  residual: torch.Tensor | None, decay: float) -> torch.Tensor:
    """(n,) local weights, (n,) new global weights -> (n,) the local weights after the merge
    when the round left `residual` (r_t, decayed by `decay`) unsent: the carried part of the
    local weights merged with `alpha`, and the new global weights minus the result = r_t
    plus what the merge keeps (module docstring). No residual: the plain merge. alpha = 0
    gives new_global - r_t whatever `local` is (a node resuming with its residual)."""
    if residual is None:
        return merge(local, new_global, alpha)
    if residual.shape != local.shape:
        raise ValueError(f"residual of {residual.numel()} values for a fragment of "
                         f"{local.numel()}")
    r = residual.to(local.device, torch.float32)
    sent_part = local.to(torch.float32).add(r, alpha=1.0 / decay)  # w + (a_t - s_t)
    return merge(sent_part, new_global, alpha).sub_(r)


def owed(delta: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """(n,) pseudo-gradient, (n,) residual kept beside the weights -> (n,) a_t = delta +
    r_{t-1}, what a round owes with the buffer (`delta` itself when nothing is kept)."""
    if residual is None:
        return delta
    if residual.shape != delta.shape:
        raise ValueError(f"residual of {residual.numel()} values for a fragment of "
                         f"{delta.numel()}")
    return delta.add(residual.to(delta.device, delta.dtype))


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
