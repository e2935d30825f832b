"""The sans-network half of state sync: chunking and hashing a state, choosing which peers'
manifest to trust, scheduling chunk requests over several peers, and assembling the result.

* `manifest_of(state, ...)` cuts every tensor of a `WorkerState` into `chunk_bytes` pieces and
  lists their BLAKE3-256 digests (`digests_of` reuses the digests of tensors seen before;
  BLAKE3 hashes ~5x faster than sha256 here, which a joiner waits for on its first manifest).
* `choose_target(manifests)` groups the peers' manifests by content; a state that more than
  one peer agrees on wins over a newer one held by a single peer (it may have just applied a
  round the others are about to apply, or diverged), then the most rounds, then most peers.
* `FetchPlan` hands out the chunks still missing, each to a peer that advertised it, with a
  window per peer; a failed or dropped peer's chunks go back to the queue for the others.
* `Assembler` holds the target tensors, fills them from chunks we already have (our own state,
  or an earlier pass) and from verified payloads, and yields the new `WorkerState`.
* Chunks fetched at an older version of their fragment are brought forward by replaying
  the rounds since (`bank.py`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import blake3
import numpy as np
import torch

from dilonode.algo.replay import Replayer
from dilonode.statesync.protocol import Manifest, RoundReplay, TensorChunks, replay_name
from dilonode.train.state import WorkerState, tensor_names
from dilonode.wire.errors import RemoteProtocolError

__all__ = ["Assembler", "FetchPlan", "Replayer", "Target", "choose_target", "chunk_bytes_of",
           "chunk_digest", "digests_of", "fetch_order", "manifest_of"]



def _bytes_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    raw: np.ndarray = t.contiguous().view(torch.uint8).numpy()
    return memoryview(raw.data).cast("B")


def chunk_bytes_of(t: torch.Tensor, index: int, chunk_bytes: int) -> memoryview:
    raw = _bytes_view(t)
    return raw[index * chunk_bytes:(index + 1) * chunk_bytes]


def chunk_digest(payload: bytes | memoryview) -> bytes:
    """The 32-byte BLAKE3 hash that names a chunk (protocol/README.md section 11)."""
    return blake3.blake3(payload).digest()


def _digests(raw: bytes | memoryview, chunk_bytes: int) -> list[bytes]:
    return [chunk_digest(raw[i:i + chunk_bytes]) for i in range(0, len(raw), chunk_bytes)]


def digests_of(t: torch.Tensor, chunk_bytes: int) -> list[bytes]:
    """The digest of each chunk of `t` (float32, CPU, flat)."""
    return _digests(_bytes_view(t), chunk_bytes)


def manifest_of(state: WorkerState, run_id: str, config_digest: str, chunk_bytes: int,
                cache: dict[str, tuple[object, list[bytes]]] | None = None) -> Manifest:
    """The manifest of `state`; `cache` (name -> (tensor or replay, digests)) skips
    re-hashing what is the very same object as last time (fragments with no round since)."""
    def hashed(name: str, obj: object, raw: Callable[[], bytes | memoryview]) -> list[bytes]:
        hit = cache.get(name) if cache is not None else None
        digests = hit[1] if hit is not None and hit[0] is obj else _digests(raw(), chunk_bytes)
        if cache is not None:
            cache[name] = (obj, digests)
        return digests

    entries = []
    for name in tensor_names(state.num_fragments):
        t = state.tensors[name]
        entries.append(TensorChunks(name=name, numel=t.numel(),
                                    chunks=hashed(name, t, lambda t=t: _bytes_view(t))))
    empty = {p for p, kept in state.replays.items() if not all(enc.nbytes for enc in kept)}
    replays = [RoundReplay(fragment=p, round=r, codec=enc.codec, block_size=enc.block_size,
                           numels=list(enc.numels), nbytes=enc.nbytes,
                           chunks=hashed(replay_name(p, r), enc, enc.blob))
               for p, r, enc in state.replay_rounds() if p not in empty]
    if cache is not None:  # results no longer kept: forget their digests too
        listed = {replay_name(r.fragment, r.round) for r in replays}
        for name in [n for n in cache if n.startswith("replay.") and n not in listed]:
            del cache[name]
    return Manifest(run_id=run_id, config_digest=config_digest, step=state.step,
                    current_step=state.step if state.taken_at is None else state.taken_at,
                    rounds=list(state.rounds), outer_steps=list(state.outer_steps),
                    chunk_bytes=chunk_bytes, tensors=entries, replays=replays,
                    chains=list(state.chains))


@dataclass(frozen=True)
class Target:
    """The state to fetch, the peers whose manifest is exactly it, and its newest step."""

    manifest: Manifest
    supporters: tuple[str, ...]

    @property
    def step(self) -> int:
        return self.manifest.step


def choose_target(manifests: dict[str, Manifest]) -> Target | None:
    """Pick the state to adopt among peers' manifests (see the module docstring)."""
    groups: dict[tuple, list[str]] = {}
    for peer, m in sorted(manifests.items()):
        groups.setdefault(m.content_key(), []).append(peer)
    if not groups:
        return None
    agreed = any(len(peers) > 1 for peers in groups.values())

    def rank(item: tuple[tuple, list[str]]) -> tuple[int, int, int]:
        key, peers = item
        return (int(len(peers) > 1 or not agreed), sum(key[0]), len(peers))

    _, peers = max(groups.items(), key=rank)
    newest = max(peers, key=lambda p: manifests[p].step)  # same content, freshest step
    return Target(manifests[newest], tuple(peers))


