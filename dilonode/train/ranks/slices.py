"""How one node's ranks share a fragment: pure index arithmetic, no torch.distributed.

A node with N ranks (processes, one per device) is one peer to the swarm. Every fragment
travels as one canonical flat float32 vector (its parameters flattened and concatenated in
registration order, `algo/fragments.flatten`), the same on a 1-rank laptop and an 8-rank
server. Inside the node:

* the **outer slice** of rank r is the contiguous range `slice_bounds(numel, N, align)[r]`
  of that vector: rank r keeps the outer weights and momentum of its slice only (host RAM
  ~1/N per rank), computes the pseudo-gradient of its slice and applies the outer step to
  it. Slices are `slice_width` values wide, a multiple of `align` (the codec block), so no
  scale block straddles two ranks;
* the **local layout** is what the rank's inner model holds of the fragment: the whole
  vector under DDP, under FSDP2 its `Shard(0)` rows of every parameter (`shard_rows`:
  torch.chunk's split), which are contiguous ranges of the canonical vector too;
* `exchange_plan` says which values move from each rank's local layout to each rank's
  outer slice (and back): an all-to-all whose pieces are all contiguous ranges.

`choose_strategy` picks DDP or FSDP2 from the model size and the device memory;
`RankEnv` is where a process stands in its node (torchrun's variables).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Piece", "Plan", "RankEnv", "choose_strategy", "exchange_plan", "fsdp_segments",
           "rank_environ", "shard_rows", "slice_bounds", "slice_width",
           "train_bytes_per_param"]

# Bytes per parameter while training with AdamW in float32: weights, gradient, two moments.
_TRAIN_BYTES = 16


def slice_bounds(numel: int, world: int, align: int = 1) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) per rank covering [0, numel): `slice_width` values each, the
    last non-empty one short, trailing ones possibly empty. Equal widths let the node's
    collectives gather and scatter straight into one [world, width] buffer."""
    if world < 1 or align < 1 or numel < 0:
        raise ValueError(f"slice_bounds: numel={numel}, world={world}, align={align}")
    width = slice_width(numel, world, align)
    return [(min(r * width, numel), min((r + 1) * width, numel)) for r in range(world)]


def slice_width(numel: int, world: int, align: int = 1) -> int:
    """Values per rank's outer slice: ceil(numel / world), rounded up to `align`."""
    return align * math.ceil(math.ceil(numel / align) / world) if numel else 0


def shard_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """Rows [lo, hi) of a dim-0 `Shard(0)` parameter held by `rank` (torch.chunk's split:
    ceil(rows / world) rows per rank, trailing ranks possibly empty)."""
    size = math.ceil(rows / world) if rows else 0
    return min(rank * size, rows), min((rank + 1) * size, rows)


def fsdp_segments(shapes: Sequence[Sequence[int]], world: int,
                  rank: int) -> list[tuple[int, int]]:
    """The (canonical offset, length) ranges of a fragment whose parameters have `shapes`
    that `rank` holds under FSDP2 per-parameter dim-0 sharding, in order."""
    out, offset = [], 0
    for shape in shapes:
        numel = math.prod(shape)
        rows = shape[0] if len(shape) else 1
        per_row = numel // rows if rows else 0
        lo, hi = shard_rows(rows, world, rank)
        out.append((offset + lo * per_row, (hi - lo) * per_row))
        offset += numel
    return out


@dataclass(frozen=True)
class Piece:
    """`length` values at `src` of the sender's local buffer go to `dst` of the receiver's
    outer slice."""

    src: int
    dst: int
    length: int


@dataclass(frozen=True)
class Plan:
    """One fragment's all-to-all between local layouts and outer slices.

    `pieces[s][d]`: what rank s sends to rank d, in canonical order. Sender s packs its
    pieces for d in that order; receiver d unpacks what s sent in the same order."""

    pieces: tuple[tuple[tuple[Piece, ...], ...], ...]

    def send_sizes(self, rank: int) -> list[int]:
        return [sum(p.length for p in ps) for ps in self.pieces[rank]]

    def recv_sizes(self, rank: int) -> list[int]:
        return [sum(p.length for p in self.pieces[s][rank]) for s in range(len(self.pieces))]


def exchange_plan(local: Sequence[Sequence[tuple[int, int]]],
                  bounds: Sequence[tuple[int, int]]) -> Plan:
    """The pieces moving each rank's `local[s]` segments (canonical offset, length; the
    local buffer is their concatenation) into the outer slices `bounds`."""
    world = len(bounds)
    plan = []
    for segments in local:
        row: list[list[Piece]] = [[] for _ in range(world)]
        pos = 0  # offset in the sender's local buffer
        for start, length in segments:
            end = start + length
            for d, (lo, hi) in enumerate(bounds):
                a, b = max(start, lo), min(end, hi)
                if a < b:
                    row[d].append(Piece(pos + a - start, a - lo, b - a))
            pos += length
        plan.append(tuple(tuple(ps) for ps in row))
    return Plan(tuple(plan))


def train_bytes_per_param() -> int:
    """Float32 weights, gradients and AdamW's two moments."""
    return _TRAIN_BYTES


def choose_strategy(params: int, device_bytes: int | None, world: int,
                    headroom: float = 0.6) -> str:
    """"ddp" when a full replica's training state (`train_bytes_per_param` per parameter)
    fits in `headroom` of one device's memory (the rest is activations and the runtime),
    else "fsdp". Unknown memory (None) or a single rank: "ddp"."""
    if world <= 1 or device_bytes is None:
        return "ddp"
    return "ddp" if params * _TRAIN_BYTES <= headroom * device_bytes else "fsdp"


@dataclass(frozen=True)
class RankEnv:
    """Where this process stands in its node, as torchrun (or `--nproc`) says."""

    rank: int
    world: int
    local_rank: int
    master: str  # "host:port" of the node's rendezvous

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> RankEnv | None:
        """The torchrun variables; None outside a launched node or with one rank."""
        world = int(environ.get("WORLD_SIZE", "1") or 1)
        if world <= 1:
            return None
        rank = int(environ["RANK"])
        local = int(environ.get("LOCAL_RANK", rank))
        master = f"{environ.get('MASTER_ADDR', '127.0.0.1')}:{environ['MASTER_PORT']}"
        return cls(rank, world, local, master)


def rank_environ(base: Mapping[str, str], rank: int, world: int,
                 port: int) -> dict[str, str]:
    """`base` plus torchrun's variables for local rank `rank` of `world`."""
    return {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}
