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
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np

from dilonode.wire.errors import LocalProtocolError, RemoteProtocolError, one_line
from dilonode.wire.messages import Message, message_from_dict, message_to_dict

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "HEADER_BYTES",
    "FrameDecoder",
    "decode_message",
    "FrameParts",
    "encode_frame",
    "encode_frame_parts",
    "encode_message",
]

DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024
HEADER_BYTES = 4
_HEADER = struct.Struct(">I")
# Compact only when the consumed prefix is large, so many small frames in one feed() cost
# linear rather than quadratic copying.
_COMPACT_AT = 1 << 16
_COLLECT_AT = 1 << 16  # bodies at least this large are collected piecewise
_SHARE_AT = 1 << 16  # a bin value this large in a collected body is a view, not a copy
_MAX_DEPTH = 32  # nesting a body may have for the zero-copy parser (ours have 2 levels)

# One frame as pieces whose concatenation is the frame (see `encode_frame_parts`).
FrameParts = tuple[bytes, ...]


def _bin_header(n: int) -> bytes:
    """msgpack's smallest bin header for `n` bytes (bin 8/16/32), as packb writes it."""
    if n < 1 << 8:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 1 << 16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def _body_parts(msg: Message) -> list[bytes]:
    """The msgpack body as pieces whose concatenation is `packb(message_to_dict(msg))`.

    Byte strings are emitted as a bin header plus the object itself rather than packed, so
    joining the pieces copies a payload once instead of twice (packb, then the prefix).
    """
    packer = msgpack.Packer(use_bin_type=True)
    body = message_to_dict(msg)
    parts = [packer.pack_map_header(len(body))]
    for key, value in body.items():
        parts.append(packer.pack(key))
        if isinstance(value, bytes | memoryview):
            parts += [_bin_header(len(value)), value]
        else:
            parts.append(packer.pack(value))
    return parts


def encode_message(msg: Message) -> bytes:
    """The msgpack body of `msg` (no length prefix)."""
    return b"".join(_body_parts(msg))


