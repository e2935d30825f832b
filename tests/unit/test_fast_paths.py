"""The all-reduce's fast paths: the sum-based finiteness check, decoding straight into an
output slice or as a view of the payload, the reused body buffer of the frame decoder, frames
written in pieces, the BLAKE3 round digests and the GMAC frame tags. Each is checked against
the straightforward computation it replaces or the spec."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dilonode.algo import kernels
from dilonode.algo.codecs import CODEC_NAMES, CodecError, all_finite, get_codec
from dilonode.allreduce.memnet import MemNet
from dilonode.allreduce.round import (
    AllReduceRound,
    GroupSpec,
    RoundState,
    chunk_hash,
    part_digest,
    result_digest,
    round_digest,
)
from dilonode.wire.framing import FrameDecoder, encode_frame
from dilonode.wire.messages import Contribution

F32_MAX = float(np.finfo(np.float32).max)


# ---------------------------------------------------------------------- all_finite


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, 517, 999])
def test_all_finite_finds_one_bad_value_anywhere(bad: float, where: int) -> None:
    x = torch.randn(1000)
    assert all_finite(x) and all_finite(x.numpy())
    x[where] = bad
    assert not all_finite(x) and not all_finite(x.numpy())


def test_all_finite_is_not_fooled_by_an_overflowing_sum() -> None:
    x = torch.full((64,), F32_MAX)  # finite values whose float32 sum is inf
    assert all_finite(x) and all_finite(x.numpy())
    y = torch.tensor([F32_MAX, float("inf"), -F32_MAX])
    assert not all_finite(y)
    z = torch.tensor([float("inf"), float("-inf")])  # sums to NaN
    assert not all_finite(z)
    half = torch.tensor([1.0, 3e38, 3e38, float("nan")], dtype=torch.bfloat16)
    assert all_finite(half[:3]) and not all_finite(half)  # the exact check for any dtype


# ---------------------------------------------------------------------- decode_into


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("numel", [1, 63, 200])
def test_decode_into_a_slice_equals_decode_and_leaves_the_rest(name: str, numel: int) -> None:
    codec = get_codec(name, 8)
    data, meta = codec.encode(torch.randn(numel, generator=torch.Generator().manual_seed(1)))
    buf = torch.full((numel + 10,), 7.0)
    codec.decode_into(data, meta, buf[5:5 + numel])
    assert torch.equal(buf[5:5 + numel], codec.decode(data, meta))
    assert bool((buf[:5] == 7.0).all()) and bool((buf[5 + numel:] == 7.0).all())


@pytest.mark.parametrize("name", ["float32", "int4"])
def test_decode_into_refuses_an_unusable_target(name: str) -> None:
    codec = get_codec(name, 8)
    data, meta = codec.encode(torch.randn(16))
    for bad in (torch.empty(15), torch.empty(16, dtype=torch.float64),
                torch.empty(32)[::2], np.empty(16, np.float32)):
        with pytest.raises(CodecError, match="decode_into needs"):
            codec.decode_into(data, meta, bad)  # type: ignore[arg-type]


def test_float32_decode_into_refuses_non_finite_payload() -> None:
    codec = get_codec("float32")
    data = np.array([1.0, np.nan, 2.0], dtype="<f4").tobytes()
    _, meta = codec.encode(torch.zeros(3))
    with pytest.raises(CodecError, match="non-finite"):
        codec.decode_into(data, meta, torch.empty(3))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), None])
@pytest.mark.parametrize("where", [0, 517, 999])
def test_float32_decode_copies_and_checks_in_one_pass_as_the_two_passes_did(
        bad: float | None, where: int) -> None:
    # Every float32 bit pattern class: signed zeros, subnormals, the extremes, a NaN
    # payload; the compiled copy must give the same bits as the reference's copy, and
    # refuse exactly what it refuses.
    x = np.random.default_rng(where).standard_normal(1000).astype(np.float32)
    x[1:7] = [0.0, -0.0, 1e-45, -1e-40, F32_MAX, -F32_MAX]
    if bad is not None:
        x[where] = bad
    data, meta = x.astype("<f4").tobytes(), get_codec("float32").encode(torch.zeros(1000))[1]
    outs = []
    for codec in (get_codec("float32"), get_codec("float32", reference=True)):
        out = torch.full((1000,), 7.0)
        try:
            codec.decode_into(data, meta, out)
            outs.append(out.numpy().view(np.int32).copy())
        except CodecError as exc:
            outs.append(str(exc))
    assert isinstance(outs[0], str) == (bad is not None)
    assert (outs[0] == outs[1]) if isinstance(outs[0], str) else np.array_equal(*outs)
    if bad is None:
        assert np.array_equal(outs[0], x.view(np.int32))


# ---------------------------------------------------------------------- frame decoder


def _contribution(numel: int, seed: int) -> Contribution:
    payload = torch.randn(numel, generator=torch.Generator().manual_seed(seed)).numpy()
    return Contribution(run_id="r", fragment=0, round=1, sender=1, owner=0, chunk=0,
                        n_chunks=1, offset=0, numel=numel, codec="float32", block_size=64,
                        weight=1.0, payload=payload.tobytes())


@pytest.mark.parametrize("piece", [1000, 65_537, 300_000])
def test_large_frames_decode_through_the_reused_body_buffer(piece: int) -> None:
    # A large frame, a smaller large one (the buffer is reused, not shrunk) and a small one,
    # cut at arbitrary points; the caller overwrites its buffer after every feed call.
    msgs = [_contribution(100_000, 1), _contribution(40_000, 2), _contribution(10, 3)]
    stream = b"".join(encode_frame(m) for m in msgs)
    decoder = FrameDecoder()
    scratch = bytearray(piece)
    got = []
    for at in range(0, len(stream), piece):
        part = stream[at:at + piece]
        scratch[:len(part)] = part
        got += decoder.feed(memoryview(scratch)[:len(part)])
        scratch[:] = bytes(len(scratch))  # the decoder must have copied what it keeps
    assert got == msgs
    assert decoder.buffered == 0


# ---------------------------------------------------------------------- digests


def _spec(n: int, numel: int, codec: str, weights: tuple[float, ...]) -> GroupSpec:
    return GroupSpec(run_id="run", fragment=0, round=3, members=tuple(f"p{i}" for i in range(n)),
                     weights=weights, numel=numel, codec=codec, block_size=32, chunk_numel=96)


@pytest.mark.parametrize("codec", ["float32", "int4"])
def test_round_digest_is_the_result_digest_of_the_values_everyone_holds(codec: str) -> None:
    spec = _spec(3, 1000, codec, (1.0, 0.0, 2.0))  # member 1 owns an empty part
    xs = [torch.randn(1000, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    rounds = [AllReduceRound(spec, i, x) for i, x in enumerate(xs)]
    MemNet(rounds).run()
    assert all(r.state is RoundState.DONE for r in rounds)
    expected = result_digest(rounds[0].result, spec)
    assert [r.digest for r in rounds] == [expected] * 3
    changed = rounds[0].result.clone()
    changed[999] = torch.nextafter(changed[999], torch.tensor(1e9))  # one ulp, last part
    assert result_digest(changed, spec) != expected


def test_digests_are_blake3_chained_as_specified() -> None:
    import blake3

    values = torch.arange(10, dtype=torch.float32)
    assert chunk_hash(values) == blake3.blake3(values.numpy().astype("<f4").tobytes()).digest()
    parts = [part_digest([chunk_hash(values[:4]), chunk_hash(values[4:])]), part_digest([])]
    assert parts[1] == blake3.blake3(b"").hexdigest()
    joined = bytes.fromhex(parts[0]) + bytes.fromhex(parts[1])
    assert round_digest(parts) == blake3.blake3(joined).hexdigest()


# ---------------------------------------------------------------------- result buffer


def test_round_writes_its_result_into_a_given_buffer() -> None:
    spec = _spec(3, 500, "int8", (1.0, 1.0, 1.0))
    xs = [torch.randn(500, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    plain = [AllReduceRound(spec, i, x) for i, x in enumerate(xs)]
    MemNet(plain).run()
    bufs = [torch.full((500,), float("nan")) for _ in range(3)]
    given = [AllReduceRound(spec, i, x, out=b)
             for i, (x, b) in enumerate(zip(xs, bufs, strict=True))]
    MemNet(given).run()
    for r, b, ref in zip(given, bufs, plain, strict=True):
        assert r.state is RoundState.DONE
        assert r.result.data_ptr() == b.data_ptr() and torch.equal(b, ref.result)
        assert r.digest == ref.digest


def test_result_buffer_must_fit_and_not_overlap_local() -> None:
    spec = _spec(2, 64, "float32", (1.0, 1.0))
    local = torch.zeros(128)
    for bad in (torch.empty(63), torch.empty(64, dtype=torch.float64), torch.empty(128)[::2],
                np.zeros(64, np.float32),
                local[32:96]):
        with pytest.raises(ValueError, match="out:"):
            AllReduceRound(spec, 0, local[:64], out=bad)
    AllReduceRound(spec, 0, local[:64], out=local[64:])  # adjacent, not overlapping


# ---------------------------------------------------------------------- zero-copy paths


def test_frame_parts_are_the_frame_with_the_payload_uncopied() -> None:
    from dilonode.wire.framing import encode_frame_parts

    for numel in (10, 100_000):
        msg = _contribution(numel, 4)
        parts = encode_frame_parts(msg)
        assert b"".join(parts) == encode_frame(msg)
        # A large payload is its own piece, the very bytes object of the message.
        assert any(p is msg.payload for p in parts) == (numel == 100_000)


def test_float32_decode_shared_is_a_checked_view_of_the_payload() -> None:
    from dilonode.algo.codecs import decode_shared

    codec = get_codec("float32")
    x = torch.randn(1000, generator=torch.Generator().manual_seed(5))
    payload, meta = codec.encode(x)
    values = decode_shared(codec, payload, meta)
    assert torch.equal(values, codec.decode(payload, meta))
    assert np.shares_memory(values.numpy(), np.frombuffer(payload, np.uint8))
    bad = bytearray(payload)
    bad[8:12] = np.array([np.nan], "<f4").tobytes()
    with pytest.raises(CodecError, match="non-finite"):
        decode_shared(codec, bytes(bad), meta)
    with pytest.raises(CodecError, match="must be 4000 bytes"):
        decode_shared(codec, payload[:-4], meta)
    for name in ("bfloat16", "int4"):  # the others decode into fresh memory
        other = get_codec(name, 64)
        p, m = other.encode(x)
        assert torch.equal(decode_shared(other, p, m), other.decode(p, m))


def test_reduce_mean_into_a_buffer_is_bit_identical() -> None:
    from dilonode.algo.butterfly import reduce_mean

    xs = [torch.randn(777, generator=torch.Generator().manual_seed(i)) * 10 ** i
          for i in range(5)]
    out = torch.full((777,), float("nan"))
    assert reduce_mean(xs, out=out) is out
    assert torch.equal(out, reduce_mean(xs))


def test_float32_round_result_is_the_exact_member_order_mean() -> None:
    from dilonode.algo.butterfly import reduce_mean

    spec = _spec(4, 1000, "float32", (1.0, 2.0, 1.0, 1.0))
    xs = [torch.randn(1000, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    rounds = [AllReduceRound(spec, i, x) for i, x in enumerate(xs)]
    MemNet(rounds).run()
    expected = reduce_mean(xs)
    assert all(r.state is RoundState.DONE and torch.equal(r.result, expected) for r in rounds)
    assert all(torch.equal(x, torch.randn(1000, generator=torch.Generator().manual_seed(i)))
               for i, x in enumerate(xs))  # the local values were only read


# ---------------------------------------------------------------------- fold_float32


def _fold_inputs(n_members: int, numel: int, seed: int) -> list[bytes]:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(numel, generator=g) * 10.0 ** (i % 7 - 3) for i in range(n_members)]
    xs[0][:3] = torch.tensor([-0.0, 1e-45, -1e-45])  # a signed zero and subnormals
    if n_members > 1:
        xs[1][:3] = torch.tensor([-0.0, -1e-45, 1e-45])
    return [x.numpy().tobytes() for x in xs]


@pytest.mark.skipif(not kernels.AVAILABLE, reason="numba not importable")
@pytest.mark.parametrize("n_members", [1, 2, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("weights", [None, "uneven"])
def test_fold_float32_is_accumulate_per_step_then_encode_bit_for_bit(
        n_members: int, weights: str | None) -> None:
    from dilonode.algo.butterfly import reduction_steps
    from dilonode.algo.codecs import CodecMeta, fold_float32

    codec, numel = get_codec("float32"), 3001  # blocks of the kernel and a short last one
    payloads = _fold_inputs(n_members, numel, n_members)
    w = None if weights is None else [1.0 + 3 * i for i in range(n_members)]
    steps = reduction_steps(w, n_members)
    expected = torch.full((numel,), float("nan"))
    for data, (step, coef) in zip(payloads, steps, strict=True):
        codec.accumulate(data, CodecMeta("float32", numel, 1), expected, step, coef)
    out = torch.full((numel,), float("nan"))
    encoded = fold_float32(codec, payloads, steps, out)
    assert encoded is not None and encoded.readonly
    assert out.numpy().tobytes() == expected.numpy().tobytes()  # -0.0 kept, bit for bit
    assert bytes(encoded) == codec.encode(expected)[0]


@pytest.mark.skipif(not kernels.AVAILABLE, reason="numba not importable")
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_fold_float32_refuses_a_result_that_is_not_finite_as_encode_does(bad: float) -> None:
    from dilonode.algo.butterfly import reduction_steps
    from dilonode.algo.codecs import fold_float32

    codec, numel = get_codec("float32"), 2100
    payloads = _fold_inputs(6, numel, 0)
    x = np.frombuffer(payloads[5], dtype=np.float32).copy()
    x[2099] = bad  # in the second batch's last block
    payloads[5] = x.tobytes()
    with pytest.raises(CodecError, match="refusing to encode 1 non-finite value"):
        fold_float32(codec, payloads, reduction_steps(None, 6), torch.empty(numel))
    big = [np.full(numel, F32_MAX, dtype=np.float32).tobytes()] * 2  # finite, sum overflows
    with pytest.raises(CodecError, match=f"non-finite value\\(s\\) \\(NaN/Inf\\) of {numel}"):
        fold_float32(codec, big, [("write", 1.0), ("add", 1.0)], torch.empty(numel))


def test_fold_float32_leaves_what_it_does_not_apply_to() -> None:
    from dilonode.algo.codecs import fold_float32

    out = torch.full((8,), 7.0)
    data = [np.ones(8, dtype=np.float32).tobytes()] * 2
    f32 = get_codec("float32")
    for codec, steps in [(get_codec("int4", 8), [("write", 1.0), ("add", 1.0)]),
                         (f32, [("add", 1.0), ("add", 1.0)]),  # not from the first step
                         (f32, [("write", 1.0)]),  # not a step per payload
                         (f32, [("add_divide", 2.0), ("write", 1.0)])]:
        assert fold_float32(codec, data, steps, out) is None
    assert torch.equal(out, torch.full((8,), 7.0))  # untouched
    assert fold_float32(f32, data, [("write", 1.0), ("add_divide", 2.0)], out) is not None
    assert torch.equal(out, torch.ones(8))


# ---------------------------------------------------------------------- frame tags


def test_frame_tags_are_gmac_as_specified_whatever_the_pieces() -> None:
    import os

    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from dilonode.net.channel import TAG_BYTES, FrameSealer

    key, frame = os.urandom(32), os.urandom(300_001)
    sealer = FrameSealer(key)
    tags = [sealer.seal(frame[:7], memoryview(frame)[7:123_457], frame[123_457:]),
            sealer.seal(frame)]
    # protocol/README.md section 9: AES-256-GCM, nonce = frame number, frame as AAD.
    for n, tag in enumerate(tags):
        expected = AESGCM(key).encrypt(n.to_bytes(12, "big"), b"", frame)
        assert len(tag) == TAG_BYTES and tag == expected[-TAG_BYTES:]
    assert tags[0] != tags[1]
    with pytest.raises(ValueError, match="32 bytes"):
        FrameSealer(key[:16]).seal(frame)


def test_allocator_tuning_applies_once_on_glibc() -> None:
    import platform

    from dilonode.allreduce.allocator import tune_allocator

    first = tune_allocator()
    assert tune_allocator() is first
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert first
