"""The next-token loss computed a chunk of tokens at a time, so that full float32 logits
[tokens, vocab] never exist: at a 32K vocabulary and 8 x 1024 tokens per micro-batch they
would take 1 GB, and their gradient as much again.

`chunked_cross_entropy(hidden, weight, targets, chunk)` equals
`F.cross_entropy(F.linear(hidden, weight).float(), targets)` up to float rounding. Each
chunk's logits are recomputed in the backward pass (`torch.utils.checkpoint`): the head's
matmul runs twice, its activations once per chunk at most.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["chunked_cross_entropy"]


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          chunk: int) -> torch.Tensor:
    """Mean cross entropy of `hidden @ weight.T` (hidden [N, D], weight [V, D]) against
    `targets` [N], `chunk` tokens at a time, in float32."""
    if chunk < 1:
        raise ValueError(f"chunked_cross_entropy: chunk = {chunk}, need >= 1")
    n = hidden.shape[0]
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, n, chunk):
        part = checkpoint(_loss_sum, hidden[start:start + chunk], weight,
                          targets[start:start + chunk], use_reentrant=False,
                          preserve_rng_state=False)
        total = total + part
    return total / n


def _loss_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight)  # [c, V], in the autocast dtype
    return F.cross_entropy(logits.float(), targets, reduction="sum")
