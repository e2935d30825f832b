"""The 2-bit and 1-bit block codecs: int2 (ternary) and sign1 (sign times a block scale).

Both are block codecs of `codecs.py` (float32 scales first, then the packed codes) with the
reference arithmetic only (numpy and torch passes, no compiled kernels). Used with error
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

from dilonode.algo.codec_table import CodecSpec
from dilonode.algo.codecs import CodecError, _BlockCodec, _n_blocks

__all__ = ["Int2Codec", "Sign1Codec", "mean_abs_scales", "pack_codes", "unpack_codes"]


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
    nb = _n_blocks(n, block_size)
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


class _PackedCodec(_BlockCodec):
    """A block codec whose codes are `bits` wide, 8 / bits per byte."""

    def __init__(self, spec: CodecSpec, block_size: int, fast: bool = False) -> None:
        super().__init__(spec, block_size, fast=False)  # no compiled kernels for these

    def _codes_of(self, x: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
        """x: (n,), scale: (n_blocks,) -> (n,) uint8 codes."""
        raise NotImplementedError

    def _units(self) -> np.ndarray:
        """(2**bits,) float32 unit value of each code (NaN marks a code never sent)."""
        raise NotImplementedError

    def _quantize(self, x: torch.Tensor, scale: torch.Tensor, out: np.ndarray) -> None:
        out[:] = pack_codes(self._codes_of(x, scale), self._spec.bits)

    def _dequantize(self, payload: np.ndarray, out: np.ndarray) -> None:
        n = out.size
        codes = unpack_codes(payload, self._spec.bits, n)
        if codes[n:].any():
            raise CodecError(f"{self.name} data: padding codes after the last value must be 0")
        units = self._units()[codes[:n]]  # (n,)
        if np.isnan(units).any():
            raise CodecError(f"{self.name} data holds {int(np.isnan(units).sum())} "
                             "code(s) 0b10 (-2), outside the range [-1, 1]")
        np.copyto(out, units)


_INT2_UNITS = np.array([0.0, 1.0, np.nan, -1.0], np.float32)  # two's complement, -2 refused
_SIGN1_UNITS = np.array([1.0, -1.0], np.float32)


class Int2Codec(_PackedCodec):
    """Ternary: round(x / absmax) in {-1, 0, 1}."""

    def _codes_of(self, x: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
        q = self._safe_divide(x, scale).round_().clamp_(-1, 1)  # (n,)
        return (q.to(torch.int8).numpy().view(np.uint8) & 3).astype(np.uint8)

    def _units(self) -> np.ndarray:
        return _INT2_UNITS


class Sign1Codec(_PackedCodec):
    """sign(x) times the block's mean |x|."""

    def block_scales(self, x: torch.Tensor) -> torch.Tensor:
        if not bool(torch.isfinite(x).all()):
            raise CodecError(f"refusing to encode {x.numel() - int(torch.isfinite(x).sum())} "
                             f"non-finite value(s) (NaN/Inf) of {x.numel()}")
        return mean_abs_scales(x, self.block_size)

    def _codes_of(self, x: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
        return (x < 0).numpy().astype(np.uint8)

    def _units(self) -> np.ndarray:
        return _SIGN1_UNITS
