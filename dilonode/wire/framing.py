"""Length-prefixed msgpack framing: turning messages into bytes on a stream and back.

A frame is a 4-byte big-endian body length followed by the msgpack body (a map, see
messages.py). `encode_frame` builds one; `FrameDecoder.feed` takes bytes as they arrive, in
any split, and returns the complete messages. The decoder checks the announced length
against `max_frame_bytes` as soon as the 4 header bytes are in, so a hostile peer cannot
make us buffer or allocate a huge body. Every problem in peer data raises
`RemoteProtocolError`; after one the stream is unusable and the connection must be dropped.

No I/O here: the transport reads and writes, this module only transforms bytes.
"""

from __future__ import annotations

import struct

import msgpack

from dilonode.wire.errors import LocalProtocolError, RemoteProtocolError, one_line
from dilonode.wire.messages import Message, message_from_dict, message_to_dict

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "HEADER_BYTES",
    "FrameDecoder",
    "decode_message",
    "encode_frame",
    "encode_message",
]

DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024
HEADER_BYTES = 4
_HEADER = struct.Struct(">I")
# Compact only when the consumed prefix is large, so many small frames in one feed() cost
# linear rather than quadratic copying.
_COMPACT_AT = 1 << 16


def encode_message(msg: Message) -> bytes:
    """The msgpack body of `msg` (no length prefix)."""
    return msgpack.packb(message_to_dict(msg), use_bin_type=True)


def encode_frame(msg: Message, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """Length prefix + msgpack body; LocalProtocolError if we would send an oversize frame."""
    body = encode_message(msg)
    if len(body) > max_frame_bytes:
        raise LocalProtocolError(
            f"encode_frame: {msg.type} body is {len(body)} bytes > max_frame_bytes "
            f"{max_frame_bytes}; use smaller chunks")
    return _HEADER.pack(len(body)) + body


def _unpack(body: bytes) -> object:
    try:
        return msgpack.unpackb(body, raw=False, use_list=True, strict_map_key=True)
    except msgpack.ExtraData:
        raise RemoteProtocolError("frame body has trailing bytes after the msgpack map") from None
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        # ValueError covers msgpack's FormatError/StackError/OutOfData and bad UTF-8.
        reason = one_line(f"{type(exc).__name__}: {exc}".rstrip(": "), 120)
        raise RemoteProtocolError(f"frame body is not valid msgpack ({reason})") from None


def decode_message(body: bytes, *, run_id: str | None = None) -> Message:
    """Decode and validate one frame body; with `run_id`, also require that run."""
    msg = message_from_dict(_unpack(body))
    if run_id is not None and msg.run_id != run_id:
        raise RemoteProtocolError(
            f"{msg.type} message for run {one_line(repr(msg.run_id), 140)}, "
            f"expected {run_id!r}")
    return msg


class FrameDecoder:
    """Incremental decoder for one peer's byte stream.

    `feed(data)` appends bytes and returns every message completed by them. An error leaves
    the decoder failed; feeding it again is a LocalProtocolError (the caller should have
    dropped the connection).
    """

    def __init__(self, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 run_id: str | None = None) -> None:
        if max_frame_bytes < 1:
            raise ValueError(f"FrameDecoder: max_frame_bytes={max_frame_bytes}: must be >= 1")
        self.max_frame_bytes = max_frame_bytes
        self.run_id = run_id
        self.frames_decoded = 0
        self._buf = bytearray()
        self._pos = 0
        self._need: int | None = None  # body length of the frame in progress, once known
        self._failed: RemoteProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a complete frame."""
        return len(self._buf) - self._pos

    def feed(self, data: bytes | bytearray | memoryview) -> list[Message]:
        """Append `data`; return the messages it completed (possibly none)."""
        if self._failed is not None:
            raise LocalProtocolError(f"FrameDecoder.feed after error: {self._failed.reason}")
        self._buf += data
        out: list[Message] = []
        try:
            while (body := self._next_body()) is not None:
                out.append(decode_message(body, run_id=self.run_id))
                self.frames_decoded += 1
        except RemoteProtocolError as exc:
            self._failed = exc
            self._buf = bytearray()
            self._pos = 0
            raise
        if self._pos >= _COMPACT_AT or self._pos == len(self._buf):
            del self._buf[: self._pos]
            self._pos = 0
        return out

    def _next_body(self) -> bytes | None:
        if self._need is None:
            if self.buffered < HEADER_BYTES:
                return None
            (length,) = _HEADER.unpack_from(self._buf, self._pos)
            if length > self.max_frame_bytes:
                raise RemoteProtocolError(
                    f"frame announces {length} bytes > max_frame_bytes {self.max_frame_bytes}")
            if length == 0:
                raise RemoteProtocolError("frame announces an empty body")
            self._pos += HEADER_BYTES
            self._need = length
        if self.buffered < self._need:
            return None
        with memoryview(self._buf) as view:
            body = bytes(view[self._pos: self._pos + self._need])
        self._pos += self._need
        self._need = None
        return body
