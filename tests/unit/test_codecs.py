"""Pseudo-gradient codecs: error bounds, exact wire sizes and layouts, validation of
untrusted input. Pure CPU arithmetic; no sockets."""

from __future__ import annotations

import math
import struct
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from dilonode.algo.codec_table import BLOCK_CODEC_NAMES, CODEC_NAMES, CODECS, FLOAT_CODEC_NAMES
from dilonode.algo.codecs import (
    Codec,
    CodecError,
    CodecMeta,
    get_codec,
    max_abs_error_bound,
)

BLOCK_CODECS = BLOCK_CODEC_NAMES
FLOAT_CODECS = FLOAT_CODEC_NAMES
F32_MAX = float(np.finfo(np.float32).max)
FP4_UNITS = [0.0] + [2.0**-k for k in range(6, -1, -1)]  # 0, 1/64, ..., 1/2, 1


def _vectors(max_abs: float, max_len: int = 300) -> st.SearchStrategy[np.ndarray]:
    """1-D float32 arrays: dense, or mostly zeros (zero blocks), lengths 1..max_len."""
    bound = float(np.float32(max_abs))  # hypothesis wants limits exact in float32
    elems = st.floats(-bound, bound, width=32, allow_nan=False, allow_infinity=False)
    shape = st.integers(1, max_len)
    return st.one_of(arrays(np.float32, shape, elements=elems),
                     arrays(np.float32, shape, elements=elems, fill=st.just(0.0)))


def _max_abs_for(name: str) -> float:
    return 65504.0 if name == "float16" else 1e30


def _block_sizes(name: str) -> st.SearchStrategy[int]:
    if name in FLOAT_CODECS:
        return st.just(64)
    per = CODECS[name].codes_per_byte
    return st.sampled_from([b for b in ([2, 4, 8, 64] if name != "int8" else [2, 3, 5, 8, 64])
                            if b % per == 0])


def _hand_size(name: str, n: int, bs: int) -> int:
    """A float32 scale per block (block codecs), then the codes' bits rounded up to bytes."""
    spec = CODECS[name]
    scales = 4 * math.ceil(n / bs) if spec.is_block else 0
    return scales + math.ceil(n * spec.bits / 8)


def _roundtrip(codec: Codec, x: torch.Tensor) -> torch.Tensor:
    data, meta = codec.encode(x)
    return codec.decode(data, meta)


# ---------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", CODEC_NAMES)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_roundtrip_within_error_bound(name: str, data: st.DataObject) -> None:
    arr = data.draw(_vectors(_max_abs_for(name)), label="x")
    codec = get_codec(name, data.draw(_block_sizes(name), label="block_size"))
    x = torch.from_numpy(arr)
    y = _roundtrip(codec, x)
    assert y.dtype == torch.float32 and y.shape == x.shape
    err = (y.double() - x.double()).abs()  # (n,)
    bound = max_abs_error_bound(codec, x)
    assert bound.shape == x.shape and bool((bound >= 0).all())
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), (float(x[worst]), float(y[worst]), float(bound[worst]))


@settings(max_examples=40, deadline=None)
@given(arr=_vectors(F32_MAX))
def test_float32_is_bit_exact(arr: np.ndarray) -> None:
    x = torch.from_numpy(arr)
    y = _roundtrip(get_codec("float32"), x)
    assert torch.equal(y.view(torch.int32), x.view(torch.int32))  # -0.0 and subnormals too


@pytest.mark.parametrize(("name", "qmax"), [("int8", 127), ("int4", 7)])
@settings(max_examples=30, deadline=None)
@given(arr=_vectors(1e30), bs=st.sampled_from([2, 4, 6, 64]))
def test_int_codecs_match_numpy_reference(name: str, qmax: int, arr: np.ndarray, bs: int) -> None:
    n_blocks = math.ceil(arr.size / bs)
    padded = np.zeros(n_blocks * bs, np.float32)
    padded[: arr.size] = arr
    scale = np.abs(padded).reshape(n_blocks, bs).max(axis=1) / np.float32(qmax)  # (n_blocks,)
    safe = np.where(scale > 0, scale, np.float32(1))
    q = np.clip(np.round(padded.reshape(n_blocks, bs) / safe[:, None]), -qmax, qmax)
    expected = (q * scale[:, None]).astype(np.float32).reshape(-1)[: arr.size]
    y = _roundtrip(get_codec(name, bs), torch.from_numpy(arr))
    np.testing.assert_array_equal(y.numpy(), expected)


