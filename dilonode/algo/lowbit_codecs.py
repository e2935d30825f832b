"""The 2-bit and 1-bit block codecs: int2 (ternary) and sign1 (sign times a block scale).

Both are block codecs of `codecs.py` (float32 scales first, then the packed codes) with the
reference arithmetic only (numpy and torch passes, no compiled kernels); this module holds
their arithmetic, `codecs.py` the classes that frame and check it. Used with error
feedback (`error_feedback.py`): at these widths most of a value is carried into the next
round, not lost.

Wire formats (little-endian, sizes exact, `Codec.encoded_size`):

* ``int2``  scale = block absmax; codes in [-1, 1] as 2-bit two's complement (0b10 = -2 is
  never produced and refused on decode), four per byte, the value of index 4i + j in bits
  2j..2j+1. Padding codes after the last value are 0.
* ``sign1``  scale = the block's mean |x|, computed exactly as `mean_abs_scales` says (a
  fixed pairwise order in float64, so any device gets the same bits); one bit per value,
  1 = negative (-scale), 0 = +scale (zero and -0.0 included), eight per byte, index 8i + j
  in bit j. Padding bits are 0. An all-zero block has scale 0 and decodes to zeros.

The block size must be a multiple of the codes per byte (int2: 4, sign1: 8), so that every
block starts on a byte and a round's block-aligned parts cut the encoding cleanly.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["INT2_UNITS", "SIGN1_UNITS", "halving_sum", "int2_codes", "mean_abs_scales",
           "pack_codes", "sign1_codes", "unit_values", "unpack_codes"]

# Unit value of each code (NaN: a code never sent, refused on decode).
INT2_UNITS = np.array([0.0, 1.0, np.nan, -1.0], np.float32)  # two's complement, -2 refused
SIGN1_UNITS = np.array([1.0, -1.0], np.float32)


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """(n,) uint8 codes below 2**bits -> (ceil(n * bits / 8),) uint8, index i of each byte's
    group in bits i * bits (low bits first); zero padding codes at the end."""
    per = 8 // bits
    pad = -codes.size % per
    c = np.concatenate([codes, np.zeros(pad, np.uint8)]) if pad else codes
    c = c.reshape(-1, per).astype(np.uint8)  # (n_bytes, per)
    out = np.zeros(c.shape[0], np.uint8)
    for j in range(per):
        out |= c[:, j] << np.uint8(bits * j)
    return out


def unpack_codes(payload: np.ndarray, bits: int, numel: int) -> np.ndarray:
    """The inverse of `pack_codes`: (n_bytes,) uint8 -> (n_bytes * 8 / bits,) uint8 codes,
    padding included (the caller checks and drops it)."""
    per = 8 // bits
    mask = np.uint8((1 << bits) - 1)
    codes = np.empty((payload.size, per), np.uint8)
    for j in range(per):
        codes[:, j] = (payload >> np.uint8(bits * j)) & mask
    return codes.reshape(-1)


def mean_abs_scales(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """x: (n,) finite float32 -> (n_blocks,) float32 mean |x| of each block.

    Each block (the last one padded with zeros to a full block) is padded with zeros to the
    next power of two, its |x| summed in float64 by halving passes (element 2i plus element
    2i + 1), divided by the block's true count in float64 and rounded once to float32.
    Elementwise IEEE operations in a fixed order: the same bits on every device
    (`torch_codecs` runs the same passes). float64 cannot overflow on 2**20 float32 values."""
    n = x.numel()
    nb = -(-n // block_size)
    width = 1 << max(block_size - 1, 0).bit_length()  # next power of two >= block_size
    a = torch.zeros(nb * width, dtype=torch.float64).view(nb, width)  # (nb, width)
    full = torch.nn.functional.pad(x.abs().double(), (0, nb * block_size - n))
    a[:, :block_size] = full.view(nb, block_size)
    counts = torch.full((nb,), float(block_size), dtype=torch.float64)
    if nb and n % block_size:
        counts[-1] = float(n % block_size)
    return (halving_sum(a) / counts).to(torch.float32)


def halving_sum(a: torch.Tensor) -> torch.Tensor:
    """(R, 2**k) -> (R,) the sum of each row by k passes of pairwise addition."""
    while a.shape[-1] > 1:
        pairs = a.view(*a.shape[:-1], a.shape[-1] // 2, 2)
        a = pairs[..., 0] + pairs[..., 1]
    return a[..., 0]


def int2_codes(ratio: torch.Tensor) -> np.ndarray:
    """(n,) x / block absmax -> (n,) uint8 2-bit codes of round(ratio) in [-1, 1]."""
    q = ratio.round_().clamp_(-1, 1).to(torch.int8)  # (n,)
    return (q.numpy().view(np.uint8) & 3).astype(np.uint8)


def sign1_codes(x: torch.Tensor) -> np.ndarray:
    """(n,) -> (n,) uint8 1 where x < 0 (zero and -0.0 are positive)."""
    return (x < 0).numpy().astype(np.uint8)


def unit_values(payload: np.ndarray, bits: int, units: np.ndarray,
                out: np.ndarray) -> str | None:
    """Decode `payload`'s codes into `out` (n,) float32 unit values. A malformed payload
    gives what is wrong, to follow "<codec> data" in an error (out is then undefined);
    else None."""
    n = out.size
    codes = unpack_codes(payload, bits, n)
    if codes[n:].any():
        return ": padding codes after the last value must be 0"
    values = units[codes[:n]]  # (n,)
    bad = int(np.isnan(values).sum())
    if bad:
        return f" holds {bad} code(s) 0b10 (-2), outside the range [-1, 1]"
    np.copyto(out, values)
    return None
