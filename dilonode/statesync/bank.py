"""`ChunkBank`: the chunks of outer state a joiner holds, each at the version of its fragment
it was fetched (or held) at, kept across the passes of one recovery; and `Derivation`:
bringing those chunks forward to the target's version by replaying the rounds since from
their encoded results, so a round that lands mid-fetch costs its result's bytes (int4: a
fourteenth of the fragment's state) rather than the chunks already fetched.

The outer step is elementwise: chunk i of a fragment's momentum after a round needs only
chunk i of its momentum before it and the round's result; chunk i of its weights needs both
(Nesterov). A joiner on a slow link, fetching weights and momentum chunk by chunk while
rounds keep landing, ends up holding pairs of many versions. Replaying every round from
the oldest version used, on the whole fragment (the members' arithmetic, bit for bit;
positions not held are zeros and not used), brings each of them to the target; a chunk so
derived is kept only if it hashes to the target's digest. No I/O here.

A derivation keeps its progress in the bank (`Progress`): the fetch replays each round as
soon as its result is held (`Derivation.advance`, while the rest of the transfer goes on),
and a round that lands mid-fetch adds a round to the next pass's derivation rather than
starting it again. What is left when the transfer ends is the rounds whose results came
last: a joiner on a slow link otherwise replayed every round after its last chunk arrived,
with its peers already waiting for it in their next round.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from dilonode.algo.replay import EncodedResult, kept_rounds, replay_budget
from dilonode.statesync.plan import Assembler, Replayer, chunk_bytes_of, chunk_digest
from dilonode.statesync.protocol import RoundReplay
from dilonode.train.state import WorkerState, fragment_names, tensor_names

__all__ = ["ChunkBank", "Derivation", "Progress", "Version"]

Version = tuple[int, int]  # a fragment's (rounds landed, outer steps applied)
Position = tuple[str, int]  # (tensor name, chunk index)


@dataclass(frozen=True)
class Held:
    """One chunk held: the version of its fragment it belongs to, its digest, its bytes."""

    version: Version
    digest: bytes
    payload: bytes | memoryview


def _fragment(name: str) -> int:
    return int(name.split(".")[1])  # outer.{p}.weights / outer.{p}.momentum


class ChunkBank:
    """Chunks held per position, the newest version of each; result chunks by digest."""

    def __init__(self, chunk_bytes: int) -> None:
        self.cb = chunk_bytes
        self.held: dict[Position, Held] = {}
        self.results: dict[bytes, bytes] = {}  # result chunk digest -> payload
        # (fragment, round) -> that round's result as a manifest listed it, kept across
        # targets: a result fetched stays usable after the servers stop serving it.
        self.specs: dict[tuple[int, int], RoundReplay] = {}
        self.lowest: dict[int, int] = {}  # fragment -> the oldest version still planned from
        self.progress: dict[int, Progress] = {}  # fragment -> its derivation's replay so far

    def record(self, position: Position, version: Version, digest: bytes,
               payload: bytes | memoryview) -> None:
        cur = self.held.get(position)
        if cur is None or cur.version[0] <= version[0]:
            self.held[position] = Held(version, digest, payload)

    def record_state(self, state: WorkerState, digests: dict[str, list[bytes]]) -> None:
        """Every chunk of `state` (`digests`: its chunk digests per tensor), at its counters."""
        for name in tensor_names(state.num_fragments):
            p, t = _fragment(name), state.tensors[name]
            version = (state.rounds[p], state.outer_steps[p])
            for i, d in enumerate(digests[name]):
                self.record((name, i), version, d, chunk_bytes_of(t, i, self.cb))

    def record_fetched(self, asm: Assembler, digest: bytes,
                       payload: bytes | memoryview) -> None:
        """A verified chunk of `asm`'s target, at every position of it that holds it."""
        m = asm.manifest
        for name, i in asm.positions(digest):
            p = _fragment(name)
            self.record((name, i), (m.rounds[p], m.outer_steps[p]), digest, payload)

    def put_result(self, digest: bytes, payload: bytes | memoryview) -> None:
        self.results[digest] = bytes(payload)

    def fill(self, asm: Assembler) -> int:
        """Put into `asm` every held chunk that is the target's at its position; returns
        the bytes filled."""
        filled = 0
        for (name, i), h in self.held.items():
            if not asm.filled(h.digest) and asm.digest_at(name, i) == h.digest:
                asm.put(h.digest, h.payload)
                filled += len(h.payload) * len(asm.positions(h.digest))
        return filled

    def plan(self, asm: Assembler, keep_rounds: int = 16, rate: float | None = None,
             rounds_per_s: float = 0.0) -> list[Derivation]:
        """Per fragment of `asm`'s target, the derivation that saves the most bytes (the
        chunks it yields that `asm` still lacks, less the result bytes not yet held), if
        any saves some.

        A derivation needs every round's result from its start on. Results fetched for an
        earlier target stay usable (with the manifest entry that listed them); the others
        must be fetched, and servers keep only the last `keep_rounds` (their
        statesync.replay_rounds, capped at the fragment's state bytes: `kept_rounds`).
        They are fetched first, oldest first, at `rate` bytes/s, while a fragment lands
        `rounds_per_s` rounds a second, each pushing the oldest result out: a start whose
        oldest result not held would be gone by then is not planned, then or later (a plan
        flipping between deriving and fetching as the rates move would waste what each
        fetched). Results a derivation needs beyond twice the fragment's state bytes are
        not worth holding (the state itself costs half of that), so no start needs more."""
        for r in asm.manifest.replays:
            self.specs[(r.fragment, r.round)] = r
        jobs = [job for p in range(len(asm.manifest.rounds))
                if (job := self._plan_fragment(asm, p, keep_rounds, rate, rounds_per_s))
                is not None]
        self._forget(asm)
        planned = {job.fragment: job for job in jobs}
        self.progress = {p: got for p, got in self.progress.items()
                         if p in planned and got.continues(planned[p])}
        return jobs

    def _forget(self, asm: Assembler) -> None:
        """Drop the results (and their entries) of rounds before every version still
        planned from: no derivation can use them."""
        m = asm.manifest
        oldest = {p: m.rounds[p] for p in range(len(m.rounds))}
        for (name, _), h in self.held.items():
            p = _fragment(name)
            if p in oldest and h.version[0] >= self.lowest.get(p, 0):
                oldest[p] = min(oldest[p], h.version[0])
        self.specs = {(p, r): spec for (p, r), spec in self.specs.items()
                      if r >= oldest.get(p, r)}
        listed = {d for spec in self.specs.values() for d in spec.chunks}
        self.results = {d: b for d, b in self.results.items() if d in listed}

    def _plan_fragment(self, asm: Assembler, p: int, keep_rounds: int, rate: float | None,
                       rounds_per_s: float) -> Derivation | None:
        m = asm.manifest
        last, steps = m.rounds[p], m.outer_steps[p]
        specs = {r: spec for (f, r), spec in self.specs.items() if f == p}
        served = m.replays_of(p)
        numel = m.tensors[2 * p].numel
        if not specs:
            return None
        span = kept_rounds(keep_rounds, numel, max(r.nbytes for r in served.values())) \
            if served else 0
        lowest = self.lowest.setdefault(p, 0)

        def held(j: int) -> bool:
            return all(d in self.results for d in specs[j].chunks)

        def cost(start: int) -> int:
            """Bytes of the results from `start` on not held yet."""
            return sum(specs[j].nbytes for j in range(start, last) if not held(j))

        def in_time(start: int) -> bool:
            todo = [j for j in range(start, last) if not held(j)]
            if not todo:
                return True
            if any(j not in served for j in todo):
                return False
            landing = math.floor(cost(start) / rate * rounds_per_s) if rate else 0
            return last - todo[0] + landing <= span

        # Versions the rounds known reach the target from, within twice the state's bytes
        # of results (one per version held, not per chunk).
        reach = {k: all(j in specs for j in range(k, last)) and
                 sum(specs[j].nbytes for j in range(k, last)) <= 2 * replay_budget(numel)
                 for k in {h.version[0] for h in self.held.values()} if lowest <= k < last}

        def usable(name: str) -> dict[int, Held]:
            """Chunks of `name` that the rounds known can bring to the target's version."""
            out = {}
            for i in range(len(asm.digests(name))):
                h = self.held.get((name, i))
                if h is None:
                    continue
                k, k_steps = h.version
                if reach.get(k, False) and k_steps == steps - (last - k):
                    out[i] = h
            return out

        w_name, m_name = fragment_names(p)
        kw, km = usable(w_name), usable(m_name)

        def missing(name: str, i: int) -> int:
            return 0 if asm.filled(asm.digest_at(name, i)) else \
                min(self.cb, numel * 4 - i * self.cb)

        best: tuple[int, int, dict[Position, Held]] | None = None
        for start in sorted({h.version[0] for h in (*kw.values(), *km.values())}):
            if not in_time(start):
                self.lowest[p] = max(self.lowest[p], start + 1)
                continue
            mom = {i: h for i, h in km.items() if h.version[0] >= start}
            wts = {i: h for i, h in kw.items() if i in mom
                   and mom[i].version[0] <= h.version[0]}
            saved = sum(missing(m_name, i) for i in mom) + sum(missing(w_name, i) for i in wts)
            spent = cost(start)
            if saved > spent and (best is None or saved - spent > best[0]):
                used = {**{(w_name, i): h for i, h in wts.items()},
                        **{(m_name, i): h for i, h in mom.items()}}
                best = (saved - spent, start, used)
        if best is None:
            return None
        _, start, used = best
        return Derivation(p, tuple(specs[j] for j in range(start, last)), used)


