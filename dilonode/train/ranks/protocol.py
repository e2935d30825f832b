"""`Ranks`: what a `Worker` (and the node that builds it) asks of its node's ranks.

Two classes implement it: `SingleRank` (ranks/single.py), a node of one process, where every
operation is local and the arithmetic is the one-process arithmetic; and `NodeRanks`
(ranks/node_ranks.py), one rank of a node on several devices, where the same operation is a
collective inside the node. The Worker reads the same either way: it asks `Ranks` for its
slice of a fragment, hands it the swarm's round and the imported states, and never branches
on how many ranks there are to do tensor work. tests/unit/test_ranks.py checks that both
classes provide every member below with the same signature.

Fragments are named by their index `p`; `params` are that fragment's parameters as the
inner model holds them (whole tensors, or DTensors under FSDP2).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

from dilonode.algo.outer import OuterState
from dilonode.collective import Collective, PendingReduce, ReduceResult, RoundRequest, StateSource
from dilonode.train.state import OuterCopy, WorkerState

__all__ = ["Ranks"]


class Ranks(Protocol):
    """A node's ranks as one rank sees them (see the module docstring)."""

    rank: int  # this process's rank in the node (0: the leader)
    world: int  # ranks in the node
    leader: bool  # rank 0: decides, talks to the swarm, announces every op
    strategy: str  # how the inner model is laid out: "single", or "ddp" / "fsdp" (or "auto")
    devices: list[dict[str, Any]]  # every rank's device (`device_info`), after `handshake`

    def handshake(self, identity: str | int | None, device: torch.device) -> str | int | None:
        """Learn every rank's device; returns the identity the node's data stream follows.
        One rank: `identity` itself. Several: the leader's, broadcast to the others (which
        pass None)."""
        ...

    def op(self, name: str, args: tuple[Any, ...]) -> contextlib.AbstractContextManager[None]:
        """Context of a Worker op every rank runs together (`worker.node_op`). One rank:
        nothing. Several: the leader announces `name` and `args` (tensors left out) to the
        others before the op runs, and a failed collective inside it becomes `RankFailure`."""
        ...

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        """The module the inner steps run on `device`. One rank: `model` moved there.
        Several: `model` wrapped in DDP or sharded with FSDP2."""
        ...

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a node batch [B, ...]. One rank: all of them. Several:
        [B / world, ...]."""
        ...

    def accumulating(self, module: nn.Module,
                     last: bool) -> contextlib.AbstractContextManager[None]:
        """Around one micro-batch's forward and backward (gradient accumulation): one rank
        does nothing. Several: the ranks' gradients are reduced only on the `last` one (DDP's
        `no_sync`, FSDP2's `set_requires_gradient_sync`), once per inner step."""
        ...

    def node_loss(self, loss: torch.Tensor) -> float:
        """The node's mean loss. One rank: `loss`. Several: the mean over the ranks."""
        ...

    def mean(self, value: float) -> float:
        """The node's mean of a per-rank number. One rank: `value`. Several: all-reduced."""
        ...

    def setup_fragments(self, groups: Sequence[Sequence[nn.Parameter]], align: int) -> None:
        """Plan how the ranks share each fragment (`groups[p]`: fragment p's parameters).
        One rank: nothing to plan. Several: outer slices aligned to `align` values and, under
        FSDP2, the exchange between parameter shards and slices."""
        ...

    def local_flat(self, p: int, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """Fragment p's local weights as this rank keeps its outer state, float32 [slice].
        One rank: the whole fragment flattened. Several: this rank's slice."""
        ...

    def apply(self, p: int, params: Sequence[torch.Tensor], new_global: torch.Tensor,
              alpha: float) -> None:
        """Merge fragment p's new global weights (this rank's slice) into the local weights
        with `fragment_update_alpha` = `alpha`. One rank: in place. Several: the slices go
        back to every rank's copy (DDP) or shards (FSDP2) first."""
        ...

    def set_local(self, p: int, params: Sequence[torch.Tensor], weights: torch.Tensor) -> None:
        """Fragment p's local weights := its outer weights (this rank's slice given)."""
        ...

    def local_tensors(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """What this rank holds of `params`. One rank and DDP: the tensors. FSDP2: its
        shards."""
        ...

    def begin(self, collective: Collective, request: RoundRequest, delta: torch.Tensor,
              state: StateSource | None = None) -> PendingReduce:
        """Start the swarm's round `request` on this node's pseudo-gradient (`delta`: this
        rank's slice, trained on `request.weight` tokens). One rank: `collective.begin` with
        `state`, the
        fragment's packed outer state for a grouped swarm's mixing. Several: the slices are
        gathered on the leader, which begins the round (`state` unused: the outer state is
        sharded); the others get a handle that is done at once and never waited for."""
        ...

    def localize(self, p: int, result: ReduceResult) -> ReduceResult:
        """Round result of fragment p as this rank applies it. One rank: `result`. Several:
        its mean scattered from the leader, cut to this rank's slice (a non-finite mean
        reaches every rank as NaN, so all refuse it)."""
        ...

    def gather(self, p: int, part: torch.Tensor) -> torch.Tensor | None:
        """Fragment p's whole vector from this rank's `part`. One rank: `part`. Several: the
        slices gathered on the leader (float32 CPU); None on the others."""
        ...

    def check_state(self, state: WorkerState) -> None:
        """Before an import: ValueError unless `state` fits this model. One rank: nothing
        (`WorkerState.apply_to` checks shapes). Several: the leader checks every fragment's
        tensors against its layout before announcing the import."""
        ...

    def apply_state(self, state: WorkerState, outer: Sequence[OuterState],
                    fragments: Sequence[int] | None = None) -> None:
        """Copy an imported state's fragments (all, or `fragments`) into `outer`. One rank:
        whole. Several: scattered from the leader into every rank's slices."""
        ...

    def fragments_to_gather(self, reuse: WorkerState | None, rounds: list[int],
                            outer_steps: list[int], chains: list[str]) -> list[int]:
        """The fragments an export must gather (`full_outer`), given the counters and chains
        it is captured at and `reuse`, an earlier capture. One rank: none (its outer state
        is here whole; the capture itself copies what changed). Several: those whose state
        changed since `reuse` (`reusable_fragments`); the others are not gathered again."""
        ...

    def full_outer(self, outer: Sequence[OuterState],
                   need: Sequence[int]) -> Sequence[OuterState | OuterCopy]:
        """The outer state an export captures. One rank: `outer` itself. Several, on the
        leader: copies with the whole tensors of the fragments in `need` (the others carry
        their step counts only, reused from an earlier capture)."""
        ...

    def stop(self) -> None:
        """The node is ending. One rank: nothing. Several: the leader tells the others to
        exit (idempotent)."""
        ...

    def close(self) -> None:
        """Leave the node's process groups (several ranks); nothing for one rank."""
        ...
