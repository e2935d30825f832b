"""Hostile input: hypothesis fuzzing of every decoder that reads peer bytes.

Each decoder must end every input either with a valid object or with the package's own
clean rejection (`RemoteProtocolError` for frames and messages, `CodecError` for payloads,
`ValueError` with one line for DHT records); any other exception is a crash and fails the
test. Inputs are mutations of the golden vectors in protocol/vectors/ (so most cases reach
deep into validation) plus raw garbage. Size caps are checked to hold before allocation.

Cases per run (>= 10,000 in total, ~30 s on one shared core): frames 3000, message bodies
2500, message fields 1500, payloads 2000, top-k payloads 400, records 1200, rounds 300.
"""

from __future__ import annotations

import contextlib
import json
import tracemalloc
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dilonode.algo.codec_table import CODEC_NAMES, CODECS, FLOAT_CODEC_NAMES
from dilonode.algo.codecs import CodecError, CodecMeta, get_codec
from dilonode.allreduce.round import AllReduceRound, GroupSpec, RoundState
from dilonode.net.auth import Credentials, Identity, seal_record
from dilonode.swarm.records import GroupEntry, PeerRecord, decode_record, encode_record
from dilonode.wire.errors import LocalProtocolError, RemoteProtocolError
from dilonode.wire.framing import FrameDecoder, decode_message
from dilonode.wire.messages import message_from_dict

VECTORS = Path(__file__).parents[2] / "protocol" / "vectors"
FRAMES = [p.read_bytes() for p in sorted(VECTORS.glob("*.bin"))]
BODIES = [f[4:] for f in FRAMES]
DICTS = [msgpack.unpackb(b, raw=False) for b in BODIES]
FUZZ = settings(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def mutated(draw: st.DrawFn, seeds: list[bytes]) -> bytes:
    """A seed with a few byte-level edits: flips, inserts, deletes, truncation, splices."""
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "splice"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[pos] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xC0, 0xC1, 0xC4, 0xC6, 0xD9,
                                              0xDC, 0xDD, 0xDE, 0xDF, 0xFF]))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(max_size=8))
        elif op == "delete":
            del data[pos:pos + draw(st.integers(1, 8))]
        elif op == "truncate":
            del data[pos:]
        elif op == "splice":
            other = draw(st.sampled_from(seeds))
            data[pos:] = other[draw(st.integers(0, len(other))):]
    return bytes(data)


def _feed_all(data: bytes, cuts: list[int]) -> int:
    """Feed `data` split at `cuts`; returns messages decoded or raises RemoteProtocolError."""
    dec = FrameDecoder(max_frame_bytes=1 << 16)
    got, last = 0, 0
    for cut in sorted({min(c, len(data)) for c in cuts}) + [len(data)]:
        got += len(dec.feed(data[last:cut]))
        assert dec.buffered <= len(data)  # never holds more than it was given
        last = cut
    return got


@settings(FUZZ, max_examples=3000)
@given(data=st.one_of(mutated(FRAMES), mutated([b"".join(FRAMES)]), st.binary(max_size=64)),
       cuts=st.lists(st.integers(0, 4096), max_size=4))
def test_frame_decoder_accepts_or_rejects_cleanly(data: bytes, cuts: list[int]) -> None:
    try:
        _feed_all(data, cuts)
    except RemoteProtocolError as exc:
        assert exc.reason and "\n" not in exc.reason


@settings(FUZZ, max_examples=2500)
@given(body=st.one_of(mutated(BODIES), st.binary(max_size=48)))
def test_message_body_decoding_accepts_or_rejects_cleanly(body: bytes) -> None:
    try:
        decode_message(body, run_id="golden-run")
    except RemoteProtocolError as exc:
        assert exc.reason and "\n" not in exc.reason


_LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**64), 2**64), st.floats(),
    st.text(max_size=40), st.binary(max_size=40),
    st.sampled_from([2**32, 2**63, -1, 4096, "", "0" * 64, "hello", "result", "fp4"]))
_VALUES = st.recursive(_LEAVES, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8)


