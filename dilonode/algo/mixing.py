"""Outer-state mixing for bounded groups: how members of a group end a round on one state,
and how far apart the replicas of a grouped swarm are.

In a grouped swarm (`algo/groups.py`) each group averages its own pseudo-gradient, so
groups apply different updates and, left alone, their outer states drift apart like
random walks. Mixing rounds also average the members' outer state (weights g and Nesterov
momentum m) *before* the outer step: the outer step is linear in (g, m, d), so stepping
the group's mean state with the group's mean pseudo-gradient gives exactly (up to float
rounding) the mean of the states each member would reach alone, and every member ends the
round on the same state. Groups rotate, so the differences between groups contract too.

The state travels as one flat float32 vector `[g; m]` (`pack_state`) averaged with the
float32 codec (plain mean in member order: every member gets the same bits), and the
fragment's chain (`algo/chain.py`) after a mixing round starts from the digest of that
mean (`mixed_chain`): members that mixed hold the same chain again. Pure (torch only).
"""

from __future__ import annotations

from collections.abc import Sequence

import blake3
import torch

from dilonode.algo.chain import CHAIN_HEX

__all__ = ["mixed_chain", "pack_state", "spread", "unpack_state"]


def pack_state(weights: torch.Tensor, momentum: torch.Tensor) -> torch.Tensor:
    """[g; m] as one flat float32 CPU vector [2 * numel] (a copy)."""
    if weights.shape != momentum.shape:
        raise ValueError(f"pack_state: weights {tuple(weights.shape)} and momentum "
                         f"{tuple(momentum.shape)} differ")
    return torch.cat([weights.detach().reshape(-1).to("cpu", torch.float32),
                      momentum.detach().reshape(-1).to("cpu", torch.float32)])


def unpack_state(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, m) views of a packed state [2 * numel] -> ([numel], [numel])."""
    if flat.dim() != 1 or flat.numel() % 2:
        raise ValueError(f"unpack_state: need a flat vector of even length, got "
                         f"{tuple(flat.shape)}")
    half = flat.numel() // 2
    return flat[:half], flat[half:]


def mixed_chain(state_digest: str) -> str:
    """The chain of a fragment whose state was just replaced by a group's mean state named
    by `state_digest` (the mixing round's result digest, the same on every member): the
    members' chains differed before, they hold one state and one chain now."""
    text = f"dilonode-mixed\n{state_digest}"
    return blake3.blake3(text.encode()).hexdigest()[:CHAIN_HEX]


def spread(states: Sequence[torch.Tensor]) -> tuple[float, float]:
    """(max, mean) over replicas of ||x_i - mean|| / ||mean||, the relative L2 distance of
    each replica from the swarm mean (float64 accumulation; 0 for identical replicas)."""
    if not states:
        raise ValueError("spread: no states")
    stack = torch.stack([s.detach().reshape(-1).to(torch.float64) for s in states])  # [n, d]
    mean = stack.mean(dim=0)
    norm = float(mean.norm())
    dist = (stack - mean).norm(dim=1) / (norm if norm > 0 else 1.0)  # [n]
    return float(dist.max()), float(dist.mean())