def fetch_order(manifest: Manifest, digests: Iterable[bytes]) -> list[bytes]:
    """`digests` ordered so that the fragment whose next round lands soonest comes last.

    Fragment offsets grow with the index, so in every period fragment p lands after p - 1:
    the next to land is the one with the fewest rounds (the lowest index among those). A
    round landing mid-fetch then most likely changes a fragment not fetched yet, and the
    fetch can switch to its new version before spending anything on the old one.
    """
    rounds = manifest.rounds
    by_recency = sorted(range(len(rounds)), key=lambda p: (rounds[p], p), reverse=True)
    rank = {p: i for i, p in enumerate(by_recency)}
    # Within a fragment, weights chunk i next to momentum chunk i: a fetch cut short by a
    # round leaves pairs, which the rounds since can be replayed on (`bank.ChunkBank`).
    order: dict[bytes, tuple[int, int, int]] = {}
    for k, t in enumerate(manifest.tensors):  # outer.{p}.weights, outer.{p}.momentum, ...
        p = int(t.name.split(".")[1])
        for i, d in enumerate(t.chunks):
            order.setdefault(d, (rank[p], i, k))
    return sorted(digests, key=order.__getitem__)


@dataclass
class FetchPlan:
    """Which missing chunk each peer should send next; pure bookkeeping, no I/O.

    `sources` maps peer -> digests it advertised. Each digest is fetched once, however many
    positions share it (untouched momentum chunks are all zeros).
    """

    needed: Iterable[bytes]
    sources: dict[str, set[bytes]]
    chunk_bytes: int = 1 << 20  # the largest a chunk may be (in-flight limits count it)
    todo: deque[bytes] = field(init=False)
    in_flight: dict[str, set[bytes]] = field(init=False)
    fetched_from: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        self.todo = deque(dict.fromkeys(self.needed))
        self.in_flight = {p: set() for p in self.sources}
        self.fetched_from = {p: 0 for p in self.sources}

    @property
    def complete(self) -> bool:
        return not self.todo and not any(self.in_flight.values())

    @property
    def missing(self) -> int:
        return len(self.todo) + sum(len(s) for s in self.in_flight.values())

    def stuck(self) -> bool:
        """Chunks remain that no live peer can send."""
        offered = set().union(*self.sources.values()) if self.sources else set()
        return bool(self.todo) and not any(self.in_flight.values()) and \
            not any(d in offered for d in self.todo)

    def next_for(self, peer: str) -> bytes | None:
        """The first queued chunk `peer` has, now marked in flight to it; None if none."""
        have = self.sources.get(peer)
        if have is None:
            return None
        for i, digest in enumerate(self.todo):
            if digest in have:
                del self.todo[i]
                self.in_flight[peer].add(digest)
                return digest
        return None

    def delivered(self, peer: str, digest: bytes, payload: bytes) -> None:
        """Accept a chunk; RemoteProtocolError if it was not asked of `peer` or is corrupt."""
        if digest not in self.in_flight.get(peer, ()):
            raise RemoteProtocolError(f"state sync: peer sent chunk {digest.hex()[:12]} "
                                      "it was not asked for")
        if chunk_digest(payload) != digest:
            raise RemoteProtocolError(f"state sync: chunk {digest.hex()[:12]} does not match "
                                      "its digest")
        self.in_flight[peer].discard(digest)
        self.fetched_from[peer] += len(payload)

    def failed(self, peer: str, digest: bytes) -> None:
        """`peer` could not send `digest` (it no longer has it): ask someone else."""
        if digest in self.in_flight.get(peer, ()):
            self.in_flight[peer].discard(digest)
            self.sources[peer].discard(digest)
            self.todo.appendleft(digest)

    def drop(self, peer: str) -> None:
        """`peer` is gone or misbehaved: its chunks in flight go back to the queue."""
        self.todo.extendleft(self.in_flight.pop(peer, set()))
        self.sources.pop(peer, None)


