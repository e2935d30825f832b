"""Slices encoded apart (a node's ranks, in parallel) joined into the encoding of any
block-aligned chunk: byte for byte what the codec writes for the chunk (algo/spliced.py)."""

from __future__ import annotations

import pytest
import torch

from dilonode.algo.codec_table import CODEC_NAMES
from dilonode.algo.codecs import get_codec
from dilonode.algo.sliced_encoding import SplicedEncoding
from dilonode.train.ranks.slices import slice_bounds


@pytest.mark.parametrize("codec", CODEC_NAMES)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("numel", [64, 1000, 4097])
def test_spliced_chunks_are_the_codecs_encoding(codec, world, numel):
    bs = 64
    c = get_codec(codec, bs)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    bounds = slice_bounds(numel, world, bs)
    parts = tuple(c.encode(x[lo:hi])[0] if hi > lo else b"" for lo, hi in bounds)
    enc = SplicedEncoding(codec, bs, tuple(bounds), parts)
    for chunk in (bs, 3 * bs, 1000):
        for start in range(0, numel, chunk):
            n = min(chunk, numel - start)
            got = enc.payload(start, n)
            if start % bs or ((start + n) % bs and start + n != numel):
                assert got is None
                continue
            assert got == c.encode(x[start:start + n])[0], (start, n)


def test_unaligned_or_out_of_range_is_refused():
    enc = SplicedEncoding("int4", 64, ((0, 128), (128, 200)), (b"", b""))
    assert enc.payload(32, 64) is None  # starts mid-block
    assert enc.payload(0, 100) is None  # ends mid-block before the end
    assert enc.payload(128, 100) is None  # past the end


@pytest.mark.parametrize("codec", ["int4", "int8", "bfloat16"])
def test_a_round_fed_spliced_encodings_gives_the_same_bits(codec):
    from dilonode.allreduce.memnet import MemNet
    from dilonode.allreduce.round import AllReduceRound, GroupSpec, RoundState, group_digest

    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(5000, generator=g) for _ in range(3)]
    members = ("a", "b", "c")
    spec = GroupSpec(run_id="t", fragment=0, round=0, members=members, weights=(1.0,) * 3,
                     numel=5000, codec=codec, block_size=64, chunk_numel=512,
                     group_digest=group_digest(members))
    c = get_codec(codec, 64)
    bounds = tuple(slice_bounds(5000, 2, 64))
    enc = SplicedEncoding(codec, 64, bounds, tuple(c.encode(xs[0][lo:hi])[0]
                                                   for lo, hi in bounds))
    plain = [AllReduceRound(spec, i, x) for i, x in enumerate(xs)]
    spliced = [AllReduceRound(spec, 0, xs[0], encoded=enc),
               *(AllReduceRound(spec, i, x) for i, x in enumerate(xs) if i)]
    for rounds in (plain, spliced):
        MemNet(rounds).run()
        assert all(r.state is RoundState.DONE for r in rounds)
    assert plain[0].digest == spliced[0].digest == spliced[2].digest
