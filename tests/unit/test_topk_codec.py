"""The chunked top-k codec (`dilonode/algo/topk_codec.py`): what it keeps, its exact sizes in
both position encodings, its refusals, and its device path against the CPU codec."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from dilonode.algo.codecs import (
    CodecError,
    CodecMeta,
    get_codec,
    max_abs_error_bound,
    part_align,
)
from dilonode.algo.sparse import SPARSE_CHUNK, positions_bytes, topk_positions
from dilonode.algo.topk_codec import parse_topk_name, topk_chunk_k, topk_name
from dilonode.algo.torch_codecs import decode_torch, encode_chunks_torch, encode_torch


def _x(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _expected_size(codec, numel: int) -> int:
    """Chunk by chunk: positions (`sparse.positions_bytes`), then k values in the value
    codec (`codec.value`)."""
    total = 0
    for lo in range(0, numel, SPARSE_CHUNK):
        length = min(SPARSE_CHUNK, numel - lo)
        k = topk_chunk_k(codec.k, length)
        total += positions_bytes(k, length) + codec.value.encoded_size(k)
    return total


@pytest.mark.parametrize("name", ["topk64_int2", "topk123_int4", "topk300_int2",
                                  "topk4096_int4", "topk7_float32"])
@pytest.mark.parametrize("numel", [0, 1, 77, 4096, 3 * 4096 + 513])
def test_encoding_has_the_exact_size_and_keeps_each_chunks_largest(name, numel):
    codec = get_codec(name, 64)
    x = _x(numel, numel)
    data, meta = codec.encode(x)
    assert len(data) == codec.encoded_size(numel) == _expected_size(codec, numel)
    y = codec.decode(data, meta)
    assert y.shape == (numel,) and y.dtype == torch.float32
    if not numel:
        return
    kept = topk_positions(x, codec.k / SPARSE_CHUNK)  # the k largest |x| per chunk
    outside = torch.ones(numel, dtype=torch.bool)
    outside[kept] = False
    assert not y[outside].any()  # nothing outside the kept positions
    if name.endswith("float32"):  # lossless values: exactly x at the kept positions
        assert torch.equal(y[kept], x[kept])
        return
    # Each chunk's kept values are the value codec's encoding of them, blocks from the
    # chunk's first kept value: within that codec's guaranteed bound.
    for lo in range(0, numel, SPARSE_CHUNK):
        at = kept[(kept >= lo) & (kept < lo + SPARSE_CHUNK)]
        bound = max_abs_error_bound(codec.value, x[at])
        assert bool(((y[at] - x[at]).abs().double() <= bound).all())


def test_offsets_and_bitmap_are_chosen_by_size():
    # k = 256 of 4096: 512 bytes of offsets = 512 bytes of bitmap, offsets on the tie;
    # k = 257: the bitmap.
    for k, offsets in ((256, True), (257, False), (1, True), (4096, False)):
        codec = get_codec(f"topk{k}_float32")
        data, _ = codec.encode(_x(SPARSE_CHUNK))
        assert len(data) == min(2 * k, 512) + 4 * k
        head = np.frombuffer(data[:min(2 * k, 512)], np.uint8)
        if offsets:
            off = head.view("<u2")
            assert (np.diff(off.astype(np.int64)) > 0).all()
        else:
            assert int(np.unpackbits(head).sum()) == k


def test_ties_go_to_the_lower_index():
    codec = get_codec("topk2_float32")
    x = torch.zeros(SPARSE_CHUNK)
    x[[5, 9, 100, 3000]] = torch.tensor([1.0, -1.0, 1.0, 1.0])  # four equal magnitudes
    data, meta = codec.encode(x)
    assert struct.unpack("<2H", data[:4]) == (5, 9)
    y = codec.decode(data, meta)
    assert y.nonzero().flatten().tolist() == [5, 9] and y[9] == -1.0
    # All zeros: the first k positions.
    assert struct.unpack("<2H", codec.encode(torch.zeros(SPARSE_CHUNK))[0][:4]) == (0, 1)


@pytest.mark.parametrize("seed", range(6))
def test_positions_are_a_stable_sorts_first_k_even_with_many_ties(seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (3 * SPARSE_CHUNK + 700,), generator=gen).float() / 2  # ties
    for k in (1, 64, 700, 4096):
        codec = get_codec(f"topk{k}_float32")
        y = codec.decode(*codec.encode(x))
        for lo in range(0, x.numel(), SPARSE_CHUNK):
            chunk = x[lo:lo + SPARSE_CHUNK].numpy()
            kc = topk_chunk_k(k, chunk.size)
            want = np.sort(np.argsort(-np.abs(chunk), kind="stable")[:kc])
            got = y[lo:lo + SPARSE_CHUNK]
            assert torch.equal(got[want], x[lo:lo + SPARSE_CHUNK][want])
            outside = np.setdiff1d(np.arange(chunk.size), want)
            assert not got[outside].any()


def test_pieces_cut_at_chunk_boundaries_concatenate():
    codec = get_codec("topk123_int4", 64)
    x = _x(5 * SPARSE_CHUNK + 100)
    whole = codec.encode(x)[0]
    cut = 2 * SPARSE_CHUNK
    assert codec.encode(x[:cut])[0] + codec.encode(x[cut:])[0] == whole
    assert part_align(codec, 64) == SPARSE_CHUNK and part_align(get_codec("int4", 64), 64) == 64


def test_non_finite_values_are_refused_with_the_codecs_line():
    codec = get_codec("topk64_int2", 64)
    x = _x(5000)
    x[4500] = float("nan")
    with pytest.raises(CodecError, match=r"^refusing to encode 1 non-finite value\(s\) "
                       r"\(NaN/Inf\) of 5000$"):
        codec.encode(x)


def _one_chunk(k: int = 3) -> tuple[object, bytearray, CodecMeta]:
    codec = get_codec(f"topk{k}_float32")
    data, meta = codec.encode(_x(SPARSE_CHUNK))
    return codec, bytearray(data), meta


@pytest.mark.parametrize("offsets, why", [
    ((7, 7, 9), "strictly increasing"), ((9, 7, 11), "strictly increasing"),
    ((1, 2, 4096), "below 4096")])
def test_malformed_offsets_are_refused(offsets, why):
    codec, raw, meta = _one_chunk()
    raw[:6] = struct.pack("<3H", *offsets)
    with pytest.raises(CodecError, match=f"topk3_float32 data, chunk 0: offsets .*{why}"):
        codec.decode(bytes(raw), meta)


def test_malformed_bitmaps_and_sizes_are_refused():
    codec = get_codec("topk300_int2", 4)
    data, meta = codec.encode(_x(SPARSE_CHUNK + 10))
    raw = bytearray(data)
    raw[0] ^= 1  # one position more or fewer
    with pytest.raises(CodecError, match=r"chunk 0: bitmap holds (299|301) position"):
        codec.decode(bytes(raw), meta)
    with pytest.raises(CodecError, match=r"must be \d+ bytes, got"):
        codec.decode(data[:-1], meta)
    with pytest.raises(CodecError, match="meta says 'topk64_int2'/4"):
        codec.decode(data, CodecMeta("topk64_int2", meta.numel, 4))
    # A bitmap padding bit past a short chunk's end (chunk of 10 values: 2 bytes).
    short = get_codec("topk4096_float32")
    data, meta = short.encode(_x(10))
    raw = bytearray(data)
    raw[1] |= 0x80
    with pytest.raises(CodecError, match=r"padding bits 1\), expected 10"):
        short.decode(bytes(raw), meta)


def test_values_refused_by_the_value_codec_name_the_chunk():
    codec = get_codec("topk64_int4", 64)
    data, meta = codec.encode(_x(2 * SPARSE_CHUNK))
    raw = bytearray(data)
    per_chunk = len(raw) // 2
    raw[per_chunk + 128 + 4] = 0x88  # int4 code -8 in the second chunk's values
    with pytest.raises(CodecError, match=r"^topk64_int4 data, chunk 1: int4 data holds"):
        codec.decode(bytes(raw), meta)


@pytest.mark.parametrize("name", ["topk", "topk0_int2", "topk4097_int2", "topk64_int3",
                                  "topk64int2", "topk064_int2"])
def test_unknown_names_are_refused_on_one_line(name):
    with pytest.raises(CodecError, match=r"^unknown codec .*topk<k>_<value codec>"):
        get_codec(name)


def test_names_follow_the_density():
    assert topk_name("int2", 0.0156) == "topk64_int2"
    assert topk_name("int4", 0.03) == "topk123_int4"
    assert parse_topk_name("topk123_int4") == (123, "int4")
    assert [topk_chunk_k(64, n) for n in (1, 63, 64, 65, 4096)] == [1, 1, 1, 2, 64]


def test_accumulate_and_decode_into_match_decode():
    codec = get_codec("topk64_int2", 64)
    a, meta = codec.encode(_x(9000, 1))
    out = torch.full((9000,), 3.0)
    codec.decode_into(a, meta, out)
    assert torch.equal(out, codec.decode(a, meta))
    codec.accumulate(a, meta, out, "add")
    assert torch.equal(out, codec.decode(a, meta) * 2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_device_path_is_bit_identical_to_the_cpu_codec(device):
    codec = get_codec("topk123_int4", 64)
    x = _x(4 * SPARSE_CHUNK + 999, 7)
    data, meta = codec.encode(x)
    on = encode_torch(codec, x.to(device))
    assert on.device.type == device and bytes(on.cpu().numpy()) == data
    chunks = encode_chunks_torch(codec, x.to(device), 2 * SPARSE_CHUNK)
    assert bytes(chunks.cpu().numpy()) == data
    back = decode_torch(codec, on, meta)
    assert back.device.type == device and torch.equal(back.cpu(), codec.decode(data, meta))


@pytest.mark.parametrize("name, block", [("topk64_int4", 64), ("topk64_int2", 32),
                                         ("topk123_int2", 64), ("topk8_sign1", 8)])
def test_decoding_equals_each_chunk_decoded_on_its_own(name, block):
    """Whole value blocks per chunk are decoded in one call of the value codec, other
    layouts chunk by chunk: both give each chunk's own decoding."""
    codec = get_codec(name, block)
    x = _x(5 * SPARSE_CHUNK, 3)
    data, meta = codec.encode(x)
    got = codec.decode(data, meta)
    kc, size = topk_chunk_k(codec.k, SPARSE_CHUNK), codec.encoded_size(SPARSE_CHUNK)
    pos = positions_bytes(kc, SPARSE_CHUNK)
    for c in range(5):
        record = data[c * size:(c + 1) * size]
        offsets = np.frombuffer(record[:pos], "<u2").astype(np.int64)
        values = codec.value.decode(record[pos:], CodecMeta(codec.value.name, kc, block))
        chunk = got[c * SPARSE_CHUNK:(c + 1) * SPARSE_CHUNK]
        assert torch.equal(chunk[offsets], values)
        assert int((chunk != 0).sum()) == int((values != 0).sum())
