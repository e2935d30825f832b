"""Optional coverage-guided fuzzing of the wire decoders with atheris (libFuzzer).

The suite's fuzzing is tests/unit/test_fuzz_wire.py (hypothesis); this script digs longer
and deeper when atheris is available (`pip install atheris`, wheels for CPython/x86-64
Linux). The first input byte picks the decoder: frame stream, message body, codec payload
(codec, block and numel from the next bytes) or a DHT record. Every input must end in a
value or the decoder's own rejection; anything else is a crash that libFuzzer reports with
the input that caused it. Seeds are the golden vectors.

    .venv/bin/python tests/fuzz_atheris.py -max_total_time=60 -rss_limit_mb=2048
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from pathlib import Path

import atheris
import msgpack  # noqa: F401  (imported first so that only dilonode gets instrumented)
import pydantic  # noqa: F401
import torch  # noqa: F401

with atheris.instrument_imports(include=["dilonode"]):
    from dilonode.algo.codec_table import CODEC_NAMES, FLOAT_CODEC_NAMES
    from dilonode.algo.codec_table import CODECS as SPECS
    from dilonode.algo.codecs import CodecError, CodecMeta, get_codec
    from dilonode.net.auth import Credentials, Identity
    from dilonode.swarm.records import GroupEntry, PeerRecord, decode_record
    from dilonode.wire.errors import RemoteProtocolError
    from dilonode.wire.framing import FrameDecoder, decode_message

VECTORS = Path(__file__).resolve().parents[1] / "protocol" / "vectors"
# Small blocks, so that short payloads hold several.
def _small_block(per: int) -> int:
    """A small block size that is a multiple of `per` codes per byte: 16 int8 values, 8
    4-bit ones, 4 int2 ones, 8 sign1 ones."""
    return per * max(1, 16 // per // per)


CODECS = [(name, 64 if name in FLOAT_CODEC_NAMES else _small_block(SPECS[name].codes_per_byte))
          for name in CODEC_NAMES]
CREDS = Credentials(Identity.generate(), "fuzz-run")


def _codec(data: bytes) -> None:
    if len(data) < 2:
        return
    name, block = CODECS[data[0] % len(CODECS)]
    codec = get_codec(name, block)
    meta = CodecMeta(codec=name, numel=data[1], block_size=codec.block_size)
    with contextlib.suppress(CodecError):
        codec.decode(data[2:], meta)


def _record(data: bytes) -> None:
    for kind in (PeerRecord, GroupEntry):
        try:
            decode_record(kind, data, CREDS)
        except ValueError as exc:
            if "\n" in str(exc):
                raise AssertionError(f"multi-line record error: {exc!r}") from None


def test_one(data: bytes) -> None:
    if not data:
        return
    which, rest = data[0] % 4, data[1:]
    try:
        if which == 0:
            FrameDecoder(max_frame_bytes=1 << 16).feed(rest)
        elif which == 1:
            decode_message(rest)
    except RemoteProtocolError:
        return
    if which == 2:
        _codec(rest)
    elif which == 3:
        _record(rest)


def main() -> None:
    corpus = Path(tempfile.mkdtemp(prefix="dilonode-fuzz-"))
    for i, path in enumerate(sorted(VECTORS.glob("*.bin"))):
        frame = path.read_bytes()
        (corpus / f"frame{i}").write_bytes(b"\x00" + frame)
        (corpus / f"body{i}").write_bytes(b"\x01" + frame[4:])
    atheris.Setup([*sys.argv, str(corpus)], test_one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
