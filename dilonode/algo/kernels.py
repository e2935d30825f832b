"""Compiled CPU kernels (numba) for the block codecs and the owner's reduction.

The reference codecs in `dense_codecs.py` make several numpy/torch passes over every chunk
(absmax, divide, round, clamp, convert, pack; table lookup, scale, then a separate add).
These kernels do each job in one pass per block, and decode straight into an accumulator,
so an owner dequantizes and sums a contribution in a single sweep. The arithmetic is the
reference's, operation for operation, in float32 with no fast-math flags (no reassociation,
no fused multiply-add, IEEE division), so the bytes and values are bit-identical; the tests
compare both on random and adversarial inputs.

numba is an ordinary dependency; where it cannot be imported, `AVAILABLE` is False and the
codecs use their reference paths. Kernels compile on first use and are cached on disk.

Accumulation modes (`mode`), one per step of `butterfly.reduction_steps`:
WRITE ``out = v``, ADD ``out += v``, WRITE_SCALED ``out = f32(v * c)``,
ADD_SCALED ``out += f32(v * c)``, ADD_DIVIDE ``out = (out + v) / c``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["ADD", "ADD_DIVIDE", "ADD_SCALED", "AVAILABLE", "FOLD_WIDTH", "MODES", "WRITE",
           "WRITE_SCALED", "absmax_bits", "accumulate_f32", "copy_bits_max", "count_int8_min",
           "count_nibble8", "dequantize_int4", "dequantize_int8", "dequantize_nibbles",
           "fold_f32", "quantize_fp4", "quantize_int4", "quantize_int8"]

WRITE, ADD, WRITE_SCALED, ADD_SCALED, ADD_DIVIDE = 0, 1, 2, 3, 4
MODES = {"write": WRITE, "add": ADD, "write_scaled": WRITE_SCALED,
         "add_scaled": ADD_SCALED, "add_divide": ADD_DIVIDE}
FOLD_WIDTH = 4  # sources one `fold_f32` call sums
_FOLD_BLOCK = 1024  # values per block of `fold_f32`: its later passes read them from L1

numba: Any
try:
    import numba
except ImportError:  # pragma: no cover - numba is a dependency; this keeps odd hosts working
    numba = None

AVAILABLE = numba is not None


def _jit(fn: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """numba.njit without fast-math: exact IEEE float32 arithmetic, GIL released."""
    if numba is None:  # pragma: no cover
        return fn
    jit = numba.njit(nogil=True, cache=True, error_model="numpy", **options)
    return jit(fn)  # type: ignore[no-any-return]


def _inline(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A helper compiled into its callers (one call per block would cost more than it)."""
    return _jit(fn, inline="always")


@_jit
def absmax_bits(xi: np.ndarray, bs: int, out: np.ndarray) -> None:
    """xi: (n,) int32 bit patterns of float32 values -> out: (n_blocks,) int32 bits of each
    block's max |x| (the last block may be short). Integer max of the sign-cleared bits is
    the float max for finite values and infinities, and any NaN or Inf gives bits >=
    0x7F800000, so one integer pass finds both the scale and non-finite input."""
    n = xi.size
    for b in range(out.size):
        lo, hi = b * bs, min(b * bs + bs, n)
        xb = xi[lo:hi]  # block slices and ranges from 0: no wraparound checks, so it vectorizes
        m = np.int32(0)
        for i in range(hi - lo):
            m = max(m, xb[i] & np.int32(0x7FFFFFFF))
        out[b] = m


@_jit
def quantize_int8(x: np.ndarray, bs: int, div: np.ndarray, qmax: np.float32,
                  out: np.ndarray) -> None:
    """x: (n,) float32, div: (n_blocks,) nonzero scales -> out: (n,) int8
    clamp(rint(x / div), -qmax, qmax)."""
    n = x.size
    for b in range(div.size):
        lo, hi = b * bs, min(b * bs + bs, n)
        d, xb, ob = div[b], x[lo:hi], out[lo:hi]
        for i in range(hi - lo):
            ob[i] = np.int8(min(max(np.rint(xb[i] / d), -qmax), qmax))


