"""Per-fragment outer state: the last synced global weights g and Nesterov SGD momentum.

The averaged pseudo-gradient is treated as a gradient on g, with the exact update of
`torch.optim.SGD(nesterov=True, dampening=0)`; state is float32 (optionally on the CPU).
A sparse round (`algo/sparse.py`) steps only the values at its positions, weights and
momentum: it says nothing of the others, and momentum left to run there would keep moving
them, round after round, with no pseudo-gradient to correct it until they are drawn again
(tens of rounds at a few percent), up to lr / (1 - momentum) times the last value sent.
The pseudo-gradient and merge rules of Streaming DiLoCo live here too.
"""

from __future__ import annotations

import torch

__all__ = ["NonFiniteError", "OuterState", "merge", "pseudo_gradient"]


class NonFiniteError(ValueError):
    """An averaged pseudo-gradient with NaN/Inf: applying it would destroy the weights."""


def pseudo_gradient(global_weights: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """d = g - w (how far this worker moved since the last sync), float32 [numel]."""
    return global_weights - local.to(global_weights.device, torch.float32)


def merge(local: torch.Tensor, new_global: torch.Tensor, alpha: float) -> torch.Tensor:
    """w <- alpha * w + (1 - alpha) * g_new; alpha = 0 is an exact replace."""
    g = new_global.to(local.device, torch.float32)
    if alpha == 0.0:
        return g.clone()
    return local.to(torch.float32).mul(alpha).add_(g, alpha=1.0 - alpha)


class OuterState:
    """Global weights and momentum buffer of one fragment."""

    def __init__(self, initial: torch.Tensor, lr: float, momentum: float, nesterov: bool = True,
                 device: torch.device | str = "cpu") -> None:
        self.weights = initial.detach().to(device, torch.float32).clone()  # [numel]
        self.momentum_buf = torch.zeros_like(self.weights)  # [numel]
        self.lr = lr
        self.momentum = momentum
        self.nesterov = nesterov
        self.steps = 0

    def step(self, mean_delta: torch.Tensor, lr: float | None = None,
             positions: torch.Tensor | None = None) -> torch.Tensor:
        """Apply one outer step with the averaged pseudo-gradient [numel] at `lr` (default:
        the state's own rate); returns the new g. `positions` (K,): a sparse round's, the
        only values that move (module docstring)."""
        grad = mean_delta.to(self.weights.device, torch.float32)
        if not bool(torch.isfinite(grad).all()):
            bad = int((~torch.isfinite(grad)).sum())
            raise NonFiniteError(f"averaged pseudo-gradient has {bad} non-finite values; "
                                 "refusing to apply it")
        lr = self.lr if lr is None else lr
        if positions is None:
            self._update(self.weights, self.momentum_buf, grad, lr)
        else:
            at = positions.to(self.weights.device)
            weights, buf = self.weights.index_select(0, at), self.momentum_buf.index_select(0, at)
            self._update(weights, buf, grad.index_select(0, at), lr)
            self.weights.index_copy_(0, at, weights)
            self.momentum_buf.index_copy_(0, at, buf)
        self.steps += 1
        return self.weights

    def _update(self, weights: torch.Tensor, buf: torch.Tensor, grad: torch.Tensor,
                lr: float) -> None:
        """torch's SGD update of `weights` and momentum `buf` in place."""
        if self.momentum != 0.0:
            # Zero-initialised buffer: m*0 + grad == grad exactly, as torch's first step.
            buf.mul_(self.momentum).add_(grad)
            grad = grad.add(buf, alpha=self.momentum) if self.nesterov else buf
        weights.add_(grad, alpha=-lr)
