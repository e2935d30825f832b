"""The `Collective` seam: "average this flat tensor with the live members", as seen by one
worker, plus `LocalGroup`, its in-process implementation used by the simulator.

A worker calls `begin(key, flat)` when its schedule says a sync starts and `wait()` on the
returned handle when the result is due; between the two, training goes on. The networked
implementation (the swarm) satisfies the same protocol, so the worker code is the same in
the simulator and in the daemon.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

import blake3
import torch

from dilonode.algo.butterfly import butterfly_average
from dilonode.algo.codecs import Codec
from dilonode.algo.replay import EncodedResult
from dilonode.algo.robust import AggregatorSpec, aggregate

__all__ = ["Collective", "LocalGroup", "PendingReduce", "ReduceResult", "SyncKey"]


@dataclass(frozen=True)
class SyncKey:
    """What is being averaged: a fragment's pseudo-gradient round, or DDP gradients at a step."""

    kind: Literal["fragment", "grad"]
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


class PendingReduce(Protocol):
    def done(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> ReduceResult: ...


class Collective(Protocol):
    def begin(self, key: SyncKey, flat: torch.Tensor, weight: float = 1.0) -> PendingReduce:
        """Start averaging `flat`, trained on `weight` tokens (the mean is token-weighted)."""
        ...


@dataclass
class _Slot:
    key: SyncKey
    contributions: dict[int, torch.Tensor] = field(default_factory=dict)
    tokens: dict[int, float] = field(default_factory=dict)
    results: dict[int, ReduceResult] | None = None
    skipped: set[int] = field(default_factory=set)  # members that started a later round
    done_at: float = 0.0  # virtual time the result reaches the members (`LocalGroup.now`)


class LocalGroup:
    """M workers in one process averaging through the butterfly arithmetic.

    A result is computed when the last live member contributes; a member that begins a
    later round of the same fragment without having begun this one will never contribute
    to it (its pacer skipped it) and is not waited for. Drivers either run workers in
    lockstep (every worker begins a key before anyone waits on it) or on a virtual clock
    (`now`: the current worker's time; a result is `done` from the time its last
    contribution came in plus `latency`). Payload bytes are those the
    networked butterfly would carry: codec output, scales included, framing excluded.
    Owners combine each chunk of `chunk_numel` values with `aggregator` (checks included),
    as the networked round does; parts are aligned to `align` (default: the codec's block),
    which must be the daemon's block size for the two to cut the same chunks.
    """

    def __init__(self, num_workers: int, codec: Codec, weights: list[float] | None = None, *,
                 aggregator: AggregatorSpec | None = None,
                 chunk_numel: int | None = None, align: int | None = None) -> None:
        self.codec = codec
        self.members = list(range(num_workers))
        self.weights = weights or [1.0] * num_workers
        self.aggregator = aggregator or AggregatorSpec()
        self.chunk_numel = chunk_numel
        self.align = align
        self._slots: dict[SyncKey, _Slot] = {}
        self.now: Callable[[], float] | None = None  # virtual clock (None: lockstep)
        self.latency = 0.0  # virtual seconds from the last contribution to the result
        # (worker, kind, fragment) -> the newest round it began: earlier ones it skipped.
        self._newest: dict[tuple[int, str, int], int] = {}
        # key -> the workers in summation order, where a replay knows the networked round's
        # (its members in their order); otherwise worker order.
        self.orders: dict[SyncKey, list[int]] = {}

    def view(self, worker: int) -> _LocalView:
        return _LocalView(self, worker)

    def leave(self, worker: int) -> None:
        """A worker stops contributing from now on (simulated departure)."""
        self.members.remove(worker)
        for slot in list(self._slots.values()):
            self._complete(slot)

    def _contribute(self, key: SyncKey, worker: int, flat: torch.Tensor,
                    weight: float) -> _Slot:
        slot = self._slots.setdefault(key, _Slot(key))
        if worker in slot.contributions:
            raise RuntimeError(f"worker {worker} contributed twice to {key}")
        slot.contributions[worker] = flat.detach().to("cpu", torch.float32)
        slot.tokens[worker] = float(weight)
        if self.now is not None:
            slot.done_at = max(slot.done_at, self.now() + self.latency)
        self._newest[(worker, key.kind, key.fragment)] = key.round
        self._complete(slot)
        for other_key, other in list(self._slots.items()):
            if (other_key.kind, other_key.fragment) == (key.kind, key.fragment) and \
                    other_key.round < key.round and worker not in other.contributions:
                other.skipped.add(worker)
                self._complete(other)
        return slot

    def _complete(self, slot: _Slot) -> None:
        if slot.results is None and slot.contributions and \
                set(slot.contributions) >= set(self.members) - slot.skipped:
            self._reduce(slot)

    def done(self, slot: _Slot) -> bool:
        """Whether `slot`'s result has reached its members at the current (virtual) time."""
        return slot.results is not None and (self.now is None or slot.done_at <= self.now())

    def _reduce(self, slot: _Slot) -> None:
        everyone = sorted(slot.contributions)
        if slot.key in self.orders:
            everyone = sorted(everyone, key=self.orders[slot.key].index)
        # The daemon's round refuses a NaN/Inf payload and retries without its sender (the
        # codecs cannot even encode one); leaving the sender out here is that retry.
        refused = {w for w in everyone if not bool(torch.isfinite(slot.contributions[w]).all())}
        order = [w for w in everyone if w not in refused]
        if not order:
            raise ValueError("LocalGroup: every contribution holds NaN/Inf")
        contribs = [slot.contributions[w] for w in order]
        weights = [self.weights[w] for w in order]
        tokens = [slot.tokens[w] for w in order]
        rejected = set(refused)

        def reduce(chunks: list[torch.Tensor], tokens: list[float]) -> torch.Tensor:
            out = aggregate(chunks, self.aggregator, weights=tokens,
                            assume_finite=True)  # refused above
            rejected.update(order[i] for i in out.rejected)
            return out.value

        mean, sent, recv = butterfly_average(contribs, weights, self.codec, reduce=reduce,
                                             chunk_numel=self.chunk_numel, align=self.align,
                                             token_weights=tokens)
        names = tuple(str(w) for w in sorted(rejected))
        digest = blake3.blake3(mean.numpy().tobytes()).hexdigest()
        slot.results = {w: ReduceResult(mean, len(order), sent[i], recv[i], rejected=names,
                                        digest=digest)
                        for i, w in enumerate(order)}
        slot.results.update({w: ReduceResult(mean, len(order), 0, 0, rejected=names,
                                             digest=digest)
                             for w in refused})
        slot.contributions.clear()  # bounded memory: only the mean is kept
        slot.tokens.clear()

    def _collect(self, key: SyncKey, worker: int) -> ReduceResult:
        slot = self._slots[key]
        if slot.results is None:
            # In lockstep every member begins before anyone waits; reaching here is our bug.
            raise RuntimeError(f"LocalGroup: {key} awaited before all members contributed")
        result = slot.results.pop(worker)
        if not slot.results:
            del self._slots[key]
        return result


class _LocalView:
    def __init__(self, group: LocalGroup, worker: int) -> None:
        self.group = group
        self.worker = worker

    def begin(self, key: SyncKey, flat: torch.Tensor, weight: float = 1.0) -> _LocalPending:
        slot = self.group._contribute(key, self.worker, flat, weight)
        return _LocalPending(self.group, slot, key, self.worker)


class _LocalPending:
    def __init__(self, group: LocalGroup, slot: _Slot, key: SyncKey, worker: int) -> None:
        self.group, self.slot, self.key, self.worker = group, slot, key, worker
        self._result: ReduceResult | None = None

    def done(self) -> bool:
        return self.group.done(self.slot)

    def done_at(self) -> float | None:
        """Virtual time the result arrives (None while members have yet to contribute)."""
        return self.slot.done_at if self.slot.results is not None else None

    def wait(self, timeout: float | None = None) -> ReduceResult:
        if self._result is None:
            self._result = self.group._collect(self.key, self.worker)
        return self._result
