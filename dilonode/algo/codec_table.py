"""The codecs dilonode speaks, one row each, and what every other module reads about them.

The arithmetic of a codec lives in `codecs.py` (CPU) and `torch_codecs.py` (any device);
this table names each wire format with the properties the rest of the code asks about: the
payload bits per value, the IEEE type of a raw float format or the quantizer of a block
format, its largest quantized magnitude and its default block size. The config validates
`codec.name` against it, the CLI builds its help from it, the splicer of encodings
(`sliced_encoding.py`) sizes codes with it and the tests parametrize over it, so adding a
codec is a row here plus its arithmetic. Imports nothing heavy (no torch, no numba): the
CLI and the config read it at start-up.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

__all__ = [
    "BLOCK_CODEC_NAMES",
    "CODECS",
    "CODEC_NAMES",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_CODEC",
    "FLOAT_CODEC_NAMES",
    "SCALE_BYTES",
    "CodecSpec",
    "unknown_codec_message",
]

# Values per absmax scale of a block codec when nothing says otherwise.
DEFAULT_BLOCK_SIZE = 64
# Bytes of one block scale (a little-endian float32) at the head of a block codec's data.
SCALE_BYTES = 4


@dataclass(frozen=True)
class CodecSpec:
    """One wire format. Exactly one of `float_dtype` and `quantizer` is set."""

    name: str
    """What `CodecMeta.codec`, the wire's `codec` field and `codec.name` in a config say."""
    bits: int
    """Payload bits per value; a block codec's scales come on top (`SCALE_BYTES` a block)."""
    float_dtype: Literal["float32", "bfloat16", "float16"] | None
    """The IEEE type (a `torch` dtype name) whose raw little-endian values are the payload;
    None for a block codec."""
    quantizer: Literal["int", "fp4", "sign"] | None
    """A block codec's levels: "int" is symmetric integers in [-qmax, qmax], "fp4" a sign
    and a 3-bit exponent (magnitudes 0 and 2**-6 .. 1), "sign" one bit, +-scale with the
    block's mean magnitude as its scale; None for a float codec."""
    qmax: float
    """A block codec's largest quantized magnitude: scale = block absmax / qmax ("sign":
    1, its scale is the block's mean |x|)."""
    default_block_size: int
    """Values per scale when none is given; 1 for a float codec (no scales)."""
    summary: str
    """One line for help texts."""

    @property
    def is_block(self) -> bool:
        """Absmax-scaled blocks (scales first, then codes) rather than raw float values."""
        return self.quantizer is not None

    @property
    def codes_per_byte(self) -> int:
        """Codes packed into one payload byte (block codecs: 1 for 8 bits, 2 for 4, 4 for 2,
        8 for 1): a block size must be a multiple of it."""
        return max(1, 8 // self.bits)

    def payload_bytes(self, numel: int) -> int:
        """Bytes of the codes of `numel` values (scales not counted): bits rounded up."""
        return -(-numel * self.bits // 8)


def _float(name: Literal["float32", "bfloat16", "float16"], bits: int,
           summary: str) -> CodecSpec:
    return CodecSpec(name=name, bits=bits, float_dtype=name, quantizer=None, qmax=0.0,
                     default_block_size=1, summary=summary)


def _block(name: str, bits: int, quantizer: Literal["int", "fp4", "sign"], qmax: float,
           summary: str) -> CodecSpec:
    return CodecSpec(name=name, bits=bits, float_dtype=None, quantizer=quantizer, qmax=qmax,
                     default_block_size=DEFAULT_BLOCK_SIZE, summary=summary)


CODECS: Mapping[str, CodecSpec] = MappingProxyType({spec.name: spec for spec in (
    _float("float32", 32, "raw float32, bit-exact"),
    _float("bfloat16", 16, "raw bfloat16, round to nearest even"),
    _float("float16", 16, "raw float16, round to nearest even; refuses overflow"),
    _block("int8", 8, "int", 127.0, "blockwise absmax int8 in [-127, 127]"),
    _block("int4", 4, "int", 7.0, "blockwise absmax int4 in [-7, 7], two per byte"),
    _block("fp4", 4, "fp4", 1.0, "blockwise absmax sign + 3-bit exponent, two per byte"),
    _block("int2", 2, "int", 1.0, "blockwise absmax ternary {-1, 0, 1}, four per byte"),
    _block("sign1", 1, "sign", 1.0, "blockwise sign times the block's mean |x|, eight per byte"),
)})
"""Every codec by name, in the order help texts and tests list them."""

CODEC_NAMES: tuple[str, ...] = tuple(CODECS)
FLOAT_CODEC_NAMES: tuple[str, ...] = tuple(n for n, s in CODECS.items() if not s.is_block)
BLOCK_CODEC_NAMES: tuple[str, ...] = tuple(n for n, s in CODECS.items() if s.is_block)
# What a run uses unless its config says otherwise (`CodecConfig.name`).
DEFAULT_CODEC = "int4"


def unknown_codec_message(name: object) -> str:
    """The one-line refusal of a codec name that is not in the table."""
    return f"unknown codec {name!r}; expected one of {', '.join(CODEC_NAMES)}"