@settings(max_examples=40, deadline=None)
@given(arr=_vectors(1e30), bs=st.sampled_from([2, 4, 8, 64]))
def test_fp4_picks_nearest_representable(arr: np.ndarray, bs: int) -> None:
    x = torch.from_numpy(arr)
    y = _roundtrip(get_codec("fp4", bs), x).double().numpy()
    n_blocks = math.ceil(arr.size / bs)
    scale = np.repeat([np.abs(arr[i * bs:(i + 1) * bs]).max() for i in range(n_blocks)], bs)
    scale = scale[: arr.size].astype(np.float64)
    grid = np.asarray(FP4_UNITS)[None, :] * scale[:, None]  # (n, 8) candidate magnitudes
    x64 = arr.astype(np.float64)
    best = np.abs(np.abs(x64)[:, None] - grid).min(axis=1)  # (n,) distance to nearest
    assert np.all(np.abs(y - x64) <= best * (1 + 2.0**-20) + 2.0**-149)
    on_grid = np.isclose(np.abs(y)[:, None], grid, rtol=1e-6, atol=2.0**-149).any(axis=1)
    assert np.all(on_grid | (y == 0))


def test_fp4_every_representable_value_roundtrips_exactly() -> None:
    codec = get_codec("fp4", block_size=16)
    for s in (1.0, 3.0, 1e-30, 1e30):
        units = torch.tensor(FP4_UNITS + [-u for u in FP4_UNITS[1:]], dtype=torch.float64)
        x = (units * s).float()  # (15,) one short block; absmax is s itself
        assert torch.equal(_roundtrip(codec, x), x), s


def test_fp4_mean_error_is_reasonable() -> None:
    x = torch.randn(8192, generator=torch.Generator().manual_seed(0))
    rel = {name: float((_roundtrip(get_codec(name), x) - x).abs().mean() / x.abs().mean())
           for name in ("fp4", "int4", "int8")}
    # Gaussian data, block 64: fp4 has no mantissa, so it trails int4 but stays usable.
    assert rel["fp4"] < 0.2
    assert rel["int4"] < 0.15
    assert rel["int8"] < 0.01


