"""The `Collective` seam: "average this flat tensor with the live members", as seen by one
worker, and what a networked implementation asks its matchmaker for one attempt
(`GroupRequest` in, `FormedGroup` out). The in-process implementation is
`dilonode.sim.local_group.LocalGroup`; the networked one
`dilonode.allreduce.network_collective.NetworkCollective`.

A worker calls `begin(request, flat)` when its schedule says a sync starts and `wait()` on
the returned handle when the result is due; between the two, training goes on. The
`RoundRequest` carries what the round needs beyond the values: the key, the token weight,
and what matchmaking compares (the fragment's chain, the tokens trained, where the round
starts on the swarm clock), down to the group former: nothing below the worker asks the
worker back. Every implementation satisfies the same protocol, so the worker code is the
same in the simulator and in the daemon.

`wait()` gives a `ReduceResult`: what the worker applies (the mean, its digest, the encoded
result joiners replay, a mixing round's mean state) and a `RoundReport` of how the round
went (group, bytes, attempts, times), which the worker and the status only count.

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
from dilonode.algo.sliced_encoding import SplicedEncoding

# SplicedEncoding is named here too: `begin` takes one, and packages that may not import
# algo (status) wrap `begin`.
__all__ = ["Collective", "FormGroup", "FormedGroup", "GroupNotFormed", "GroupRequest",
           "PendingReduce", "ReduceResult", "RoundReport", "RoundRequest", "SplicedEncoding",
           "StateSource", "SyncKey"]


@dataclass(frozen=True)
class SyncKey:
    """What is being averaged: a fragment's pseudo-gradient round, DDP gradients at a step,
    or (kind "mix", the end of a grouped run) a fragment's packed outer state alone."""

    kind: Literal["fragment", "grad", "mix"]
    fragment: int
    round: int


@dataclass(frozen=True)
class RoundRequest:
    """One round a worker asks for: which, its weight, and what matchmaking compares."""

    key: SyncKey
    """The round: a fragment's, DDP gradients', or an end-of-run mixing round."""
    weight: float = 1.0
    """Tokens the contribution was trained on: the mean is token-weighted."""
    chain: str = ""
    """The chain of the fragment's outer state (`algo/chain.py`), which cannot move while
    the round is in flight: matchmaking groups only nodes holding the same state. Empty
    when there is none (DDP gradients)."""
    tokens: int = 0
    """Tokens the worker had trained in all when the round began: who stands when nodes
    hold different states (most holders, then most tokens)."""
    start: float | None = None
    """Where the round starts on the swarm clock (reference steps), or None when rounds
    are not paced by it: compared with joiners' first rounds (`PeerRecord.joins_from`)."""


@dataclass(frozen=True)
class RoundReport:
    """How one round went for this worker: counted and shown, never applied."""

    group_size: int
    """Members whose contributions the mean holds (1: this worker alone)."""
    payload_bytes_sent: int
    """Codec output this worker sent (scales included, framing excluded), state round
    included."""
    payload_bytes_received: int
    """Codec output this worker received, as `payload_bytes_sent` counts it."""
    members: tuple[str, ...] = ()
    """Who averaged, in summation order (networked rounds)."""
    dropped: tuple[str, ...] = ()
    """"peer: reason" for each peer a retry excluded from the round."""
    skipped: bool = False
    """Every attempt failed: the mean is this worker's own value alone."""
    attempts: int = 1
    """Group formations tried (1 + retries)."""
    latency_s: float = 0.0
    """Seconds from `begin` to the result, matchmaking and retries included (networked)."""
    forming_s: float = 0.0
    """The part of `latency_s` spent forming groups (matchmaking, every attempt); the rest
    is the all-reduce and its retries."""
    pace_s: float | None = None
    """The round's time as the swarm's clock should see it (networked): the attempt that
    succeeded, its matchmaking included, when forming it waited on no missing peer; None
    when a fault made it slow (a killed peer's timeout or window) or no attempt succeeded.
    A clock paced by those slowed 16x in a churn run."""
    rejected: tuple[str, ...] = ()
    """Members whose contribution an owner rejected in at least one chunk (robust checks)."""
    diverged: tuple[str, ...] = ()
    """Matchmaking left us out: our outer state differs from the one these peers hold."""
    outvoted: tuple[str, ...] = ()
    """Matchmaking left these peers out: their outer state differs from ours, which stands."""
    grouped: bool = False
    """The swarm averaged in bounded groups (more live peers than max_group_size): replicas
    in different groups hold different states by design (`algo/mixing.py`)."""


@dataclass(frozen=True)
class ReduceResult:
    """What a worker applies when a round lands, and the report of how it went."""

    mean: torch.Tensor
    """[numel] float32, identical on every member of the group (a "mix" round: the mean
    packed outer state)."""
    report: RoundReport
    """How the round went (group, bytes, attempts, times)."""
    digest: str = ""
    """A digest of `mean` that every member computes alike (the round digest over the
    network, a hash of the values in process): what the fragment's chain records. Empty
    when the implementation computes none (the worker hashes the values then)."""
    encoded: EncodedResult | None = None
    """`mean` as the codec carried it, when the collective keeps it (joiners replay it)."""
    state_mean: torch.Tensor | None = None
    """A mixing round's mean packed outer state [2 * numel] (float32, the same bits on
    every member); None when the round did not mix states."""
    state_digest: str = ""
    """The digest of `state_mean` ("" without one)."""


class PendingReduce(Protocol):
    def done(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> ReduceResult: ...


# Returns the caller's packed outer state of the fragment (`algo.mixing.pack_state`).
StateSource = Callable[[], torch.Tensor]


class Collective(Protocol):
    def begin(self, request: RoundRequest, flat: torch.Tensor, *,
              encoded: SplicedEncoding | None = None,
              state: StateSource | None = None) -> PendingReduce:
        """Start averaging `flat` (1-D), trained on `request.weight` tokens (the mean is
        token-weighted). `encoded`: `flat` as a node's ranks already encoded it with the
        round's codec, slice by slice (the same values; an implementation that encodes
        itself ignores it and says so). `state` is asked only when the round also mixes
        outer states (grouped swarms); the fragment's outer state does not change while
        its round is in flight."""
        ...


@dataclass(frozen=True)
class GroupRequest:
    """What one attempt of a networked round asks the group former (`FormGroup`)."""

    fragment: int
    """The fragment index on the wire (DDP gradients: the reserved `GRAD_FRAGMENT`)."""
    round: int
    """The round number."""
    attempt: int
    """0 for a round's first attempt, then 1, 2, ... for its retries."""
    exclude: frozenset[str] = frozenset()
    """Peers this attempt must leave out: blamed by earlier attempts, or banned."""
    chain: str = ""
    """As `RoundRequest.chain`."""
    tokens: int = 0
    """As `RoundRequest.tokens`."""
    start: float | None = None
    """As `RoundRequest.start`."""


class GroupNotFormed(RuntimeError):
    """An attempt found no group. `blame` names the peer that should have closed the group
    and did not, if any: the next attempt leaves it out."""

    def __init__(self, message: str, blame: str | None = None) -> None:
        super().__init__(message)
        self.blame = blame


class FormedGroup(NamedTuple):
    """A group agreed for one attempt: what `FormGroup` returns.

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
    # Peers whose records, as read for this group, say they cannot be dialled (behind a
    # NAT): the data plane streams to them from now on. None: the former does not say.
    stream_only: frozenset[str] | None = None


FormGroup = Callable[[GroupRequest], FormedGroup | Awaitable[FormedGroup]]
"""Forms a group for one attempt; raises when it finds none (`GroupNotFormed` to blame a
peer)."""
