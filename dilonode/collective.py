"""The `Collective` seam: "average this flat tensor with the live members", as seen by one
worker, plus `LocalGroup`, its in-process implementation used by the simulator.

A worker calls `begin(key, flat)` when its schedule says a sync starts and `wait()` on the
returned handle when the result is due; between the two, training goes on. The networked
implementation (the swarm) satisfies the same protocol, so the worker code is the same in
the simulator and in the daemon.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

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


class PendingReduce(Protocol):
    def done(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> ReduceResult: ...


class Collective(Protocol):
    def begin(self, key: SyncKey, flat: torch.Tensor) -> PendingReduce: ...


@dataclass
class _Slot:
    contributions: dict[int, torch.Tensor] = field(default_factory=dict)
    results: dict[int, ReduceResult] | None = None


class LocalGroup:
    """M workers in one process averaging through the butterfly arithmetic.

    Workers run in lockstep (every worker begins a key before anyone waits on it), so a
    result is computed when the last live member contributes. Payload bytes are those the
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

    def view(self, worker: int) -> _LocalView:
        return _LocalView(self, worker)

    def leave(self, worker: int) -> None:
        """A worker stops contributing from now on (simulated departure)."""
        self.members.remove(worker)

    def _contribute(self, key: SyncKey, worker: int, flat: torch.Tensor) -> _Slot:
        slot = self._slots.setdefault(key, _Slot())
        if worker in slot.contributions:
            raise RuntimeError(f"worker {worker} contributed twice to {key}")
        slot.contributions[worker] = flat.detach().to("cpu", torch.float32)
        if set(slot.contributions) >= set(self.members):
            self._reduce(slot)
        return slot

    def _reduce(self, slot: _Slot) -> None:
        everyone = sorted(slot.contributions)
        # The daemon's round refuses a NaN/Inf payload and retries without its sender (the
        # codecs cannot even encode one); leaving the sender out here is that retry.
        refused = {w for w in everyone if not bool(torch.isfinite(slot.contributions[w]).all())}
        order = [w for w in everyone if w not in refused]
        if not order:
            raise ValueError("LocalGroup: every contribution holds NaN/Inf")
        contribs = [slot.contributions[w] for w in order]
        weights = [self.weights[w] for w in order]
        rejected = set(refused)

        def reduce(chunks: list[torch.Tensor]) -> torch.Tensor:
            out = aggregate(chunks, self.aggregator, assume_finite=True)  # refused above
            rejected.update(order[i] for i in out.rejected)
            return out.value

        mean, sent, recv = butterfly_average(contribs, weights, self.codec, reduce=reduce,
                                             chunk_numel=self.chunk_numel, align=self.align)
        names = tuple(str(w) for w in sorted(rejected))
        slot.results = {w: ReduceResult(mean, len(order), sent[i], recv[i], rejected=names)
                        for i, w in enumerate(order)}
        slot.results.update({w: ReduceResult(mean, len(order), 0, 0, rejected=names)
                             for w in refused})
        slot.contributions.clear()  # bounded memory: only the mean is kept

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

    def begin(self, key: SyncKey, flat: torch.Tensor) -> _LocalPending:
        slot = self.group._contribute(key, self.worker, flat)
        return _LocalPending(self.group, slot, key, self.worker)


class _LocalPending:
    def __init__(self, group: LocalGroup, slot: _Slot, key: SyncKey, worker: int) -> None:
        self.group, self.slot, self.key, self.worker = group, slot, key, worker
        self._result: ReduceResult | None = None

    def done(self) -> bool:
        return self.slot.results is not None

    def wait(self, timeout: float | None = None) -> ReduceResult:
        if self._result is None:
            self._result = self.group._collect(self.key, self.worker)
        return self._result