def test_zero_block_has_zero_scale_and_decodes_to_zeros() -> None:
    for name in BLOCK_CODECS:
        bs = max(4, CODECS[name].codes_per_byte)
        codec = get_codec(name, block_size=bs)
        x = torch.cat([torch.zeros(bs), torch.tensor([1.0, -2.0, 3.0, 4.0] * (bs // 4))])
        data, meta = codec.encode(x)
        assert data[:4] == b"\x00" * 4
        y = codec.decode(data, meta)
        assert torch.equal(y[:bs], torch.zeros(bs))


def test_empty_tensor_roundtrips() -> None:
    for name in CODEC_NAMES:
        codec = get_codec(name)
        data, meta = codec.encode(torch.zeros(0))
        assert data == b"" and meta.numel == 0
        assert codec.decode(data, meta).shape == (0,)


# ---------------------------------------------------------------------------- wire sizes


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_encoded_size_matches_encode_and_hand_formula(name: str) -> None:
    for bs in (2, 4, 8, 64):
        if bs % CODECS[name].codes_per_byte and CODECS[name].is_block:
            continue
        codec = get_codec(name, bs)
        bs_eff = codec.block_size
        for n in (0, 1, 2, 3, 63, 64, 65, 127, 128, 130, 1001):
            data, meta = codec.encode(torch.linspace(-1, 1, n))
            assert len(data) == codec.encoded_size(n) == _hand_size(name, n, bs_eff), (bs, n)
            assert meta == CodecMeta(codec=name, numel=n, block_size=bs_eff)


@pytest.mark.parametrize(("name", "n", "bs", "size"), [
    ("int4", 130, 64, 3 * 4 + 65),
    ("fp4", 130, 64, 77),
    ("int8", 130, 64, 3 * 4 + 130),
    ("int4", 1, 64, 5),
    ("fp4", 64, 64, 4 + 32),
    ("int8", 10, 3, 4 * 4 + 10),
    ("float32", 3, 64, 12),
    ("bfloat16", 3, 64, 6),
    ("float16", 5, 64, 10),
    ("int4", 10_000_000, 64, 156_250 * 4 + 5_000_000),
])
def test_encoded_size_literals(name: str, n: int, bs: int, size: int) -> None:
    assert get_codec(name, bs).encoded_size(n) == size


def test_float_codecs_record_block_size_one_and_can_be_rebuilt_from_meta() -> None:
    for name in CODEC_NAMES:
        codec = get_codec(name, 8)
        data, meta = codec.encode(torch.arange(5.0))
        assert meta.block_size == (1 if name in FLOAT_CODECS else 8)
        assert isinstance(codec, Codec)
        # A receiver builds its codec from the meta it was sent.
        twin = get_codec(meta.codec, meta.block_size)
        assert torch.equal(twin.decode(data, meta), codec.decode(data, meta))


# ---------------------------------------------------------------------------- known values


def test_int8_known_values() -> None:
    data, meta = get_codec("int8", 4).encode(torch.tensor([1.0, -0.5, 0.25, 0.0]))
    scale = torch.tensor(1.0, dtype=torch.float32) / 127  # absmax / 127 in float32
    assert data == struct.pack("<f", float(scale)) + bytes([127, 256 - 64, 32, 0])
    expected = torch.tensor([127.0, -64.0, 32.0, 0.0]) * scale  # -63.5 rounds to -64
    assert torch.equal(get_codec("int8", 4).decode(data, meta), expected)


def test_int8_known_values_exact_scale() -> None:
    codec = get_codec("int8", 4)
    x = torch.tensor([127.0, -63.0, 31.6, 0.2, -254.0])  # second block: scale 2
    data, meta = codec.encode(x)
    assert data == struct.pack("<ff", 1.0, 2.0) + bytes([127, 256 - 63, 32, 0, 256 - 127])
    assert codec.decode(data, meta).tolist() == [127.0, -63.0, 32.0, 0.0, -254.0]


def test_int4_nibble_packing_known_bytes() -> None:
    codec = get_codec("int4", 4)
    data, _ = codec.encode(torch.tensor([7.0, -7.0, 1.0, -1.0]))  # scale = 7 / 7 = 1
    # two's complement nibbles 7, 9, 1, F; low nibble holds the even index
    assert data == struct.pack("<f", 1.0) + bytes([0x97, 0xF1])
    data, meta = codec.encode(torch.tensor([7.0, -7.0, 3.0]))  # odd: zero padding nibble
    assert data == struct.pack("<f", 1.0) + bytes([0x97, 0x03])
    assert codec.decode(data, meta).tolist() == [7.0, -7.0, 3.0]


def test_fp4_known_bytes() -> None:
    codec = get_codec("fp4", 4)
    data, meta = codec.encode(torch.tensor([2.0, -1.0, 0.5, 0.0, 0.05]))
    # scale = block absmax; codes 7 (1), 8|6 (-1/2), 5 (1/4), 0; then 0.05/0.05 -> 7
    assert data == struct.pack("<ff", 2.0, 0.05) + bytes([0xE7, 0x05, 0x07])
    assert codec.decode(data, meta).tolist() == pytest.approx([2.0, -1.0, 0.5, 0.0, 0.05])


def test_fp4_rounds_linearly_with_ties_down() -> None:
    codec = get_codec("fp4", 2)
    # 0.75 is midway between 1/2 and 1 (tie -> 1/2); 0.76 -> 1; 2^-7 midway 0 / 2^-6 -> 0
    x = torch.tensor([1.0, 0.75, 1.0, 0.76, 1.0, 2.0**-7, 1.0, 2.0**-7 * 1.01])
    assert _roundtrip(codec, x).tolist() == [1.0, 0.5, 1.0, 1.0, 1.0, 0.0, 1.0, 2.0**-6]


def test_bfloat16_and_float16_round_to_nearest() -> None:
    x = torch.tensor([1.0 + 2.0**-9, 1.0 + 3 * 2.0**-9, 65519.0, -1e-8])
    assert _roundtrip(get_codec("bfloat16"), x[:2]).tolist() == [1.0, 1.0 + 2.0**-7]
    assert _roundtrip(get_codec("float16"), x).tolist() == pytest.approx(
        [1.0 + 2.0**-9, 1.0 + 3 * 2.0**-9, 65504.0, -1e-8], abs=2.0**-25)


# ---------------------------------------------------------------------------- encode refusals


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_encode_refuses_non_finite(name: str, bad: float) -> None:
    x = torch.tensor([1.0, bad, 2.0, bad, 0.0])
    with pytest.raises(CodecError, match="2 non-finite"):
        get_codec(name, 8).encode(x)


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_encode_refuses_bad_shape_and_dtype(name: str) -> None:
    codec = get_codec(name)
    for bad in (torch.zeros(2, 3), torch.tensor(1.0), torch.arange(4), torch.zeros(3).bool()):
        with pytest.raises(CodecError):
            codec.encode(bad)
    with pytest.raises(CodecError, match="torch.Tensor"):
        codec.encode([1.0, 2.0])  # type: ignore[arg-type]


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_encode_accepts_other_floats_and_strided_input(name: str) -> None:
    codec = get_codec(name, 8)
    base = torch.linspace(-3, 3, 21)
    want = codec.encode(base)[0]
    assert codec.encode(base.double())[0] == want
    assert codec.encode(torch.stack([base, base], dim=1)[:, 0])[0] == want  # stride 2
    assert codec.encode(base.clone().requires_grad_())[0] == want
    half = base.bfloat16()
    assert codec.encode(half)[0] == codec.encode(half.float())[0]


def test_float16_refuses_overflow_instead_of_encoding_inf() -> None:
    codec = get_codec("float16")
    assert codec.decode(*codec.encode(torch.tensor([65504.0, -65519.0]))).tolist() == [
        65504.0, -65504.0]
    with pytest.raises(CodecError, match="1 value.*overflow float16"):
        codec.encode(torch.tensor([1.0, -70000.0]))
    with pytest.raises(CodecError, match="overflow bfloat16"):
        get_codec("bfloat16").encode(torch.tensor([F32_MAX]))


def test_block_codecs_stay_finite_at_float32_max() -> None:
    x = torch.tensor([F32_MAX, -F32_MAX, 1.0, 0.0])
    for name in BLOCK_CODECS:
        codec = get_codec(name, 8)
        y = _roundtrip(codec, x)
        assert bool(torch.isfinite(y).all())
        assert bool(((y.double() - x.double()).abs() <= max_abs_error_bound(codec, x)).all())


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_encode_is_deterministic_and_leaves_input_alone(name: str) -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    before = x.clone()
    codec = get_codec(name)
    assert codec.encode(x)[0] == codec.encode(x)[0]
    assert torch.equal(x.view(torch.int32), before.view(torch.int32))


# ---------------------------------------------------------------------------- decode refusals


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_decode_refuses_wrong_length(name: str) -> None:
    codec = get_codec(name)
    data, meta = codec.encode(torch.linspace(-1, 1, 130))
    expected = len(data)
    for bad in (data[:-1], data + b"\x00", b""):
        with pytest.raises(CodecError, match=f"must be {expected} bytes, got {len(bad)}"):
            codec.decode(bad, meta)


@pytest.mark.parametrize("name", BLOCK_CODECS)
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -1.0, -F32_MAX])
def test_decode_refuses_corrupt_scale(name: str, scale: float) -> None:
    codec = get_codec(name, 8)
    data, meta = codec.encode(torch.linspace(-1, 1, 10))
    corrupt = data[:4] + struct.pack("<f", scale) + data[8:]  # second of three scales
    with pytest.raises(CodecError, match="1 invalid block scale"):
        codec.decode(corrupt, meta)


@pytest.mark.parametrize("name", BLOCK_CODECS)
def test_a_signalling_nan_scale_is_refused_without_a_numpy_warning(name: str) -> None:
    # A peer's bytes can hold any NaN; casting a signalling one printed numpy's "invalid
    # value encountered in cast" into the node's log before the one-line error.
    codec = get_codec(name, 8)
    data, meta = codec.encode(torch.linspace(-1, 1, 10))
    corrupt = data[:4] + struct.pack("<I", 0x7F800001) + data[8:]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(CodecError, match="1 invalid block scale"):
            codec.decode(corrupt, meta)


def test_decode_refuses_scale_that_overflows_on_multiply() -> None:
    codec = get_codec("int8", 4)
    data, meta = codec.encode(torch.ones(4))
    with pytest.raises(CodecError, match="invalid block scale"):
        codec.decode(struct.pack("<f", F32_MAX / 100) + data[4:], meta)
    # fp4's largest unit is 1, so any finite scale is fine there
    fp4 = get_codec("fp4", 4)
    data, meta = fp4.encode(torch.ones(4))
    assert fp4.decode(struct.pack("<f", F32_MAX) + data[4:], meta).tolist() == [F32_MAX] * 4


def test_decode_refuses_out_of_range_integers_and_padding() -> None:
    int8 = get_codec("int8", 4)
    data, meta = int8.encode(torch.ones(4))
    with pytest.raises(CodecError, match="-128"):
        int8.decode(data[:4] + b"\x80" + data[5:], meta)
    int4 = get_codec("int4", 4)
    data, meta = int4.encode(torch.ones(3))
    with pytest.raises(CodecError, match="0b1000"):
        int4.decode(data[:4] + b"\x87" + data[5:], meta)
    for codec in (int4, get_codec("fp4", 4)):
        data, meta = codec.encode(torch.ones(3))
        with pytest.raises(CodecError, match="padding nibble"):
            codec.decode(data[:-1] + bytes([data[-1] | 0x10]), meta)


@pytest.mark.parametrize("name", FLOAT_CODECS)
def test_decode_refuses_non_finite_float_payload(name: str) -> None:
    codec = get_codec(name)
    data, meta = codec.encode(torch.ones(3))
    width = len(data) // 3
    nan = struct.pack("<f", float("nan")) if width == 4 else b"\xff\x7f"
    with pytest.raises(CodecError, match="1 non-finite"):
        codec.decode(data[:width] + nan + data[2 * width:], meta)


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_decode_refuses_mismatched_meta(name: str) -> None:
    codec = get_codec(name, 8)
    data, meta = codec.encode(torch.ones(8))
    other = "int8" if name != "int8" else "int4"
    bad_metas = [
        CodecMeta(other, meta.numel, meta.block_size),
        CodecMeta(name, -1, meta.block_size),
        CodecMeta(name, True, meta.block_size),  # type: ignore[arg-type]
        CodecMeta(name, 8.0, meta.block_size),  # type: ignore[arg-type]
        CodecMeta(name, 9, meta.block_size),
    ]
    if name in BLOCK_CODECS:
        bad_metas.append(CodecMeta(name, meta.numel, 16))
    for bad in bad_metas:
        with pytest.raises(CodecError):
            codec.decode(data, bad)
    with pytest.raises(CodecError, match="CodecMeta"):
        codec.decode(data, {"codec": name})  # type: ignore[arg-type]


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_decode_accepts_any_contiguous_buffer_and_copies(name: str) -> None:
    codec = get_codec(name, 8)
    data, meta = codec.encode(torch.linspace(-2, 2, 11))
    want = codec.decode(data, meta)
    buf = bytearray(b"\x00" + data)  # offset 1: misaligned for float32 reads
    got = codec.decode(memoryview(buf)[1:], meta)
    assert torch.equal(got, want)
    assert torch.equal(codec.decode(bytearray(data), meta), want)
    buf[1:] = bytes(len(data))  # later writes to the buffer must not reach the tensor
    assert torch.equal(got, want)
    with pytest.raises(CodecError, match="contiguous"):
        codec.decode(memoryview(bytearray(2 * len(data)))[::2], meta)


# ---------------------------------------------------------------------------- get_codec


def test_get_codec_validation() -> None:
    with pytest.raises(CodecError, match="unknown codec 'zstd'"):
        get_codec("zstd")
    for name in ("int4", "fp4"):
        with pytest.raises(CodecError, match="even"):
            get_codec(name, 63)
    for name in BLOCK_CODECS:
        for bad in (1, 0, -4):
            with pytest.raises(CodecError, match="block_size"):
                get_codec(name, bad)
        with pytest.raises(CodecError, match="block_size"):
            get_codec(name, True)
        with pytest.raises(CodecError, match="block_size"):
            get_codec(name, 64.0)  # type: ignore[arg-type]
    assert get_codec("int8", 3).block_size == 3
    assert get_codec("int4", np.int64(32)).block_size == 32  # type: ignore[arg-type]
    assert [get_codec(n).name for n in CODEC_NAMES] == list(CODEC_NAMES)


def test_encoded_size_refuses_bad_counts() -> None:
    for bad in (-1, 1.5, None):
        with pytest.raises(CodecError):
            get_codec("int4").encoded_size(bad)  # type: ignore[arg-type]


def test_float32_error_bound_is_zero() -> None:
    x = torch.randn(100)
    assert torch.equal(max_abs_error_bound(get_codec("float32"), x), torch.zeros(100).double())