@dataclass
class Progress:
    """A derivation's replay so far: its fragment after the rounds `done` (round number
    and result chunks each) from `start` on, the chunks `used` (position, version, digest)
    written in as their rounds came; `error` once a round failed to replay."""

    start: int
    used: tuple[tuple[Position, Version, bytes], ...]
    done: list[tuple[int, tuple[bytes, ...]]]
    weights: torch.Tensor
    momentum: torch.Tensor
    valid: dict[str, set[int]]  # chunk indices per tensor that the replay brought forward
    error: str = ""

    def continues(self, job: Derivation) -> bool:
        """Whether `job` is this replay with as many rounds or more (a later target)."""
        return (self.start == job.start and self.used == job.used_key
                and len(self.done) <= len(job.rounds)
                and all(d == (r.round, tuple(r.chunks))
                        for d, r in zip(self.done, job.rounds, strict=False)))


@dataclass
class Derivation:
    """Fragment `fragment` of a target brought forward from the chunks `used` (held at
    versions from `rounds[0].round` on) by replaying `rounds` (through the target's)."""

    fragment: int
    rounds: tuple[RoundReplay, ...]
    used: dict[Position, Held]
    late: int = 0  # rounds `run` replayed itself (the others while the fetch went on)

    @property
    def start(self) -> int:
        return self.rounds[0].round

    @property
    def result_bytes(self) -> int:
        return sum(r.nbytes for r in self.rounds)

    def wants(self, bank: ChunkBank) -> list[bytes]:
        """Result chunks not in `bank` yet, in round order, each once."""
        return list(dict.fromkeys(d for r in self.rounds for d in r.chunks
                                  if d not in bank.results))

    @functools.cached_property
    def used_key(self) -> tuple[tuple[Position, Version, bytes], ...]:
        """The chunks used, comparable across passes (a progress continues only on them)."""
        return tuple(sorted((pos, h.version, h.digest) for pos, h in self.used.items()))

    def progress(self, bank: ChunkBank, numel: int) -> Progress:
        """The replay so far kept in `bank`, or a fresh one (zeros: positions not held are
        never used)."""
        got = bank.progress.get(self.fragment)
        if got is not None and got.continues(self):
            return got
        w_name, m_name = fragment_names(self.fragment)
        weights = torch.zeros(numel, dtype=torch.float32)
        got = Progress(self.start, self.used_key, [], weights, torch.zeros_like(weights),
                       {w_name: set(), m_name: set()})
        bank.progress[self.fragment] = got
        return got

    def ready(self, bank: ChunkBank) -> bool:
        """Whether the next round to replay has its whole result held."""
        got = bank.progress.get(self.fragment)
        k = len(got.done) if got is not None and got.continues(self) else 0
        return k < len(self.rounds) and (got is None or not got.error) and \
            all(d in bank.results for d in self.rounds[k].chunks)

    def advance(self, bank: ChunkBank, asm: Assembler, replayer: Replayer) -> int:
        """Replay, in order, the rounds not replayed yet whose results are held; returns
        how many it replayed. A round that fails sets the progress's `error`."""
        w_name, m_name = fragment_names(self.fragment)
        got = self.progress(bank, asm.tensors[w_name].numel())
        at_round: dict[int, list[tuple[Position, Held]]] = defaultdict(list)
        for pos, h in self.used.items():
            at_round[h.version[0]].append((pos, h))
        replayed = 0
        while not got.error and len(got.done) < len(self.rounds):
            spec = self.rounds[len(got.done)]
            if any(d not in bank.results for d in spec.chunks):
                break
            try:
                for (name, i), h in at_round[spec.round]:
                    _write(got.weights if name == w_name else got.momentum, i, bank.cb,
                           h.payload)
                    got.valid[name].add(i)
                result = EncodedResult.from_blob(spec.codec, spec.block_size, spec.numels,
                                                 b"".join(bank.results[d]
                                                          for d in spec.chunks))
                got.weights, got.momentum = replayer(self.fragment, spec.round, got.weights,
                                                     got.momentum, result)
            except (ValueError, RuntimeError) as exc:  # codec errors, non-finite, sizes
                got.error = f"{type(exc).__name__}: {exc}"
                break
            got.valid[w_name] &= got.valid[m_name]  # the weights' step reads the momentum
            got.done.append((spec.round, tuple(spec.chunks)))
            replayed += 1
        return replayed

    def run(self, bank: ChunkBank, asm: Assembler, replayer: Replayer) -> tuple[int, str]:
        """Replay the rounds not replayed yet and fill `asm` with every chunk derived that
        hashes to the target's digest; returns (bytes filled, why not every chunk used gave
        one: '' if it did). A failure leaves `asm` as it was."""
        if wanted := self.wants(bank):
            return 0, f"{len(wanted)} result chunk(s) never arrived"
        w_name, m_name = fragment_names(self.fragment)
        self.late = self.advance(bank, asm, replayer)
        got = bank.progress[self.fragment]
        if got.error:
            del bank.progress[self.fragment]
            return 0, got.error
        filled, wrong = 0, 0
        for name, t in ((w_name, got.weights), (m_name, got.momentum)):
            for i in sorted(got.valid[name]):
                target = asm.digest_at(name, i)
                if asm.filled(target):
                    continue
                chunk = chunk_bytes_of(t, i, asm.cb)
                if chunk_digest(chunk) != target:
                    wrong += 1
                    continue
                asm.put(target, chunk)
                filled += len(chunk)
        why = f"{wrong} chunk(s) came out different from the peers' (digests differ)" \
            if wrong else ""
        return filled, why


def _write(t: torch.Tensor, index: int, chunk_bytes: int, payload: bytes | memoryview) -> None:
    dst = t.view(torch.uint8)[index * chunk_bytes:(index + 1) * chunk_bytes].numpy()
    src = np.frombuffer(payload, dtype=np.uint8)
    if dst.size != src.size:
        raise ValueError(f"a held chunk {index} is {src.size} bytes, the fragment's needs "
                         f"{dst.size}")
    dst[...] = src
