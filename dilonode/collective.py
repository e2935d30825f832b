"""The `Collective` seam: "average this flat tensor with the live members", as seen by one
worker, and `FormedGroup`, what a matchmaker hands the networked implementation for one
attempt. The in-process implementation is `dilonode.sim.local_group.LocalGroup`; the
networked one `dilonode.allreduce.network_collective.NetworkCollective`.

A worker calls `begin(key, flat)` when its schedule says a sync starts and `wait()` on the
returned handle when the result is due; between the two, training goes on. The networked
implementation (the swarm) satisfies the same protocol, so the worker code is the same in
the simulator and in the daemon.

Bounded groups (`algo/groups.py`): with more live members than `max_group_size`, a round's
members are split into rotating groups and each group averages on its own; in the rounds
`algo.groups.mixes` picks, each group also averages its members' outer states (the
`state` callable of `begin`, `algo/mixing.py`), and `SyncKey(kind="mix")` rounds average
states only (the end of a grouped run).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol

import torch

from dilonode.algo.replay import EncodedResult

__all__ = ["Collective", "FormGroup", "FormedGroup", "PendingReduce", "ReduceResult",
           "StateSource", "SyncKey"]


@dataclass(frozen=True)
class SyncKey:
    """What is being averaged: a fragment's pseudo-gradient round, DDP gradients at a step,
    or (kind "mix", the end of a grouped run) a fragment's packed outer state alone."""

    kind: Literal["fragment", "grad", "mix"]
    fragment: int
    round: int


@dataclass
class ReduceResult:
    """The averaged tensor and what it cost this worker."""

    mean: torch.Tensor  # [numel] float32, identical on every member of the group
    group_size: int
    payload_bytes_sent: int
    payload_bytes_received: int
    dropped: tuple[str, ...] = ()  # peers excluded from the round, with the reason logged
    skipped: bool = False  # every attempt failed: `mean` is this worker's own value alone
    members: tuple[str, ...] = ()  # who averaged, in summation order (networked rounds)
    attempts: int = 1  # group formations tried (1 + retries)
    latency_s: float = 0.0  # begin to result, matchmaking and retries included (networked)
    # The round's time as the swarm's clock should see it (networked): the attempt that
    # succeeded, its matchmaking included, when forming it waited on no missing peer; None
    # when a fault made it slow (a killed peer's timeout or window) or no attempt
    # succeeded. A clock paced by those slowed 16x in a churn run.
    pace_s: float | None = None
    # Members whose contribution an owner rejected in at least one chunk (robust checks).
    rejected: tuple[str, ...] = ()
    # `mean` as the codec carried it, when the collective keeps it (joiners replay it).
    encoded: EncodedResult | None = None
    # A digest of `mean` that every member computes alike (the round digest over the
    # network, a hash of the values in process): what the fragment's chain records.
    digest: str = ""
    # Matchmaking left us out: our outer state differs from the one these peers hold.
    diverged: tuple[str, ...] = ()
    # Matchmaking left these peers out: their outer state differs from ours, which stands.
    outvoted: tuple[str, ...] = ()
    # The swarm averaged in bounded groups (more live peers than max_group_size): replicas
    # in different groups hold different states by design (algo/mixing.py).
    grouped: bool = False
    # A mixing round: the group's mean packed outer state [2 * numel] (float32, the same
    # bits on every member) and its digest; None when the round did not mix states.
    state_mean: torch.Tensor | None = None
    state_digest: str = ""


class PendingReduce(Protocol):
    def done(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> ReduceResult: ...


# Returns the caller's packed outer state of the fragment (`algo.mixing.pack_state`).
StateSource = Callable[[], torch.Tensor]


class Collective(Protocol):
    def begin(self, key: SyncKey, flat: torch.Tensor, weight: float = 1.0,
              state: StateSource | None = None) -> PendingReduce:
        """Start averaging `flat`, trained on `weight` tokens (the mean is token-weighted).
        `state` is asked only when the round also mixes outer states (grouped swarms);
        the fragment's outer state does not change while its round is in flight."""
        ...


class FormedGroup(NamedTuple):
    """A group agreed for one attempt: what `form_group` returns.

    `addrs` maps peer id -> "host:port" (a sequence aligned with `members` also works);
    `digest` is `group_digest(members)` or whatever the matchmaker agreed on.
    """

    members: Sequence[str]
    addrs: Mapping[str, str] | Sequence[str]
    weights: Sequence[float]
    my_index: int
    digest: str
    # Left out for an outer state that differs from the one that stands: its holders.
    diverged: tuple[str, ...] = ()
    # Peers we left out for an outer state that differs from ours (ours stands).
    outvoted: tuple[str, ...] = ()
    # A group of a grouped swarm: mixing rounds also average the members' outer states.
    mixing: bool = False
    # Peers expected when the round started that are not in the group (dead, or late past
    # the window): forming it waited on them, so its time says nothing of the links.
    missing: tuple[str, ...] = ()


FormGroup = Callable[[int, int, int, set[str]], FormedGroup | Awaitable[FormedGroup]]
