"""Pseudo-gradient codecs, the one entry point: `get_codec(name, block_size)` for every
wire format a node may speak.

The dense formats (every value travels: float32/bfloat16/float16 and the block quantizers
int8/int4/fp4/int2/sign1 of `codec_table.py`) live in `dense_codecs.py`, whose module
docstring describes their wire formats; the chunked top-k codec (`topk<k>_<value codec>`,
positions and the largest values of each chunk) lives in `topk_codec.py` and builds on
them. Everything else here is re-exported from `dense_codecs.py`. Pure: no I/O.
"""

from __future__ import annotations

import math

from dilonode.algo.codec_table import DEFAULT_BLOCK_SIZE
from dilonode.algo.dense_codecs import (
    CODEC_NAMES,
    Buffer,
    Codec,
    CodecError,
    CodecMeta,
    accumulate_tensor,
    all_finite,
    as_float32_vector,
    check_count,
    check_layout,
    decode_shared,
    fold_float32,
    max_abs_error_bound,
    out_array,
    raise_non_finite,
    sums_raw_values,
)
from dilonode.algo.dense_codecs import get_codec as dense_codec
from dilonode.algo.topk_codec import TopkCodec, is_topk_name

__all__ = [
    "CODEC_NAMES",
    "Buffer",
    "Codec",
    "CodecError",
    "CodecMeta",
    "accumulate_tensor",
    "all_finite",
    "as_float32_vector",
    "check_count",
    "check_layout",
    "decode_shared",
    "fold_float32",
    "get_codec",
    "max_abs_error_bound",
    "out_array",
    "part_align",
    "raise_non_finite",
    "sums_raw_values",
]


def get_codec(name: str, block_size: int = DEFAULT_BLOCK_SIZE, *,
              reference: bool = False) -> Codec:
    """The codec called `name`: a row of `codec_table.CODECS` (block_size applies to the
    block codecs; float codecs use 1) or ``topk<k>_<row>`` (block_size is its value
    codec's). `reference=True`: the numpy/torch reference passes instead of the compiled
    kernels (the same bytes and values, slower: for tests and comparisons)."""
    if is_topk_name(name):
        return TopkCodec(name, block_size, reference=reference)
    return dense_codec(name, block_size, reference=reference)


def part_align(codec: Codec, block_size: int) -> int:
    """Values that a round's part and frame boundaries are multiples of: the round's
    `block_size`, and for a codec of fixed chunks (top-k) its chunk too, so that no chunk
    straddles two parts or frames."""
    return math.lcm(block_size, getattr(codec, "chunk", 1))
