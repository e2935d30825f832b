"""Bytes of a top-k round against rand-k and dense rounds, and what top-k's owners keep.

Part 1, bytes (exact sizes, no data): the bytes one node sends per round of a fragment of
`--numel` values among G members with equal weights, parts cut as the round cuts them
(`GroupSpec.parts`, at `codecs.part_align`): every other owner's part up, then its own
part's result to the G - 1 others. Schemes: dense int4 and int2 (block 64); rand-k (the
gathered k values per chunk in int2, `sparse.sparse_numel`); top-k (`topk<k>_int2`, the
real codec's `encoded_size`: positions and values of each chunk).

Part 2, the owners' sums (measured on `--sample` values): G members with independent
Gaussian pseudo-gradients (`--rho`: the share their shared component holds) each encode
their values with the top-k codec; the owner decodes and averages them in float32
(`butterfly.reduce_mean`, as the round does) and re-encodes the mean with the same codec.
Reported: the union of the members' positions over k (what an owner would have to send
back to lose nothing), the bytes the union would cost as a top-k-style payload
(`sparse.topk_encoded_size`) against the re-sparsified result, and the share of the mean's
squared norm that the re-sparsified result keeps.

    .venv/bin/python -m benchmarks.micro.topk_round          # 2**24 values, G 2/4/8
    .venv/bin/python -m benchmarks.micro.topk_round --rho 0.5
"""

from __future__ import annotations

import argparse
import time

import torch

from dilonode.algo.butterfly import reduce_mean
from dilonode.algo.codecs import Codec, get_codec
from dilonode.algo.sparse import (
    SPARSE_CHUNK,
    sparse_numel,
    topk_encoded_size,
    topk_positions,
    union_size,
)
from dilonode.algo.topk_codec import topk_chunk_k, topk_name
from dilonode.allreduce.round import GroupSpec

__all__ = ["main", "round_bytes", "owner_sums"]

DENSITIES = ("1.56", "3")


def _spec(numel: int, g: int, codec: str) -> GroupSpec:
    return GroupSpec(run_id="bench", fragment=0, round=0,
                     members=tuple(f"m{i}" for i in range(g)), weights=(1.0,) * g,
                     numel=numel, codec=codec, block_size=64,
                     chunk_numel=64 * SPARSE_CHUNK)


def round_bytes(numel: int, g: int, codec: str, sent: int | None = None) -> float:
    """Mean bytes a member sends per round: the others' parts up, its part back to G - 1.
    `sent`: the round's values when fewer than numel travel (rand-k gathers them)."""
    n = numel if sent is None else sent
    spec = _spec(n, g, codec)
    c = spec.codec_obj
    sizes = [sum(c.encoded_size(min(spec.chunk_numel, b - a0))
                 for a0 in range(a, b, spec.chunk_numel)) for a, b in spec.parts]
    total = sum(sizes)
    return sum((total - s) + (g - 1) * s for s in sizes) / g


def _part_counts(positions: torch.Tensor, numel: int) -> list[tuple[int, int]]:
    """(positions, length) of each 4096-value chunk of [0, numel)."""
    edges = torch.arange(0, numel + SPARSE_CHUNK, SPARSE_CHUNK).clamp(max=numel)
    counts = torch.searchsorted(positions, edges)
    return [(int(counts[i + 1] - counts[i]), int(edges[i + 1] - edges[i]))
            for i in range(len(edges) - 1) if edges[i + 1] > edges[i]]


def owner_sums(codec: Codec, g: int, numel: int, rho: float, seed: int = 0
               ) -> dict[str, float]:
    """One owner's view of a part of `numel` values (module docstring, part 2)."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randn(numel, generator=gen)
    xs = [rho ** 0.5 * shared + (1 - rho) ** 0.5 * torch.randn(numel, generator=gen)
          for _ in range(g)]
    t0 = time.perf_counter()
    encoded = [codec.encode(x) for x in xs]
    t1 = time.perf_counter()
    mean = reduce_mean([codec.decode(d, m) for d, m in encoded])  # (numel,) float32
    t2 = time.perf_counter()
    back = codec.decode(*codec.encode(mean))
    density = codec.k / SPARSE_CHUNK  # type: ignore[attr-defined]
    union = torch.unique(torch.cat([topk_positions(x, density) for x in xs]))
    k_total = sum(topk_chunk_k(codec.k, n) for _, n in  # type: ignore[attr-defined]
                  _part_counts(union, numel))
    value = get_codec("int2", 64)
    return {
        "union_over_k": union_size([union]) / k_total,
        "union_bytes": topk_encoded_size(value, _part_counts(union, numel)),
        "resparse_bytes": codec.encoded_size(numel),
        "norm_topk_exact": float(mean.double()[topk_positions(mean, density)].square().sum()
                                 / mean.double().square().sum()),
        "explained": float(1 - (mean - back).double().square().sum()
                           / mean.double().square().sum()),
        "encode_s": (t1 - t0) / g, "decode_s": (t2 - t1) / g,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=1 << 24, help="values per fragment")
    p.add_argument("--sample", type=int, default=1 << 20, help="values of part 2's parts")
    p.add_argument("--groups", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--rho", type=float, default=0.0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    n = args.numel
    print(f"Part 1: bytes one node sends per round, fragment of {n:,} values, block 64")
    print("| G | dense int4 | dense int2 | " + " | ".join(
        f"rand-k {d}% int2 | top-k {d}% int2" for d in DENSITIES) + " |")
    print("|---" * (3 + 2 * len(DENSITIES)) + "|")
    for g in args.groups:
        int4 = round_bytes(n, g, "int4")
        cells = [int4, round_bytes(n, g, "int2")]
        for d in DENSITIES:
            dens = float(d) / 100
            cells += [round_bytes(n, g, "int2", sparse_numel(n, dens)),
                      round_bytes(n, g, topk_name("int2", dens))]
        print(f"| {g} | " + " | ".join(f"{c / 1e6:,.3f} MB ({c / int4:.1%})" for c in cells)
              + " |")
    print(f"\nPart 2: one owner's part of {args.sample:,} values, rho {args.rho}")
    print("| G | density | union / k | union back | re-sparsified back | norm at the top-k "
          "positions | explained by the int2 result | encode s | decode s |")
    print("|---" * 9 + "|")
    for g in args.groups:
        for d in DENSITIES:
            codec = get_codec(topk_name("int2", float(d) / 100), 64)
            m = owner_sums(codec, g, args.sample, args.rho)
            print(f"| {g} | {d}% | {m['union_over_k']:.2f} | {m['union_bytes'] / 1e3:,.1f} kB"
                  f" | {m['resparse_bytes'] / 1e3:,.1f} kB | {m['norm_topk_exact']:.1%} | "
                  f"{m['explained']:.1%} | {m['encode_s']:.3f} | {m['decode_s']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
