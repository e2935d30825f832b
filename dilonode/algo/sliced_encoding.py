"""Encodings of consecutive slices of one vector, joined into the encoding of any range.

The ranks of a node each encode their contiguous slice of the node's contribution with the
round's codec, in parallel (dilonode/train/ranks/node_ranks.py); the round then sends chunks that
cut
across those slices. Every dense wire format (algo/dense_codecs.py) is separable at block
boundaries: the float formats are one value after another, and the block formats are the
block scales (4 bytes each) followed by the codes (8 or 4 bits per value, two nibbles per byte, low
first). So, with slice boundaries on codec blocks, the encoding of values [start, end) is
the scales of its blocks then their codes, each cut from the slices' encodings, as long
as `start` is on a block boundary and `end` is on one or is the end of the vector
(`SplicedEncoding.payload`; None otherwise, and the caller encodes the chunk itself).
Pure: bytes in, bytes out.
"""

from __future__ import annotations

from dataclasses import dataclass

from dilonode.algo.codec_table import CODECS, SCALE_BYTES

__all__ = ["SplicedEncoding", "splice_supported"]

Buffer = bytes | bytearray | memoryview


def splice_supported(codec: str) -> bool:
    """Whether `codec`'s encodings can be spliced (every format of `codec_table`)."""
    return codec in CODECS


@dataclass(frozen=True)
class SplicedEncoding:
    """`parts[i]` is the codec's encoding of values `bounds[i]` of one vector (consecutive
    ranges covering it, every boundary but the last on a `block_size` multiple)."""

    codec: str
    block_size: int
    bounds: tuple[tuple[int, int], ...]
    parts: tuple[Buffer, ...]

    @property
    def numel(self) -> int:
        return self.bounds[-1][1] if self.bounds else 0

    def payload(self, start: int, numel: int) -> bytes | None:
        """The encoding of values [start, start + numel), or None if the range is not
        block-aligned (or out of range)."""
        end = start + numel
        aligned = start % self.block_size == 0 and (end % self.block_size == 0
                                                     or end == self.numel)
        if not aligned or start < 0 or end > self.numel or numel <= 0:
            return None
        scales, codes = [], []
        for (lo, hi), part in zip(self.bounds, self.parts, strict=True):
            a, b = max(start, lo), min(end, hi)
            if a < b:
                s, c = self._cut(memoryview(part), hi - lo, a - lo, b - lo)
                scales.append(s)
                codes.append(c)
        return b"".join([*scales, *codes])

    def _cut(self, part: memoryview, n: int, a: int, b: int) -> tuple[Buffer, Buffer]:
        """(scales, codes) of values [a, b) from the encoding `part` of n values."""
        spec = CODECS[self.codec]
        bits = spec.bits
        head = 0
        scales: Buffer = b""
        if spec.is_block:
            bs = self.block_size
            head = SCALE_BYTES * -(-n // bs)
            scales = part[SCALE_BYTES * (a // bs):SCALE_BYTES * -(-b // bs)]
        codes = part[head + a * bits // 8:head + -(-b * bits // 8)]
        return scales, codes