@_jit
def quantize_int4(x: np.ndarray, bs: int, div: np.ndarray, out: np.ndarray) -> None:
    """x: (n,) float32 -> out: (ceil(n/2),) uint8 packed int4 codes (low nibble = even)."""
    n = x.size
    q = np.empty(bs + 1, np.int32)  # codes of one block, plus a zero padding code
    seven = np.float32(7.0)
    for b in range(div.size):
        lo, hi = b * bs, min(b * bs + bs, n)
        d, xb = div[b], x[lo:hi]
        for i in range(hi - lo):
            q[i] = np.int32(min(max(np.rint(xb[i] / d), -seven), seven))
        q[hi - lo] = 0
        ob = out[lo // 2:(hi + 1) // 2]
        for j in range(ob.size):
            ob[j] = (q[2 * j] & 15) | ((q[2 * j + 1] & 15) << 4)


@_jit
def quantize_fp4(x: np.ndarray, bs: int, div: np.ndarray, mids: np.ndarray,
                 out: np.ndarray) -> None:
    """x: (n,) float32 -> out: (ceil(n/2),) uint8 packed fp4 codes: the exponent code is
    the number of `mids` (7 ascending float32 midpoints) below |x / div|, sign bit 3 on
    nonzero codes of negative values."""
    n = x.size
    q = np.empty(bs + 1, np.int32)
    for b in range(div.size):
        lo, hi = b * bs, min(b * bs + bs, n)
        d, xb = div[b], x[lo:hi]
        for i in range(hi - lo):
            v = xb[i]
            r = abs(v / d)
            c = np.int32(0)
            for k in range(7):
                c += np.int32(r > mids[k])
            q[i] = c | (np.int32((v < 0) & (c > 0)) << 3)
        q[hi - lo] = 0
        ob = out[lo // 2:(hi + 1) // 2]
        for j in range(ob.size):
            ob[j] = q[2 * j] | (q[2 * j + 1] << 4)


@_jit
def copy_bits_max(src: np.ndarray, out: np.ndarray) -> np.int32:
    """src, out: (n,) int32 bit patterns of float32 values: copy src into out and return
    the max of the sign-cleared patterns (>= 0x7F800000: some value is NaN or Inf), one
    pass over src where a copy and a finiteness check would make two."""
    m = np.int32(0)
    for i in range(src.size):
        b = src[i]
        out[i] = b
        m = max(m, b & np.int32(0x7FFFFFFF))
    return m


@_jit
def count_int8_min(q: np.ndarray) -> int:
    """Number of -128 values in q: (n,) int8."""
    bad = 0
    for i in range(q.size):
        bad += q[i] == -128
    return bad


@_jit
def count_nibble8(p: np.ndarray) -> int:
    """Number of 0b1000 nibbles in p: (m,) uint8."""
    bad = 0
    for i in range(p.size):
        bad += ((p[i] & 15) == 8) + ((p[i] >> 4) == 8)
    return bad


@_inline
def _store(out: np.ndarray, v: np.ndarray, s: np.float32, coef: np.float32,
           mode: int) -> None:
    """Store the values v[i] * s (rounded to float32) into out: (m,) by `mode`, with one
    branch-free loop per mode (a branch inside the loop would stop vectorization)."""
    m = out.size
    if mode == WRITE:
        for i in range(m):
            out[i] = v[i] * s
    elif mode == ADD:
        for i in range(m):
            out[i] += v[i] * s
    elif mode == WRITE_SCALED:
        for i in range(m):
            out[i] = (v[i] * s) * coef
    elif mode == ADD_SCALED:
        for i in range(m):
            out[i] += (v[i] * s) * coef
    else:
        for i in range(m):
            out[i] = (out[i] + v[i] * s) / coef


@_jit
def dequantize_int8(q: np.ndarray, scale: np.ndarray, bs: int, out: np.ndarray,
                    coef: np.float32, mode: int) -> None:
    """q: (n,) int8, scale: (n_blocks,) float32 -> v = float32(q) * scale, stored into
    out: (n,) float32 by `mode` (module docstring)."""
    n = q.size
    tmp = np.empty(bs, np.float32)
    for b in range(scale.size):
        lo, hi = b * bs, min(b * bs + bs, n)
        qb = q[lo:hi]
        for i in range(hi - lo):
            tmp[i] = np.float32(qb[i])
        _store(out[lo:hi], tmp, scale[b], coef, mode)


@_jit
def dequantize_int4(p: np.ndarray, scale: np.ndarray, bs: int, out: np.ndarray,
                    coef: np.float32, mode: int) -> None:
    """p: (ceil(n/2),) uint8 packed int4 codes -> v = code * scale of its block (codes as
    4-bit two's complement, computed, not looked up: it vectorizes), stored into out: (n,)
    float32 by `mode`."""
    n = out.size
    tmp = np.empty(bs + 1, np.float32)
    for b in range(scale.size):
        lo, hi = b * bs, min(b * bs + bs, n)
        s, pb, ob = scale[b], p[lo // 2:(hi + 1) // 2], out[lo:hi]
        for j in range(pb.size):
            byte = np.int32(pb[j])
            tmp[2 * j] = np.float32(((byte & 15) ^ 8) - 8)
            tmp[2 * j + 1] = np.float32(((byte >> 4) ^ 8) - 8)
        _store(ob, tmp, s, coef, mode)


@_jit
def dequantize_nibbles(p: np.ndarray, lut: np.ndarray, scale: np.ndarray, bs: int,
                       out: np.ndarray, coef: np.float32, mode: int) -> None:
    """p: (ceil(n/2),) uint8 packed codes, lut: (16,) float32 unit values -> v = lut[code] *
    scale of its block, stored into out: (n,) float32 by `mode`."""
    n = out.size
    tmp = np.empty(bs + 1, np.float32)
    for b in range(scale.size):
        lo, hi = b * bs, min(b * bs + bs, n)
        s, pb, ob = scale[b], p[lo // 2:(hi + 1) // 2], out[lo:hi]
        for j in range(pb.size):
            byte = np.int32(pb[j])
            tmp[2 * j] = lut[byte & 15]
            tmp[2 * j + 1] = lut[byte >> 4]
        _store(ob, tmp, s, coef, mode)


@_jit
def accumulate_f32(src: np.ndarray, out: np.ndarray, coef: np.float32, mode: int) -> None:
    """Store float32 values src: (n,) into out: (n,) by `mode`."""
    _store(out, src, np.float32(1.0), coef, mode)  # x * 1 is x exactly


@_jit
def fold_f32(out: np.ndarray, a: np.ndarray, b: np.ndarray, c: np.ndarray, d: np.ndarray,
             count: int, coefs: np.ndarray, first: bool, divisor: np.float32,
             bits: np.ndarray) -> np.int32:
    """Up to `FOLD_WIDTH` steps of `butterfly.reduction_steps` over float32 sources in one
    sweep, where `accumulate_f32` makes one pass per source: the first `count` of a, b, c,
    d (each (n,)) are summed into out: (n,) left to right, each term f32(v * coefs[j]),
    from out or, if `first`, from nothing (the write / write_scaled step), then divided by
    `divisor` (the add_divide step; 1 for none). The same operations in the same order, so
    the same bits: v * 1 and x / 1 are exact, and the sum starts from -0.0, which adds
    nothing to any value (not even -0.0's sign). If `bits` has n values (the last call of
    a fold) it receives the result's bit patterns (the encoded float32 result, in the same
    sweep) and the return is the max of the result's sign-cleared bits (>= 0x7F800000:
    some value is NaN or Inf); otherwise 0."""
    n = out.size
    m = np.int32(0)
    ob = out.view(np.int32)
    keep = bits.size == n
    c0, c1, c2, c3 = coefs[0], coefs[1], coefs[2], coefs[3]
    zero = np.float32(-0.0)
    for lo in range(0, n, _FOLD_BLOCK):
        hi = min(lo + _FOLD_BLOCK, n)
        o, av, bv, cv, dv = out[lo:hi], a[lo:hi], b[lo:hi], c[lo:hi], d[lo:hi]
        if first:
            for i in range(hi - lo):
                o[i] = zero
        # One straight loop per source count: a branch inside would stop vectorization.
        if count == 1:
            for i in range(hi - lo):
                o[i] = (o[i] + av[i] * c0) / divisor
        elif count == 2:
            for i in range(hi - lo):
                o[i] = ((o[i] + av[i] * c0) + bv[i] * c1) / divisor
        elif count == 3:
            for i in range(hi - lo):
                o[i] = (((o[i] + av[i] * c0) + bv[i] * c1) + cv[i] * c2) / divisor
        else:
            for i in range(hi - lo):
                o[i] = ((((o[i] + av[i] * c0) + bv[i] * c1) + cv[i] * c2)
                        + dv[i] * c3) / divisor
        if keep:
            xb, kb = ob[lo:hi], bits[lo:hi]
            for i in range(hi - lo):
                x = xb[i]
                kb[i] = x
                m = max(m, x & np.int32(0x7FFFFFFF))
    return m