def encode_frame_parts(msg: Message, *,
                       max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> FrameParts:
    """`encode_frame(msg)` as pieces to write one after the other (`writelines`).

    The small pieces around each payload are joined, but a payload stays the message's own
    bytes object: a sender writes a large chunk without copying it into a frame first.
    """
    parts = _body_parts(msg)
    length = sum(len(p) for p in parts)
    if length > max_frame_bytes:
        raise LocalProtocolError(
            f"encode_frame: {msg.type} body is {length} bytes > max_frame_bytes "
            f"{max_frame_bytes}; use smaller chunks")
    out: list[bytes] = []
    small: list[bytes] = [_HEADER.pack(length)]
    for part in parts:
        if len(part) >= _COLLECT_AT:
            out += [b"".join(small), part]
            small = []
        else:
            small.append(part)
    if small:
        out.append(b"".join(small))
    return tuple(out)


def encode_frame(msg: Message, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """Length prefix + msgpack body; LocalProtocolError if we would send an oversize frame."""
    return b"".join(encode_frame_parts(msg, max_frame_bytes=max_frame_bytes))


# msgpack type byte -> width of the length field (bin, str, ext), and -> whole size of the
# fixed-size types (nil, bools, numbers, fixext); `_object_end` handles the rest.
_SIZED = {0xc4: 1, 0xc5: 2, 0xc6: 4, 0xd9: 1, 0xda: 2, 0xdb: 4, 0xc7: 1, 0xc8: 2, 0xc9: 4}
_FIXED = {0xc0: 1, 0xc2: 1, 0xc3: 1, 0xca: 5, 0xcb: 9, 0xcc: 2, 0xcd: 3, 0xce: 5, 0xcf: 9,
          0xd0: 2, 0xd1: 3, 0xd2: 5, 0xd3: 9, 0xd4: 3, 0xd5: 4, 0xd6: 6, 0xd7: 10, 0xd8: 18}


def _object_end(body: memoryview, pos: int, depth: int = 0) -> int:
    """Offset just past the msgpack object at `pos`; ValueError/IndexError if malformed."""
    if depth > _MAX_DEPTH:
        raise ValueError("nested too deeply")
    t = body[pos]
    if t <= 0x7f or t >= 0xe0:  # positive / negative fixint
        return pos + 1
    if 0xa0 <= t <= 0xbf:  # fixstr
        return pos + 1 + (t & 0x1f)
    if t in _FIXED:
        return pos + _FIXED[t]
    if t in _SIZED:
        width = _SIZED[t]
        n = int.from_bytes(body[pos + 1:pos + 1 + width], "big")
        return pos + 1 + width + n + (1 if t in (0xc7, 0xc8, 0xc9) else 0)  # ext: type byte
    if 0x80 <= t <= 0x9f:  # fixmap, fixarray
        count, pos = (t & 0x0f) * (2 if t <= 0x8f else 1), pos + 1
    elif t in (0xdc, 0xdd, 0xde, 0xdf):  # array 16/32, map 16/32
        width = 2 if t in (0xdc, 0xde) else 4
        count = int.from_bytes(body[pos + 1:pos + 1 + width], "big") * (2 if t >= 0xde else 1)
        pos += 1 + width
    else:
        raise ValueError(f"type byte 0x{t:02x}")
    for _ in range(count):
        pos = _object_end(body, pos, depth + 1)
    return pos


def _unpack_sharing(body: memoryview) -> dict[str, Any] | None:
    """`_unpack(body)` for a body that is a map, except that every bin value of at least
    `_SHARE_AT` bytes is a read-only view of `body` instead of a copy.

    Returns None for anything else or anything malformed, and `_unpack` then decides (and
    words the error): this only saves the payload copy of well-formed messages.
    """
    try:
        t = body[0]
        if 0x80 <= t <= 0x8f:
            count, pos = t & 0x0f, 1
        elif t == 0xde:
            count, pos = int.from_bytes(body[1:3], "big"), 3
        else:
            return None
        out: dict[str, Any] = {}
        for _ in range(count):
            key_end = _object_end(body, pos)
            key = msgpack.unpackb(body[pos:key_end], raw=False)
            end = _object_end(body, key_end)
            t = body[key_end]
            start = key_end + 1 + _SIZED.get(t, 0)
            if not isinstance(key, str) or end > len(body):
                return None
            if t in (0xc5, 0xc6) and end - start >= _SHARE_AT:
                out[key] = body[start:end].toreadonly()
            else:
                out[key] = msgpack.unpackb(body[key_end:end], raw=False, use_list=True,
                                           strict_map_key=True)
            pos = end
        return out if pos == len(body) else None
    except (IndexError, ValueError, TypeError, msgpack.UnpackException):
        return None


def _unpack(body: bytes | memoryview) -> object:
    try:
        return msgpack.unpackb(body, raw=False, use_list=True, strict_map_key=True)
    except msgpack.ExtraData:
        raise RemoteProtocolError("frame body has trailing bytes after the msgpack map") from None
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        # ValueError covers msgpack's FormatError/StackError/OutOfData and bad UTF-8.
        reason = one_line(f"{type(exc).__name__}: {exc}".rstrip(": "), 120)
        raise RemoteProtocolError(f"frame body is not valid msgpack ({reason})") from None


def decode_message(body: bytes | memoryview, *, run_id: str | None = None,
                   share: bool = False) -> Message:
    """Decode and validate one frame body; with `run_id`, also require that run.

    With `share`, a large payload is a read-only view of `body` rather than a copy (the
    caller hands the body's buffer over to the message and never writes to it again).
    """
    fields = _unpack_sharing(memoryview(body)) if share else None
    msg = message_from_dict(_unpack(body) if fields is None else fields)
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
        # A large body is copied once, as it arrives, into a buffer of its own (`_body`,
        # uninitialized: every byte is overwritten), whose payload the message then shares
        # (`decode_message(share=True)`): no regrowing `_buf` piece by piece, no joining
        # pieces, and no copy of the payload out of the body.
        self._body: memoryview | None = None
        self._collecting = False
        self._have = 0
        self._failed: RemoteProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a complete frame."""
        return len(self._buf) - self._pos + self._have

    def feed(self, data: bytes | bytearray | memoryview) -> list[Message]:
        """Append `data`; return the messages it completed (possibly none)."""
        return [msg for msg, _ in self.feed_sized(data)]

    def feed_sized(self, data: bytes | bytearray | memoryview) -> list[tuple[Message, int]]:
        """Like `feed`, with each message's whole frame size (header included) in bytes."""
        return list(self.feed_iter(data))

    def feed_iter(self, data: bytes | bytearray | memoryview,
                  ) -> Iterator[tuple[Message, int]]:
        """Append `data`, then yield (message, frame size) as each frame completes.

        Unlike `feed`, the messages before a bad frame are yielded before the error is
        raised, so a caller learns e.g. who said hello before sending garbage.
        """
        if self._failed is not None:
            raise LocalProtocolError(f"FrameDecoder.feed after error: {self._failed.reason}")
        try:
            if self._collecting:
                rest = self._collect(data)
                if rest is None:
                    return
                self._buf += rest  # before yielding: the caller may reuse `data` afterwards
                data = b""
                self.frames_decoded += 1
                yield self._finish_collected()
            self._buf += data
            while (item := self._next_message()) is not None:
                self.frames_decoded += 1
                yield item
        except RemoteProtocolError as exc:
            self._fail(exc)
            raise
        finally:
            if self._pos >= _COMPACT_AT or self._pos == len(self._buf):
                del self._buf[: self._pos]
                self._pos = 0

    def collect_buffer(self) -> memoryview | None:
        """Where the rest of a large frame body goes, while one is being collected.

        A reader may write received bytes straight into it (`asyncio.BufferedProtocol`) and
        then call `collected(n)`, instead of `feed`ing a copy of them; None otherwise.
        """
        if not self._collecting or self._failed is not None:
            return None
        assert self._body is not None and self._need is not None
        return self._body[self._have:self._need]

    def collected(self, n: int) -> tuple[Message, int] | None:
        """`n` bytes were written at the start of `collect_buffer()`; the message and its
        frame size if that completed the body."""
        if not self._collecting or self._need is None or not 0 < n <= (
                self._need - self._have):
            raise LocalProtocolError(f"FrameDecoder.collected({n}) outside a collect_buffer")
        self._have += n
        if self._have < self._need:
            return None
        try:
            item = self._finish_collected()
        except RemoteProtocolError as exc:
            self._fail(exc)
            raise
        self.frames_decoded += 1
        return item

    def _fail(self, exc: RemoteProtocolError) -> None:
        self._failed = exc
        self._buf, self._pos, self._collecting, self._have = bytearray(), 0, False, 0
        self._body = None

    def _start_collect(self) -> None:
        """Move the start of a large, incomplete body from `_buf` into `_body`."""
        assert self._need is not None
        self._body = memoryview(np.empty(self._need, dtype=np.uint8).data)
        available = len(self._buf) - self._pos
        with memoryview(self._buf) as view:
            self._body[:available] = view[self._pos:]
        self._have = available
        self._pos = len(self._buf)
        self._collecting = True

    def _collect(self, data: bytes | bytearray | memoryview) -> memoryview | None:
        """Copy `data` into the large body; None while incomplete, else the bytes after it."""
        assert self._need is not None and self._body is not None
        view = memoryview(data).cast("B")
        take = min(self._need - self._have, len(view))
        self._body[self._have:self._have + take] = view[:take]
        self._have += take
        return None if self._have < self._need else view[take:]

    def _finish_collected(self) -> tuple[Message, int]:
        assert self._need is not None and self._body is not None
        body, length = self._body, self._need
        self._collecting, self._have, self._need, self._body = False, 0, None, None
        return decode_message(body, run_id=self.run_id, share=True), HEADER_BYTES + length

    def _next_message(self) -> tuple[Message, int] | None:
        if self._need is None:
            if len(self._buf) - self._pos < HEADER_BYTES:
                return None
            (length,) = _HEADER.unpack_from(self._buf, self._pos)
            if length > self.max_frame_bytes:
                raise RemoteProtocolError(
                    f"frame announces {length} bytes > max_frame_bytes {self.max_frame_bytes}")
            if length == 0:
                raise RemoteProtocolError("frame announces an empty body")
            self._pos += HEADER_BYTES
            self._need = length
        available = len(self._buf) - self._pos
        if available < self._need:
            if self._need >= _COLLECT_AT:  # large and incomplete: collect it from now on
                self._start_collect()
            return None
        length, start = self._need, self._pos
        self._pos += length
        self._need = None
        # Unpack straight from the buffer: msgpack copies the payload out once, and both
        # views are released before the buffer is resized.
        with memoryview(self._buf) as view, view[start:start + length] as body:
            return decode_message(body, run_id=self.run_id), HEADER_BYTES + length