@st.composite
def field_edits(draw: st.DrawFn) -> dict[str, Any]:
    """A golden message map with fields replaced, added or removed (msgpack-level values)."""
    body = dict(draw(st.sampled_from(DICTS)))
    for _ in range(draw(st.integers(1, 3))):
        keys = sorted(body)
        action = draw(st.sampled_from(["replace", "replace", "drop", "add"]))
        if action == "replace" and keys:
            body[draw(st.sampled_from(keys))] = draw(_VALUES)
        elif action == "drop" and keys:
            body.pop(draw(st.sampled_from(keys)))
        else:
            body[draw(st.text(max_size=12))] = draw(_VALUES)
    return body


@settings(FUZZ, max_examples=1500)
@given(body=field_edits())
def test_message_fields_are_validated_cleanly(body: dict[str, Any]) -> None:
    try:
        packed = msgpack.packb(body, use_bin_type=True)
    except (OverflowError, ValueError):
        return  # not representable in msgpack: a peer cannot send it
    with contextlib.suppress(RemoteProtocolError):
        message_from_dict(body)
    with contextlib.suppress(RemoteProtocolError):
        decode_message(packed)


# Small blocks (16 bytes of int8 codes, 4 of 4-bit ones), so that short payloads hold
# several; and int4 at the default block size.
def _small_block(per: int) -> int:
    """A small block size that is a multiple of `per` codes per byte: 16 int8 values, 8
    4-bit ones, 4 int2 ones, 8 sign1 ones."""
    return per * max(1, 16 // per // per)


# Top-k over a few value codecs: offsets (k small) and bitmaps (k = the whole chunk).
_TOPK = [("topk64_int2", 4), ("topk4096_int4", 2), ("topk300_float16", 1)]
_CODECS = [(name, 64 if name in FLOAT_CODEC_NAMES else _small_block(CODECS[name].codes_per_byte))
           for name in CODEC_NAMES] + [("int4", 64)] + _TOPK


@settings(FUZZ, max_examples=2000)
@given(which=st.sampled_from(_CODECS), numel=st.integers(0, 70),
       payload=st.one_of(st.binary(max_size=300), st.builds(
           lambda n, fill: bytes([fill]) * n, st.integers(0, 300), st.integers(0, 255))),
       exact=st.booleans())
def test_codec_decode_accepts_or_rejects_cleanly(which: tuple[str, int], numel: int,
                                                 payload: bytes, exact: bool) -> None:
    codec = get_codec(*which)
    if exact:  # most garbage has the wrong length; make half of it the right one
        size = codec.encoded_size(numel)
        payload = (payload * (size // max(len(payload), 1) + 1))[:size] if payload else \
            bytes(size)
    meta = CodecMeta(codec=codec.name, numel=numel, block_size=codec.block_size)
    try:
        values = codec.decode(payload, meta)
    except CodecError as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    assert values.dtype == torch.float32 and values.shape == (numel,)


@settings(FUZZ, max_examples=400)
@given(which=st.sampled_from(_TOPK), numel=st.integers(1, 9000), seed=st.integers(0, 2**16),
       edits=st.lists(st.tuples(st.integers(0, 2**20), st.integers(0, 255)), min_size=1,
                      max_size=4))
def test_topk_decode_of_edited_encodings_is_clean(which: tuple[str, int], numel: int,
                                                  seed: int, edits: list[tuple[int, int]]
                                                  ) -> None:
    """Valid top-k encodings with a few bytes set: positions and values alike."""
    codec = get_codec(*which)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    data, meta = codec.encode(x)
    raw = bytearray(data)
    for pos, value in edits:
        raw[pos % len(raw)] = value
    try:
        values = codec.decode(bytes(raw), meta)
    except CodecError as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    assert values.shape == (numel,) and bool(torch.isfinite(values).all())


RUN = "fuzz-run"
CREDS = Credentials(Identity.generate(), RUN)
_PEER = PeerRecord(peer_id=CREDS.peer_id, run_id=RUN, data_addr="127.0.0.1:4000",
                   bandwidth_mbps=10.0, step=3, status={"loss": 2.5}, expires_at=1e9)
_ENTRY = GroupEntry(peer_id=CREDS.peer_id, run_id=RUN, data_addr="127.0.0.1:4000",
                    bandwidth_mbps=10.0, fragment=1, round=2, attempt=0)
SEALED = [encode_record(_PEER, CREDS), encode_record(_ENTRY, CREDS)]
RECORD_BODIES = [msgpack.packb(r.model_dump(), use_bin_type=True) for r in (_PEER, _ENTRY)]


def _decode_record_cleanly(raw: bytes) -> None:
    for kind in (PeerRecord, GroupEntry):
        try:
            decode_record(kind, raw, CREDS)
        except ValueError as exc:
            # ValidationError is a ValueError too: require our own one-line reason.
            assert type(exc).__module__.startswith("dilonode") or type(exc) is ValueError
            assert str(exc).startswith(kind.__name__) and "\n" not in str(exc)


@settings(FUZZ, max_examples=800)
@given(raw=st.one_of(mutated(SEALED), st.binary(max_size=64)))
def test_sealed_record_bytes_are_rejected_cleanly(raw: bytes) -> None:
    _decode_record_cleanly(raw)


@settings(FUZZ, max_examples=400)
@given(body=mutated(RECORD_BODIES))
def test_validly_signed_garbage_records_are_rejected_cleanly(body: bytes) -> None:
    # Signed with the run's own key, so the mutated body reaches the field validation.
    _decode_record_cleanly(seal_record(CREDS, body))


_SPEC = GroupSpec(run_id="golden-run", fragment=2, round=7, members=("a", "b", "c", "d"),
                  weights=(1.0,) * 4, numel=256, codec="int8", block_size=16, chunk_numel=64)


@settings(FUZZ, max_examples=300)
@given(data=mutated(FRAMES), sender=st.integers(1, 3))
def test_round_fails_cleanly_on_whatever_a_peer_sends(data: bytes, sender: int) -> None:
    rnd = AllReduceRound(_SPEC, 0, torch.zeros(256), timeout=10.0)
    rnd.start(0.0)
    try:
        msgs = FrameDecoder().feed(data)
    except RemoteProtocolError:
        return
    for msg in msgs:
        rnd.receive(sender, msg, 1.0)  # a RemoteProtocolError here would be a crash too
    assert rnd.state in (RoundState.RUNNING, RoundState.FAILED)


def _peak_bytes(fn: Any) -> int:
    tracemalloc.start()
    try:
        fn()
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak


def test_size_caps_hold_before_allocation() -> None:
    def huge_frame() -> None:
        with pytest.raises(RemoteProtocolError, match="2147483648 bytes > max_frame_bytes"):
            FrameDecoder().feed(b"\x80\x00\x00\x00")  # announces 2 GiB

    def huge_bin() -> None:  # a body announcing a 2 GiB byte string, then 3 bytes
        with pytest.raises(RemoteProtocolError, match="not valid msgpack"):
            decode_message(b"\x81\xa1p\xc6\x80\x00\x00\x00abc")

    def huge_array() -> None:  # an array header announcing 4G elements
        with pytest.raises(RemoteProtocolError, match="not valid msgpack"):
            decode_message(b"\x81\xa1p\xdd\xff\xff\xff\xff\x00")

    def huge_numel() -> None:
        meta = CodecMeta(codec="int4", numel=2**40, block_size=64)
        with pytest.raises(CodecError, match="must be"):
            get_codec("int4", 64).decode(b"\x00" * 16, meta)

    def huge_record() -> None:
        with pytest.raises(ValueError, match="bytes >"):
            decode_record(PeerRecord, b"\x00" * (1 << 20), CREDS)
        with pytest.raises(ValueError, match="PeerRecord"):
            decode_record(PeerRecord, b"\xdd\xff\xff\xff\xff", CREDS)

    for case in (huge_frame, huge_bin, huge_array, huge_numel):
        assert _peak_bytes(case) < 1 << 20, case.__name__
    # The record check itself gets a 1 MiB input; what matters is nothing near 4G elements.
    assert _peak_bytes(huge_record) < 4 << 20


def test_decoder_refuses_to_be_fed_after_an_error() -> None:
    dec = FrameDecoder()
    with pytest.raises(RemoteProtocolError):
        dec.feed(b"\x00\x00\x00\x00")
    with pytest.raises(LocalProtocolError):
        dec.feed(FRAMES[0])


def test_seeds_are_the_golden_vectors() -> None:
    names = {v["file"] for v in json.loads((VECTORS / "vectors.json").read_text())["vectors"]}
    assert len(FRAMES) == len(names) >= 8
