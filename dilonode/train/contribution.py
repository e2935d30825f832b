"""What a worker sends of a fragment's pseudo-gradient and how it reads the round's result:
error feedback (`algo/error_feedback.py`) and sparse rounds (`algo/sparse.py`).

`Contributions.outgoing(f, r, delta)` turns round r's pseudo-gradient into the tensor the
collective averages: delta cut to the round's shared positions (codec.kind = randk); with
error feedback it stores the new residual (what the round will not carry) in the fragment.
codec.kind = topk hands the collective the whole vector: its codec (`cfg.codec.wire_name`)
sparsifies on the wire, and the residual is what that codec did not carry of it.
`incoming(f, result)` scatters a sparse round's mean back to the fragment's size, and
`merged(f, local, new_global, alpha)` is the landed round's merge, which with error feedback
in the weights (`codec.error_store`) keeps the residual there (they hold it, so the next
delta owes it again); with the buffer, `outgoing` adds the residual to the next delta and the
merge is the plain one.
With codec.kind = dense and no error feedback all three are the plain rules. No
networking.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from dilonode.algo.codecs import all_finite, get_codec
from dilonode.algo.error_feedback import carried, merge_keeping, owed, remainder
from dilonode.algo.sparse import gather, scatter, shared_positions
from dilonode.collective import ReduceResult
from dilonode.config import RunConfig
from dilonode.train.fragment_state import FragmentState

__all__ = ["Contributions"]


class Contributions:
    """A worker's error feedback and sparse rounds (module docstring)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg.codec
        self.seed = cfg.seed
        self.codec = get_codec(cfg.codec.wire_name, cfg.codec.block_size)

    @property
    def active(self) -> bool:
        return self.cfg.kind != "dense" or self.cfg.error_feedback

    @property
    def feeds_back(self) -> bool:
        """Whether the merge keeps a residual in the local weights (`codec.error_store`)."""
        return self.cfg.error_feedback and self.cfg.error_store == "weights"

    @property
    def buffered(self) -> bool:
        return self.cfg.error_feedback and self.cfg.error_store == "buffer"

    def outgoing(self, f: FragmentState, r: int, delta: torch.Tensor) -> torch.Tensor:
        """(n,) round r's pseudo-gradient of fragment f -> what the round averages: (n,),
        or (K,) values at the round's positions (sparse)."""
        if not self.active:
            return delta
        c = self.cfg
        positions = None
        # In the weights, delta holds the residual already; in the buffer, it is added.
        if self.buffered:
            delta = owed(delta, f.residual)
        send = delta
        if c.kind == "randk":
            positions = shared_positions(self.seed, f.index, r, delta.numel(), c.topk_density)
            send = gather(delta, positions)  # (K,)
        f.sparse_positions = positions
        if c.error_feedback:
            f.hold_residual(self._remainder(delta, send, positions))
        return send

    def _remainder(self, owe: torch.Tensor, send: torch.Tensor,
                   positions: torch.Tensor | None) -> torch.Tensor:
        if not all_finite(send):  # the round refuses it; the residual must stay finite
            return torch.zeros_like(owe)
        sent = carried(self.codec, send).to(owe.device)  # (K,) or (n,)
        if positions is not None:
            sent = scatter(sent, positions, owe.numel())  # (n,)
        return remainder(owe, sent, self.cfg.error_decay)

    def merged(self, f: FragmentState, local: torch.Tensor, new_global: torch.Tensor,
               alpha: float) -> torch.Tensor:
        """(n,) local weights of fragment f after its landed round's merge with the new
        global weights (n,): with error feedback they keep what the round left unsent."""
        residual = f.residual if self.feeds_back else None
        return merge_keeping(local, new_global, alpha, residual, self.cfg.error_decay)

    def incoming(self, f: FragmentState, result: ReduceResult) -> ReduceResult:
        """A landed fragment round's result at the fragment's size. A sparse round keeps no
        encoded result: joiners behind it fetch the fragment instead of replaying it."""
        positions, f.sparse_positions = f.sparse_positions, None
        if positions is None:
            return result
        numel = f.outer.weights.numel()
        mean = scatter(result.mean, positions, numel).to(f.outer.weights.device)
        return replace(result, mean=mean, encoded=None)
