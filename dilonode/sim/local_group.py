"""`LocalGroup`: M workers in one process averaging through the butterfly arithmetic, the
in-process `Collective` the simulator runs its workers over."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import blake3
import torch

from dilonode.algo.butterfly import butterfly_average, round_chunk_numel
from dilonode.algo.codecs import Codec, get_codec
from dilonode.algo.groups import grouped, mixes, num_keys, partition
from dilonode.algo.robust import AggregatorSpec, aggregate
from dilonode.algo.sliced_encoding import SplicedEncoding
from dilonode.collective import ReduceResult, RoundReport, RoundRequest, StateSource, SyncKey

__all__ = ["LocalGroup"]


@dataclass
class _Slot:
    key: SyncKey
    contributions: dict[int, torch.Tensor] = field(default_factory=dict)
    tokens: dict[int, float] = field(default_factory=dict)
    states: dict[int, StateSource] = field(default_factory=dict)
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

    `max_group_size` (None: one group, whatever the count): with more live members, each
    fragment round is split into the groups `algo.groups.partition` gives (worker i is
    peer id `str(i)` of run `run_id`), as the daemon's matchmaking splits a swarm, and
    rounds `algo.groups.mixes(round, mix_every)` also average each group's outer states
    (float32, plain mean in member order: the daemon's state round).
    """

    def __init__(self, num_workers: int, codec: Codec, weights: list[float] | None = None, *,
                 aggregator: AggregatorSpec | None = None,
                 chunk_numel: int | None = None, align: int | None = None,
                 max_group_size: int | None = None, mix_every: int = 1,
                 run_id: str = "sim") -> None:
        self.codec = codec
        self.members = list(range(num_workers))
        self.weights = weights or [1.0] * num_workers
        self.aggregator = aggregator or AggregatorSpec()
        self.chunk_numel = chunk_numel
        self.align = align
        self.max_group_size = max_group_size
        self.mix_every = mix_every
        self.run_id = run_id
        self._f32 = get_codec("float32", codec.block_size)
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
                    weight: float, state: StateSource | None = None) -> _Slot:
        slot = self._slots.setdefault(key, _Slot(key))
        if worker in slot.contributions:
            raise RuntimeError(f"worker {worker} contributed twice to {key}")
        slot.contributions[worker] = self._keep(flat)
        slot.tokens[worker] = float(weight)
        if state is not None:
            slot.states[worker] = state
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

    def _keep(self, flat: torch.Tensor) -> torch.Tensor:
        """The copy of a contribution the group holds until the round reduces it."""
        return flat.detach().to("cpu", torch.float32)

    def _complete(self, slot: _Slot) -> None:
        if slot.results is None and slot.contributions and \
                set(slot.contributions) >= set(self.members) - slot.skipped:
            self._reduce(slot)

    def done(self, slot: _Slot) -> bool:
        """Whether `slot`'s result has reached its members at the current (virtual) time."""
        return slot.results is not None and (self.now is None or slot.done_at <= self.now())

    def groups(self, key: SyncKey, contributors: list[int]) -> list[list[int]] | None:
        """The groups of round `key` among `contributors`, or None for one group of all
        (at most `max_group_size` live members, DDP gradients, or no bound set)."""
        m, n = self.max_group_size, len(self.members)
        if m is None or key.kind == "grad" or not grouped(n, m):
            return None
        split = partition([str(w) for w in contributors], m, self.run_id, key.fragment,
                          key.round, keys=num_keys(n, m))
        return [sorted(int(w) for w in g) for g in split]

    def _reduce(self, slot: _Slot) -> None:
        everyone = sorted(slot.contributions)
        split = self.groups(slot.key, everyone)
        slot.results = {}
        for order in split or [everyone]:
            slot.results.update(self._average(slot, order, grouped_round=split is not None))
        slot.contributions.clear()  # bounded memory: only the means are kept
        slot.tokens.clear()
        slot.states.clear()

    def _average(self, slot: _Slot, everyone: list[int],
                 grouped_round: bool) -> dict[int, ReduceResult]:
        """One group's round: the butterfly mean of its members' contributions (and, in a
        mixing round, of their states); the results of its members."""
        if slot.key in self.orders:
            everyone = sorted(everyone, key=self.orders[slot.key].index)
        if slot.key.kind == "mix":
            return self._mix_only(slot, everyone, grouped_round)
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
                                             chunk_numel=self._chunk(contribs), align=self.align,
                                             token_weights=tokens)
        names = tuple(str(w) for w in sorted(rejected))
        digest = _digest(mean)
        state, state_digest = None, ""
        if grouped_round and mixes(slot.key.round, self.mix_every) and len(order) > 1 and \
                all(w in slot.states for w in order):
            state, s_sent, s_recv = self._mean_state(order, [slot.states[w]() for w in order])
            state_digest = _digest(state)
            sent = [a + b for a, b in zip(sent, s_sent, strict=True)]
            recv = [a + b for a, b in zip(recv, s_recv, strict=True)]
        results = {w: ReduceResult(mean, RoundReport(len(order), sent[i], recv[i],
                                                     rejected=names, grouped=grouped_round),
                                   digest=digest, state_mean=state, state_digest=state_digest)
                   for i, w in enumerate(order)}
        results.update({w: ReduceResult(mean, RoundReport(len(order), 0, 0, rejected=names,
                                                          grouped=grouped_round),
                                        digest=digest)
                        for w in refused})
        return results

    def _mean_state(self, order: list[int], states: list[torch.Tensor]
                    ) -> tuple[torch.Tensor, list[int], list[int]]:
        """The float32 butterfly mean of packed states (the daemon's state round)."""
        weights = [self.weights[w] for w in order]
        return butterfly_average([s.to("cpu", torch.float32) for s in states], weights,
                                 self._f32, chunk_numel=self._chunk(states), align=self.align)

    def _chunk(self, contributions: Sequence[torch.Tensor]) -> int | None:
        """The round's chunk size, as the daemon derives it (None: whole parts)."""
        if self.chunk_numel is None:
            return None
        return round_chunk_numel(contributions[0].numel(), len(contributions),
                                 self.chunk_numel, self.align or self.codec.block_size)

    def _mix_only(self, slot: _Slot, order: list[int],
                  grouped_round: bool) -> dict[int, ReduceResult]:
        """A `mix` round: the contributions are packed states; every member gets the mean."""
        mean, sent, recv = self._mean_state(order, [slot.contributions[w] for w in order])
        digest = _digest(mean)
        return {w: ReduceResult(mean, RoundReport(len(order), sent[i], recv[i],
                                                  grouped=grouped_round),
                                digest=digest, state_mean=mean, state_digest=digest)
                for i, w in enumerate(order)}

    def _collect(self, key: SyncKey, worker: int) -> ReduceResult:
        slot = self._slots[key]
        if slot.results is None:
            # In lockstep every member begins before anyone waits; reaching here is our bug.
            raise RuntimeError(f"LocalGroup: {key} awaited before all members contributed")
        result = slot.results.pop(worker)
        if not slot.results:
            del self._slots[key]
        return result


def _digest(values: torch.Tensor) -> str:
    return blake3.blake3(values.numpy().tobytes()).hexdigest()


class _LocalView:
    """Worker `worker`'s `Collective` on a `LocalGroup`."""

    def __init__(self, group: LocalGroup, worker: int) -> None:
        self.group = group
        self.worker = worker

    def begin(self, request: RoundRequest, flat: torch.Tensor, *,
              encoded: SplicedEncoding | None = None,
              state: StateSource | None = None) -> _LocalPending:
        """Contribute `flat` to round `request.key`, weighted by `request.weight`; the rest
        of the request is for matchmaking, which an in-process group has none of.
        `encoded` is ignored: the group encodes every contribution itself, part by part, as
        the butterfly cuts it (a node's ranks encode the same values, so the mean is the
        same)."""
        key = request.key
        slot = self.group._contribute(key, self.worker, flat, request.weight, state)
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
