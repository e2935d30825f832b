"""Bytes per node per round of a sparse butterfly all-reduce, by what travels back.

G members each hold a pseudo-gradient of N values, x_i = sqrt(rho) s + sqrt(1 - rho) n_i
(s shared, n_i each member's own; rho is the correlation between members). The butterfly
cuts N into G parts at sparse-chunk boundaries; member j owns part j. Every scheme's bytes
come from the codec's and `algo.sparse`'s exact size functions (values in int4, block 64):

* ``dense``          every value both ways (the baseline);
* ``shared_randk``   k = ceil(density * 4096) per chunk at positions every member draws
                     alike (`codec.kind = randk`): values only, both ways;
* ``topk_union``     each member its own top-k per chunk, positions sent along; the owner
                     sends back its sum at the union of the members' positions;
* ``topk_resparse``  the same up; the owner sends back the top-k of its sum (what it drops
                     is lost unless the owner keeps a residual of its own);
* ``topk_dense_back`` the same up; the owner sends back its whole part in int4;
* ``topk_allgather`` no owners: each member sends its top-k (positions and values) to every
                     other member, and every member sums all of them in member order.

Prints, per group size and density: bytes sent per node (up plus back, the mean over
members; received is the same by symmetry), the union's size over k (how far the owners'
sums are from sparse) and the share of each member's squared norm its chosen values hold.

    .venv/bin/python -m benchmarks.micro.sparse_allreduce                 # G 2..16, 1%, 3%
    .venv/bin/python -m benchmarks.micro.sparse_allreduce --rho 0.5 --numel 1048576
"""

from __future__ import annotations

import argparse

import torch

from dilonode.algo.codecs import Codec, get_codec
from dilonode.algo.sparse import (
    SPARSE_CHUNK,
    chunk_k,
    shared_positions,
    sparse_numel,
    topk_encoded_size,
    topk_positions,
)

__all__ = ["SCHEMES", "main", "measure"]

SCHEMES = ("dense", "shared_randk", "topk_union", "topk_resparse", "topk_dense_back",
           "topk_allgather")


def _counts(positions: torch.Tensor, lo: int, hi: int) -> list[tuple[int, int]]:
    """(k, chunk length) of each sparse chunk of [lo, hi) for increasing `positions`."""
    out = []
    for a in range(lo, hi, SPARSE_CHUNK):
        b = min(a + SPARSE_CHUNK, hi)
        k = int(torch.searchsorted(positions, b) - torch.searchsorted(positions, a))
        out.append((k, b - a))
    return out


def _inputs(g: int, numel: int, rho: float, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randn(numel, generator=gen)
    return [rho ** 0.5 * shared + (1 - rho) ** 0.5 * torch.randn(numel, generator=gen)
            for _ in range(g)]


def measure(g: int, numel: int, density: float, rho: float,
            codec: Codec | None = None, seed: int = 0) -> dict[str, float]:
    """Bytes per node per round of every scheme, the union growth and the captured norm."""
    codec = codec or get_codec("int4", 64)
    per = numel // g
    assert per % SPARSE_CHUNK == 0, "parts must be whole sparse chunks"
    xs = _inputs(g, numel, rho, seed)
    picks = [topk_positions(x, density) for x in xs]  # each member's own
    bounds = [(j * per, (j + 1) * per) for j in range(g)]
    dense_part = codec.encoded_size(per)
    up = [sum(topk_encoded_size(codec, _counts(picks[i], *bounds[j]))
              for j in range(g) if j != i) for i in range(g)]
    union_back, resparse_back, growth = [], [], []
    for lo, hi in bounds:
        union = torch.unique(torch.cat([p[(p >= lo) & (p < hi)] for p in picks]))
        union_back.append((g - 1) * topk_encoded_size(codec, _counts(union, lo, hi)))
        k_part = sparse_numel(per, density)
        resparse_back.append((g - 1) * topk_encoded_size(
            codec, [(chunk_k(c, density), c) for _, c in _counts(union, lo, hi)]))
        growth.append(union.numel() / k_part)
    shared = (g - 1) * codec.encoded_size(sparse_numel(per, density))
    whole = [topk_encoded_size(codec, _counts(p, 0, numel)) for p in picks]
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    randk = shared_positions(seed, 0, 0, numel, density)
    return {
        "dense": 2 * (g - 1) * dense_part,
        "shared_randk": 2 * shared,
        "topk_union": mean(up) + mean(union_back),
        "topk_resparse": mean(up) + mean(resparse_back),
        "topk_dense_back": mean(up) + (g - 1) * dense_part,
        "topk_allgather": (g - 1) * mean(whole),
        "union_over_k": mean(growth),
        "norm_topk": mean([float(x[p].square().sum() / x.square().sum())
                           for x, p in zip(xs, picks, strict=True)]),
        "norm_randk": mean([float(x[randk].square().sum() / x.square().sum()) for x in xs]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.03])
    p.add_argument("--numel", type=int, default=1 << 20, help="values per fragment "
                   "(a multiple of 4096 times each group size)")
    p.add_argument("--rho", type=float, default=0.0, help="correlation between members")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"numel {args.numel}, values int4 block 64, rho {args.rho}; bytes sent per node "
          "per round (up + back), as a share of dense int4 in brackets")
    print("| G | density | " + " | ".join(SCHEMES) + " | union/k | norm top-k | norm rand-k |")
    print("|---" * (len(SCHEMES) + 5) + "|")
    for g in args.groups:
        for d in args.densities:
            m = measure(g, args.numel, d, args.rho)
            cells = [f"{m[s] / 1e3:,.0f} k ({m[s] / m['dense']:.1%})" for s in SCHEMES]
            print(f"| {g} | {d:.0%} | " + " | ".join(cells) + f" | {m['union_over_k']:.2f}"
                  f" | {m['norm_topk']:.1%} | {m['norm_randk']:.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
