"""Sparse rounds: which values of a fragment travel, chunk by chunk.

`codec.kind = randk`: every chunk of `SPARSE_CHUNK` consecutive values sends
k = ceil(density * chunk length) of them, at positions that every member of the round draws
alike from (run seed, fragment, round) (`shared_positions`). The round then all-reduces only
those values, gathered into a short dense vector, with the value codec (`codec.name`): no
position travels, the owners' float32 sums stay at the same k positions, every member
scatters the same mean back, and the byte counts are the value codec's exact sizes of the
short vector. Robust aggregation works unchanged: every member's values sit at the same
positions. Error feedback (`error_feedback.py`) keeps the values left out for a later
round, in which other positions are drawn.

Independent top-k (each node its own k largest per chunk, positions sent along) is the
alternative the benchmark `benchmarks.micro.sparse_allreduce` measures against it: its
exact size is `topk_encoded_size` (positions as uint16 offsets in the chunk or a bitmap,
whichever is smaller, then the value codec), and the owners' sums then hold the union of
the members' positions (`union_size`), which grows toward the group size times k. The
report docs/reports/2026-12-02-sparse-allreduce.md holds the figures and the decision.

Positions: score(i) = splitmix64(i xor key) for each index i of the fragment, key =
splitmix64(splitmix64(splitmix64(seed) xor fragment) xor round); a chunk keeps the k indices
of smallest score, in increasing order. splitmix64 is a bijection, so scores never tie and
any selection algorithm gives the same set. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from dilonode.algo.dense_codecs import Codec

__all__ = ["SPARSE_CHUNK", "chunk_k", "gather", "positions_bytes", "round_key", "scatter",
           "shared_positions", "sparse_numel", "splitmix64", "topk_encoded_size",
           "topk_positions", "union_size"]

# Values per sparse chunk: offsets inside it fit a uint16.
SPARSE_CHUNK = 4096
_MASK64 = (1 << 64) - 1


def splitmix64(z: np.ndarray) -> np.ndarray:
    """(n,) uint64 -> (n,) uint64, the splitmix64 finalizer of z + golden gamma (wrapping)."""
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    out: np.ndarray = z ^ (z >> np.uint64(31))
    return out


def round_key(seed: int, fragment: int, round_: int) -> np.uint64:
    """The 64-bit key of (run seed, fragment, round) positions are drawn from."""
    z = splitmix64(np.array([seed & _MASK64], dtype=np.uint64))
    z = splitmix64(z ^ np.uint64(fragment & _MASK64))
    return np.uint64(splitmix64(z ^ np.uint64(round_ & _MASK64))[0])


def chunk_k(length: int, density: float) -> int:
    """Values a chunk of `length` sends at `density`: ceil(density * length), at least 1."""
    if length <= 0:
        return 0
    return min(length, max(1, math.ceil(density * length)))


def _chunks(numel: int, chunk: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + chunk, numel)) for lo in range(0, numel, chunk)]


def sparse_numel(numel: int, density: float, chunk: int = SPARSE_CHUNK) -> int:
    """Values a sparse round of a `numel`-value fragment sends (every chunk's k)."""
    full, tail = divmod(numel, chunk)
    return full * chunk_k(chunk, density) + chunk_k(tail, density)


def shared_positions(seed: int, fragment: int, round_: int, numel: int, density: float,
                     chunk: int = SPARSE_CHUNK) -> torch.Tensor:
    """(sparse_numel,) int64 increasing indices of the values round `round_` of `fragment`
    sends, the same on every member (module docstring)."""
    if numel <= 0:
        return torch.empty(0, dtype=torch.int64)
    key = round_key(seed, fragment, round_)
    scores = splitmix64(np.arange(numel, dtype=np.uint64) ^ key)  # (numel,) all distinct
    full, tail = divmod(numel, chunk)
    pieces = []
    if full:
        k = chunk_k(chunk, density)
        rows = scores[:full * chunk].reshape(full, chunk)  # (full, chunk)
        pick = np.argpartition(rows, k - 1, axis=1)[:, :k] if k < chunk else \
            np.broadcast_to(np.arange(chunk), (full, chunk))
        pick = np.sort(pick, axis=1) + (np.arange(full) * chunk)[:, None]  # (full, k)
        pieces.append(pick.reshape(-1))
    if tail:
        k = chunk_k(tail, density)
        last = scores[full * chunk:]
        pick = np.sort(np.argpartition(last, k - 1)[:k] if k < tail else np.arange(tail))
        pieces.append(pick + full * chunk)
    return torch.from_numpy(np.concatenate(pieces).astype(np.int64))


def gather(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(n,), (K,) -> (K,) the values at `positions`, contiguous."""
    return x.index_select(0, positions.to(x.device))


def scatter(values: torch.Tensor, positions: torch.Tensor, numel: int) -> torch.Tensor:
    """(K,), (K,) -> (numel,) float32 zeros with `values` at `positions`."""
    out = torch.zeros(numel, dtype=torch.float32, device=values.device)
    out.index_copy_(0, positions.to(values.device), values.to(torch.float32))
    return out


# ---------------------------------------------------------------------- independent top-k


def topk_positions(x: torch.Tensor, density: float, chunk: int = SPARSE_CHUNK) -> torch.Tensor:
    """(n,) -> (K,) int64 increasing indices of each chunk's k largest |x| (this node's
    own choice: the positions must travel with the values)."""
    picks = []
    for lo, hi in _chunks(x.numel(), chunk):
        k = chunk_k(hi - lo, density)
        idx = torch.topk(x[lo:hi].abs(), k, sorted=False).indices
        picks.append(torch.sort(idx).values + lo)
    return torch.cat(picks) if picks else torch.empty(0, dtype=torch.int64)


def positions_bytes(k: int, length: int) -> int:
    """Bytes of k positions in a chunk of `length` values: uint16 offsets (2k) or a bitmap
    (ceil(length / 8)), whichever is smaller; a decoder knowing k and length knows which."""
    if k <= 0:
        return 0
    return min(2 * k, -(-length // 8))


def topk_encoded_size(codec: Codec, counts: Sequence[tuple[int, int]]) -> int:
    """Exact bytes of independent top-k chunks: `counts` holds (k, chunk length) per chunk;
    positions of each chunk, then the value codec's encoding of all their values."""
    return (sum(positions_bytes(k, n) for k, n in counts)
            + codec.encoded_size(sum(k for k, _ in counts)))


def union_size(position_sets: Sequence[torch.Tensor]) -> int:
    """Distinct positions over the members' sets: what an owner's sum holds."""
    if not position_sets:
        return 0
    return int(torch.unique(torch.cat(list(position_sets))).numel())