class Assembler:
    """The target state being filled in; `have()` lists digests already in place."""

    def __init__(self, target: Manifest) -> None:
        self.manifest = target
        self.cb = target.chunk_bytes
        self.tensors = {t.name: torch.empty(t.numel, dtype=torch.float32)
                        for t in target.tensors}  # name -> [numel]
        self._where: dict[bytes, list[tuple[str, int]]] = {}
        for t in target.tensors:
            for i, d in enumerate(t.chunks):
                self._where.setdefault(d, []).append((t.name, i))
        self._chunks = {t.name: t.chunks for t in target.tensors}
        self._filled: set[bytes] = set()

    def needed(self) -> list[bytes]:
        """Digests not filled yet, in state order."""
        return [d for d in self._where if d not in self._filled]

    def digests(self, name: str) -> list[bytes]:
        return list(self._chunks[name])

    def digest_at(self, name: str, index: int) -> bytes | None:
        chunks = self._chunks.get(name, ())
        return chunks[index] if 0 <= index < len(chunks) else None

    def positions(self, digest: bytes) -> list[tuple[str, int]]:
        """Where `digest` goes: (tensor, chunk index) pairs; [] if nowhere."""
        return self._where.get(digest, [])

    def filled(self, digest: bytes | None) -> bool:
        return digest in self._filled

    def put(self, digest: bytes, payload: bytes | memoryview) -> None:
        """Write a verified chunk into every position that holds this digest (none: a
        chunk of something else, ignored)."""
        where = self._where.get(digest)
        if where is None:
            return
        src = np.frombuffer(payload, dtype=np.uint8)  # a view: one copy, into the tensor
        for name, i in where:
            dst = self.tensors[name].view(torch.uint8)[i * self.cb:(i + 1) * self.cb].numpy()
            if dst.size != src.size:
                raise RemoteProtocolError(f"state sync: chunk {digest.hex()[:12]} is "
                                          f"{src.size} bytes, {name}[{i}] needs {dst.size}")
            dst[...] = src
        self._filled.add(digest)

    def reuse(self, state: WorkerState | None,
              known: dict[str, list[bytes]] | None = None,
              only: Iterable[str] | None = None) -> int:
        """Fill every chunk whose digest `state` already holds (`known`: its digests per
        tensor when already computed; `only`: look at these tensors of `state` alone);
        returns the bytes reused."""
        if state is None:
            return 0
        reused = 0
        for name in (tensor_names(state.num_fragments) if only is None else only):
            t = state.tensors.get(name)
            if t is None:
                continue
            digests = (known or {}).get(name) or digests_of(t, self.cb)
            for i, d in enumerate(digests):
                if d in self._where and d not in self._filled:
                    chunk = chunk_bytes_of(t, i, self.cb)
                    self.put(d, chunk)
                    reused += len(chunk) * len(self._where[d])
        return reused

    def state(self) -> WorkerState:
        """The assembled state; only when every chunk is in place."""
        if self.needed():
            raise RuntimeError(f"Assembler.state: {len(self.needed())} chunks missing")
        m = self.manifest
        return WorkerState(m.step, tuple(m.rounds), tuple(m.outer_steps), dict(self.tensors),
                           chains=tuple(m.chains))
