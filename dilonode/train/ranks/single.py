"""`SingleRank`: the ranks of a node of one process. Every operation is local: no
collectives, the plain one-process arithmetic of a `Worker` (`Ranks`, ranks/protocol.py,
says what each member does)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from dilonode.algo.fragments import flatten, unflatten_into
from dilonode.algo.outer import OuterState, merge
from dilonode.collective import Collective, PendingReduce, ReduceResult, RoundRequest, StateSource
from dilonode.train.device import device_info
from dilonode.train.state import OuterCopy, WorkerState

__all__ = ["SingleRank"]


class SingleRank:
    """A node of one process: every operation is local."""

    rank, world, leader, strategy = 0, 1, True, "single"

    def __init__(self) -> None:
        self.devices: list[dict[str, Any]] = []

    def handshake(self, identity: str | int | None, device: torch.device) -> str | int | None:
        self.devices = [device_info(device)]
        return identity

    def op(self, name: str, args: tuple[Any, ...]) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        return model.to(device)

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def accumulating(self, module: nn.Module,
                     last: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def node_loss(self, loss: torch.Tensor) -> float:
        return float(loss.detach())

    def mean(self, value: float) -> float:
        return value

    def setup_fragments(self, groups: Sequence[Sequence[nn.Parameter]], align: int) -> None:
        """Nothing to plan: the rank holds every fragment whole."""

    def local_flat(self, p: int, params: Sequence[torch.Tensor]) -> torch.Tensor:
        return flatten(params)

    def apply(self, p: int, params: Sequence[torch.Tensor], new_global: torch.Tensor,
              alpha: float) -> None:
        unflatten_into(merge(flatten(params), new_global, alpha), params)

    def set_local(self, p: int, params: Sequence[torch.Tensor], weights: torch.Tensor) -> None:
        unflatten_into(weights, params)

    def local_tensors(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [t.data for t in params]

    def begin(self, collective: Collective, request: RoundRequest, delta: torch.Tensor,
              state: StateSource | None = None) -> PendingReduce:
        return collective.begin(request, delta, state=state)

    def localize(self, p: int, result: ReduceResult) -> ReduceResult:
        return result

    def gather(self, p: int, part: torch.Tensor) -> torch.Tensor | None:
        return part

    def check_state(self, state: WorkerState) -> None:
        """`WorkerState.apply_to` checks shapes itself."""

    def apply_state(self, state: WorkerState, outer: Sequence[OuterState],
                    fragments: Sequence[int] | None = None) -> None:
        if fragments is None:
            state.apply_to(outer)
        for p in fragments or ():
            state.apply_fragment(p, outer[p])

    def fragments_to_gather(self, reuse: WorkerState | None, rounds: list[int],
                            outer_steps: list[int], chains: list[str]) -> list[int]:
        return []

    def full_outer(self, outer: Sequence[OuterState],
                   need: Sequence[int]) -> Sequence[OuterState | OuterCopy]:
        return outer

    def stop(self) -> None:
        pass

    def close(self) -> None:
        pass
