"""Tests of dilonode.wire: message round trips, stream framing, rejections, golden vectors."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dilonode import PROTOCOL_VERSION
from dilonode.algo.codec_table import CODEC_NAMES
from dilonode.algo.codecs import CodecMeta, get_codec
from dilonode.wire import framing
from dilonode.wire.errors import LocalProtocolError, RemoteProtocolError
from dilonode.wire.framing import FrameDecoder, decode_message, encode_frame, encode_message
from dilonode.wire.messages import (
    Abort,
    Contribution,
    Hello,
    HelloAck,
    HelloAuth,
    Message,
    Result,
    message_from_dict,
    message_to_dict,
    message_to_json,
)

VECTORS = Path(__file__).resolve().parents[2] / "protocol" / "vectors"

_u32 = st.integers(0, 2**32 - 1)
_member = st.integers(0, 4095)
_envelope = {
    "run_id": st.text(min_size=1, max_size=128),
    "fragment": _u32,
    "round": st.integers(0, 2**63 - 1),
    "attempt": _u32,
    "group": st.one_of(st.just(""), st.text("0123456789abcdef", min_size=64, max_size=64)),
    "sender": _member,
}


@st.composite
def _chunk_fields(draw: st.DrawFn) -> dict[str, Any]:
    n_chunks = draw(st.integers(1, 2**32 - 1))
    return {
        "owner": draw(_member),
        "chunk": draw(st.integers(0, n_chunks - 1)),
        "n_chunks": n_chunks,
        "offset": draw(st.integers(0, 2**63 - 1)),
        "numel": draw(st.integers(1, 2**32 - 1)),
        "codec": draw(st.sampled_from(CODEC_NAMES)),
        "block_size": draw(st.integers(1, 1 << 20)),
        "payload": draw(st.binary(max_size=300)),
    }


@st.composite
def contributions(draw: st.DrawFn) -> Contribution:
    return Contribution(**draw(st.fixed_dictionaries(_envelope)), **draw(_chunk_fields()),
                        weight=draw(st.floats(0.0, 1e15)))


@st.composite
def results(draw: st.DrawFn) -> Result:
    fields = draw(_chunk_fields())
    last = fields["chunk"] == fields["n_chunks"] - 1
    digest = draw(st.text("0123456789abcdef", min_size=64, max_size=64)) if last else None
    return Result(**draw(st.fixed_dictionaries(_envelope)), **fields, digest=digest,
                  contributors=tuple(draw(st.lists(_member, min_size=1, max_size=20))))


@st.composite
def aborts(draw: st.DrawFn) -> Abort:
    return Abort(**draw(st.fixed_dictionaries(_envelope)), reason=draw(st.text(max_size=256)),
                 culprits=tuple(draw(st.lists(_member, max_size=10))))


@st.composite
def hellos(draw: st.DrawFn) -> Hello:
    return Hello(run_id=draw(st.text(min_size=1, max_size=128)),
                 peer_id=draw(st.text(min_size=1, max_size=128)),
                 public_key=draw(st.binary(max_size=1024)), nonce=draw(st.binary(max_size=64)))


@st.composite
def hello_acks(draw: st.DrawFn) -> HelloAck:
    return HelloAck(run_id=draw(st.text(min_size=1, max_size=128)),
                    peer_id=draw(st.text(min_size=1, max_size=128)),
                    public_key=draw(st.binary(max_size=1024)),
                    nonce=draw(st.binary(max_size=64)), signature=draw(st.binary(max_size=512)),
                    mac=draw(st.binary(max_size=64)))


@st.composite
def auths(draw: st.DrawFn) -> HelloAuth:
    return HelloAuth(run_id=draw(st.text(min_size=1, max_size=128)),
                     signature=draw(st.binary(max_size=512)), mac=draw(st.binary(max_size=64)))


messages = st.one_of(contributions(), results(), aborts(), hellos(), hello_acks(), auths())


def _contribution(**update: Any) -> Contribution:
    fields: dict[str, Any] = {
        "run_id": "run", "fragment": 1, "round": 4, "sender": 2, "owner": 0, "chunk": 0,
        "n_chunks": 1, "offset": 0, "numel": 4, "codec": "float32", "block_size": 64,
        "weight": 1.0, "payload": bytes(16)}
    fields.update(update)
    return Contribution(**fields)


def _body(**update: Any) -> bytes:
    body = message_to_dict(_contribution())
    body.update(update)
    return msgpack.packb({k: v for k, v in body.items() if v is not ...}, use_bin_type=True)


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def _reason(body: bytes, **kwargs: Any) -> str:
    with pytest.raises(RemoteProtocolError) as info:
        decode_message(body, **kwargs)
    assert "\n" not in info.value.reason
    return info.value.reason


# ---------------------------------------------------------------------- round trips


@settings(max_examples=150, deadline=None)
@given(messages)
def test_message_round_trip(msg: Message) -> None:
    frame = encode_frame(msg)
    assert struct.unpack(">I", frame[:4])[0] == len(frame) - 4
    back = decode_message(frame[4:])
    assert back == msg
    assert type(back) is type(msg)
    assert encode_frame(back) == frame


@settings(max_examples=60, deadline=None)
@given(st.lists(messages, min_size=1, max_size=6), st.data())
def test_decoder_handles_any_split(msgs: list[Message], data: st.DataObject) -> None:
    stream = b"".join(encode_frame(m) for m in msgs)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=12)))
    decoder = FrameDecoder()
    out: list[Message] = []
    for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        out += decoder.feed(stream[a:b])
    assert out == msgs
    assert decoder.buffered == 0
    assert decoder.frames_decoded == len(msgs)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 200_000), min_size=1, max_size=4), st.data())
def test_decoder_handles_large_frames_in_any_split(sizes: list[int],
                                                  data: st.DataObject) -> None:
    # Bodies >= 64 KiB are collected piecewise; check that path, and what follows it.
    msgs = [_contribution(chunk=i, n_chunks=len(sizes), payload=bytes([i]) * n)
            for i, n in enumerate(sizes)]
    frames = [encode_frame(m) for m in msgs]
    stream = b"".join(frames)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=20)))
    decoder = FrameDecoder()
    out: list[tuple[Message, int]] = []
    for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        out += decoder.feed_sized(bytearray(stream[a:b]))  # a buffer the caller may reuse
    assert [m for m, _ in out] == msgs
    assert [n for _, n in out] == [len(f) for f in frames]
    assert decoder.buffered == 0


@pytest.mark.parametrize("n", [0, 255, 256, 65535, 65536, 70000])
def test_encoding_is_exactly_msgpacks(n: int) -> None:
    msg = _contribution(payload=bytes(n))
    assert encode_message(msg) == msgpack.packb(message_to_dict(msg), use_bin_type=True)
    assert encode_frame(msg) == struct.pack(">I", len(encode_message(msg))) + encode_message(
        msg)


def test_feed_iter_yields_the_frames_before_a_bad_one() -> None:
    decoder = FrameDecoder()
    good = encode_frame(Hello(run_id="r", peer_id="p"))
    it = decoder.feed_iter(good + _frame(b"\xc1"))
    assert next(it)[0] == Hello(run_id="r", peer_id="p")
    with pytest.raises(RemoteProtocolError, match="not valid msgpack"):
        next(it)
    with pytest.raises(LocalProtocolError):
        decoder.feed(b"")


def test_decoder_byte_by_byte_and_coalesced() -> None:
    msgs = [_contribution(chunk=i, n_chunks=3) for i in range(3)]
    stream = b"".join(encode_frame(m) for m in msgs)
    decoder = FrameDecoder()
    out = [m for i in range(len(stream)) for m in decoder.feed(stream[i:i + 1])]
    assert out == msgs
    assert FrameDecoder().feed(stream * 2) == msgs * 2


def test_digest_none_is_omitted_and_contributors_are_tuples() -> None:
    r = Result(run_id="r", fragment=0, round=0, sender=1, owner=1, chunk=0, n_chunks=2,
               offset=0, numel=1, codec="int4", block_size=64, contributors=[0, 1],
               payload=b"\x00" * 5)
    assert "digest" not in message_to_dict(r)
    assert r.contributors == (0, 1)
    assert decode_message(encode_message(r)) == r


# ---------------------------------------------------------------------- rejections


def test_garbage_is_rejected() -> None:
    assert "not valid msgpack" in _reason(b"\xc1")
    assert "not valid msgpack" in _reason(b"\x85\xa4type")  # truncated map
    assert "trailing bytes" in _reason(_body() + b"\x00")
    assert "expected a map" in _reason(msgpack.packb([1, 2, 3]))
    assert "non-string key" in _reason(msgpack.packb({b"type": 1}, use_bin_type=True))


def test_oversize_length_is_rejected_before_the_body_arrives() -> None:
    decoder = FrameDecoder(max_frame_bytes=1000)
    assert decoder.feed(b"\x00\x00") == []
    with pytest.raises(RemoteProtocolError, match="1001 bytes > max_frame_bytes 1000"):
        decoder.feed(b"\x03\xe9")  # only the header: nothing of the body was sent
    assert decoder.buffered == 0
    with pytest.raises(LocalProtocolError):
        decoder.feed(b"more")
    with pytest.raises(RemoteProtocolError, match="announces 4294967295 bytes"):
        FrameDecoder().feed(b"\xff\xff\xff\xff")


def test_empty_frame_and_bad_frame_in_stream() -> None:
    with pytest.raises(RemoteProtocolError, match="empty body"):
        FrameDecoder().feed(b"\x00\x00\x00\x00")
    good = encode_frame(_contribution())
    with pytest.raises(RemoteProtocolError, match="not valid msgpack"):
        FrameDecoder().feed(good + _frame(b"\xc1"))


def test_wrong_version_names_expected_and_got() -> None:
    reason = _reason(_body(version=PROTOCOL_VERSION + 1))
    assert reason == (f"protocol version mismatch: expected {PROTOCOL_VERSION}, "
                      f"got {PROTOCOL_VERSION + 1}")
    assert "version mismatch" in _reason(_body(version="1"))
    # Checked before the fields, so a future message shape still reports the version.
    future = msgpack.packb({"type": "contribution", "version": 99, "new_field": 1})
    assert f"expected {PROTOCOL_VERSION}, got 99" in _reason(future)


def test_wrong_run_id() -> None:
    body = _body()
    assert decode_message(body, run_id="run") == _contribution()
    assert "expected 'other'" in _reason(body, run_id="other")
    with pytest.raises(RemoteProtocolError, match="for run 'run'"):
        FrameDecoder(run_id="other").feed(_frame(body))


def test_unknown_or_missing_type() -> None:
    assert _reason(_body(type="greeting")) == "unknown message type 'greeting'"
    assert "no 'type' field" in _reason(_body(type=...))
    assert "unknown message type 5" in _reason(_body(type=5))


@pytest.mark.parametrize(("update", "needle"), [
    ({"numel": ...}, "field numel: Field required"),
    ({"version": ...}, "field version: missing"),
    ({"sender": True}, "field sender"),
    ({"sender": 4096}, "field sender"),
    ({"numel": 0}, "field numel"),
    ({"offset": -1}, "field offset"),
    ({"chunk": 3, "n_chunks": 2}, "field chunk: 3 must be < n_chunks 2"),
    ({"payload": "text"}, "field payload"),
    ({"codec": "INT4"}, "field codec"),
    ({"run_id": ""}, "field run_id"),
    ({"extra": 1}, "field extra: Extra inputs are not permitted"),
    ({"fragment": 1.0}, "field fragment"),
])
def test_invalid_fields_name_the_field(update: dict[str, Any], needle: str) -> None:
    reason = _reason(_body(**update))
    assert reason.startswith("invalid contribution message: ")
    assert needle in reason


def test_round_messages_must_carry_attempt_and_group() -> None:
    assert "field attempt: missing" in _reason(_body(attempt=...))
    assert "field group: missing" in _reason(_body(group=...))
    assert "field group" in _reason(_body(group="ab" * 31))
    assert "field attempt" in _reason(_body(attempt=-1))
    # Hello has neither: it is not about a round.
    hello = msgpack.packb({"type": "hello", "version": PROTOCOL_VERSION, "run_id": "r",
                           "peer_id": "p"})
    assert decode_message(hello) == Hello(run_id="r", peer_id="p")
    assert "field peer_id" in _reason(msgpack.packb(
        {"type": "hello", "version": PROTOCOL_VERSION, "run_id": "r", "peer_id": ""}))
    assert "version mismatch" in _reason(msgpack.packb(
        {"type": "hello", "version": PROTOCOL_VERSION + 1, "run_id": "r", "peer_id": "p"}))


def test_abort_culprits_round_trip_as_tuples() -> None:
    a = Abort(run_id="r", fragment=0, round=0, sender=1, culprits=[2, 0])
    assert a.culprits == (2, 0)
    assert message_to_dict(a)["culprits"] == (2, 0)
    assert decode_message(encode_message(a)) == a
    body = message_to_dict(a)
    assert "field culprits" in _reason(msgpack.packb({**body, "culprits": [4096]}))


def test_feed_sized_reports_whole_frame_sizes() -> None:
    frames = [encode_frame(_contribution(chunk=i, n_chunks=2)) for i in range(2)]
    out = FrameDecoder().feed_sized(b"".join(frames))
    assert [size for _, size in out] == [len(f) for f in frames]


def test_result_digest_rules() -> None:
    base = message_to_dict(Result(
        run_id="r", fragment=0, round=0, sender=0, owner=0, chunk=1, n_chunks=2, offset=8,
        numel=8, codec="float32", block_size=8, contributors=(0, 1), payload=bytes(32),
        digest="0" * 64))
    assert "digest: required" in _reason(msgpack.packb({**base, "digest": None}))
    assert "only the last chunk" in _reason(msgpack.packb({**base, "chunk": 0}))
    assert "field digest" in _reason(msgpack.packb({**base, "digest": "AB" * 32}))
    assert "field contributors" in _reason(msgpack.packb({**base, "contributors": []}))


def test_abort_reason_is_capped_and_reasons_are_one_line() -> None:
    body = msgpack.packb({"type": "abort", "version": PROTOCOL_VERSION, "run_id": "r",
                          "fragment": 0, "round": 0, "attempt": 0, "group": "", "sender": 0,
                          "reason": "x\n" * 200})
    reason = _reason(body)
    assert "field reason" in reason and len(reason) <= 512


def test_encode_frame_refuses_our_own_oversize_frame() -> None:
    with pytest.raises(LocalProtocolError, match="max_frame_bytes"):
        encode_frame(_contribution(payload=bytes(200)), max_frame_bytes=100)


# ---------------------------------------------------------------------- golden vectors


def _vectors() -> list[dict[str, Any]]:
    doc = json.loads((VECTORS / "vectors.json").read_text())
    assert doc["protocol_version"] == PROTOCOL_VERSION
    return doc["vectors"]


@pytest.mark.parametrize("vector", _vectors(), ids=lambda v: v["name"])
def test_golden_vector(vector: dict[str, Any]) -> None:
    frame = (VECTORS / vector["file"]).read_bytes()
    (msg,) = FrameDecoder().feed(frame)
    assert message_to_json(msg) == vector["fields"]
    assert encode_frame(msg) == frame
    if isinstance(msg, Contribution | Result):
        codec = get_codec(msg.codec, msg.block_size)
        meta = CodecMeta(codec=codec.name, numel=msg.numel, block_size=codec.block_size)
        assert codec.decode(msg.payload, meta).tolist() == vector["decoded"]
        x = torch.tensor(vector["input"], dtype=torch.float32)
        assert codec.encode(x)[0] == msg.payload


def test_golden_vectors_cover_every_message_type() -> None:
    kinds = {v["fields"]["type"] for v in _vectors()}
    assert kinds == {"contribution", "result", "abort", "hello", "hello_ack", "auth"}
    assert any("digest" in v["fields"] for v in _vectors())


# ---------------------------------------------------------------------- zero-copy payloads

_msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=40) | st.binary(max_size=40)
    | st.integers(0, 3).map(lambda k: bytes([k]) * (framing._SHARE_AT + k * 40_000)),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)


def _plain(value: Any) -> Any:
    if isinstance(value, memoryview):
        return value.tobytes()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.text(max_size=12), _msgpack_values, max_size=8))
def test_sharing_unpacker_agrees_with_msgpack(body: dict[str, Any]) -> None:
    packed = msgpack.packb(body, use_bin_type=True)
    shared = framing._unpack_sharing(memoryview(packed))
    assert shared is not None
    assert _plain(shared) == msgpack.unpackb(packed, raw=False)
    for key, value in shared.items():  # only the large top-level bins are views
        is_large_bin = isinstance(body[key], bytes) and len(body[key]) >= framing._SHARE_AT
        assert isinstance(value, memoryview) == is_large_bin
        if is_large_bin:
            assert value.readonly


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64), st.integers(0, 200))
def test_sharing_unpacker_refuses_what_msgpack_refuses(junk: bytes, cut: int) -> None:
    # Truncated, extended or random bodies: either both decoders read the same map, or the
    # sharing one gives up (None) and the copying one words the error.
    big = msgpack.packb({"type": "x", "payload": bytes(framing._SHARE_AT), "n": [1, 2]},
                        use_bin_type=True)
    for body in (junk, big[:cut], big[:-cut or None], big + junk):
        shared = framing._unpack_sharing(memoryview(body))
        if shared is not None:
            assert _plain(shared) == msgpack.unpackb(body, raw=False)


def test_sharing_unpacker_gives_up_on_deep_nesting() -> None:
    deep = b"\x81\xa1k" + b"\x91" * 5000 + b"\xc0"
    assert framing._unpack_sharing(memoryview(deep)) is None
    with pytest.raises(RemoteProtocolError, match="not valid msgpack"):
        decode_message(deep, share=True)


def test_large_payload_is_shared_with_the_frame_not_copied() -> None:
    payload = bytes(range(256)) * 1024  # 256 KiB, collected piecewise
    msg = _contribution(numel=len(payload) // 4, payload=payload)
    frame = encode_frame(msg)
    decoder = FrameDecoder()
    out = decoder.feed(frame[:1000]) + decoder.feed(frame[1000:])
    assert out == [msg]
    got = out[0]
    assert isinstance(got, Contribution) and isinstance(got.payload, memoryview)
    assert got.payload.readonly and got.payload.obj is not None
    assert encode_frame(got) == frame  # a shared payload encodes like bytes
    assert message_to_json(got) == message_to_json(msg)
    # The next large frame gets a buffer of its own: the first payload stays intact.
    zeros = bytes(len(payload))
    decoder.feed(encode_frame(_contribution(numel=len(zeros) // 4, payload=zeros)))
    assert got.payload == payload


def test_payload_must_be_bytes_or_a_read_only_byte_view() -> None:
    fields = message_to_dict(_contribution())
    for bad in (bytearray(16), memoryview(bytearray(16)), "text",
                memoryview(b"ab" * 8).cast("H")):
        with pytest.raises(RemoteProtocolError, match="field payload"):
            message_from_dict({**fields, "payload": bad})


def test_golden_reductions() -> None:
    """Another implementation's owner must derive these coefficients and means bit for bit."""
    from dilonode.algo.butterfly import reduce_weighted, weight_coefficients

    doc = json.loads((VECTORS / "vectors.json").read_text())
    assert {r["name"] for r in doc["reductions"]} >= {"equal_weights", "token_weighted"}
    for red in doc["reductions"]:
        xs = [torch.tensor(x, dtype=torch.float32) for x in red["inputs"]]
        assert weight_coefficients(red["weights"]) == red["coefficients"]
        assert reduce_weighted(xs, red["weights"]).tolist() == red["mean"]
