"""Device codecs: the wire formats of `codecs.py` computed with torch ops on any device.

On a GPU host the pseudo-gradient lives on the GPU; these functions quantize and
dequantize it there, so only encoded bytes cross to the host. Every encoding is
bit-identical to the CPU reference codecs of `codecs.py` (the tests check them against each
other on the CPU and the golden vectors; `tests/unit/test_cuda.py` on a GPU):

* ``encode_torch(codec, x)``: (n,) float -> (encoded_size(n),) uint8 on x's device.
* ``encode_chunks_torch(codec, x, chunk_numel)``: the encodings of x's consecutive chunks of
  ``chunk_numel`` values, back to back, computed in one batch (a few kernels per call
  rather than per chunk).
* ``decode_torch(codec, data, meta, out=None)``: (encoded_size(n),) uint8 -> (n,) float32 on
  data's device, with the reference's checks (bad input raises its `CodecError`).

What keeps the device arithmetic exact: every division divides by a tensor, never by a
Python number (CUDA computes ``t / scalar`` as ``t * (1 / scalar)``, which can differ in the
last bit); products and sums are separate kernels (no fused multiply-add); rounding is
``torch.round`` (half to even on every device); the 4-bit decoders build values from integer
arithmetic and float32 bit patterns, not from ``exp2``. On an error the reference codec is
run on a CPU copy to raise its exact message.
"""

from __future__ import annotations

import sys

import torch

from dilonode.algo.codec_table import CODECS, CodecSpec
from dilonode.algo.codec_table import SCALE_BYTES as _SCALE_BYTES
from dilonode.algo.dense_codecs import (
    Codec,
    CodecError,
    CodecMeta,
    get_codec,
)
from dilonode.algo.lowbit_codecs import halving_sum

__all__ = ["decode_torch", "encode_chunks_torch", "encode_rows", "encode_torch", "pack_bits"]

_F32_OVERFLOW = 2.0**128 - 2.0**103  # as in codecs.py: float32 round-to-nearest overflow
# The torch dtype of each raw float codec, by name.
_FLOATS = {name: getattr(torch, spec.float_dtype) for name, spec in CODECS.items()
           if spec.float_dtype is not None}
# Midpoints between consecutive fp4 unit magnitudes (codecs.py `_FP4_MIDPOINTS`).
_FP4_MIDPOINTS = (2.0**-7, *(0.75 * 2.0**k for k in range(-5, 1)))

if sys.byteorder != "little":  # pragma: no cover - every torch device we run on is
    raise ImportError("torch_codecs assumes a little-endian host (the wire is little-endian)")


def _spec(codec: Codec) -> CodecSpec:
    return CODECS[codec.name]


# ---------------------------------------------------------------------------- encode


def encode_torch(codec: Codec, x: torch.Tensor) -> torch.Tensor:
    """(n,) floating tensor -> (codec.encoded_size(n),) uint8 on x's device, the bytes
    `codec.encode(x)` returns. CodecError for non-finite input (or float16 overflow)."""
    x = _check_input(codec, x)
    if _composite(codec):
        return codec.encode_tensor(x)  # type: ignore[attr-defined, no-any-return]
    return _encode_rows(codec, x[None, :])[0]  # (1, E) -> (E,)


def encode_chunks_torch(codec: Codec, x: torch.Tensor, chunk_numel: int) -> torch.Tensor:
    """(n,) -> uint8 (sum of encoded sizes,): encode_torch of each consecutive chunk of
    `chunk_numel` values (the last may be short), concatenated in chunk order.

    `chunk_numel` must be a multiple of the codec's block size (chunks are block-aligned,
    as the round's are). The full chunks are encoded as one batch of rows."""
    x = _check_input(codec, x)
    if _composite(codec) and chunk_numel % codec.chunk == 0:  # type: ignore[attr-defined]
        return codec.encode_tensor(x)  # type: ignore[attr-defined, no-any-return]
    if 0 < x.numel() <= chunk_numel:
        return _encode_rows(codec, x[None, :])[0]  # one chunk, perhaps with a short block
    if chunk_numel < 1 or chunk_numel % codec.block_size:
        raise CodecError(f"chunk_numel={chunk_numel}: need a positive multiple of "
                         f"block_size={codec.block_size}")
    n_full = x.numel() // chunk_numel
    pieces = []
    if n_full:
        rows = x[:n_full * chunk_numel].view(n_full, chunk_numel)  # (R, C)
        pieces.append(_encode_rows(codec, rows).reshape(-1))  # (R * E,)
    if x.numel() > n_full * chunk_numel:
        pieces.append(_encode_rows(codec, x[n_full * chunk_numel:][None, :])[0])
    if not pieces:
        return torch.empty(0, dtype=torch.uint8, device=x.device)
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def _composite(codec: Codec) -> bool:
    """A codec built on the value codecs (top-k): it brings its own device encoder, and
    its encoding of chunk-aligned pieces is the concatenation of theirs."""
    return hasattr(codec, "encode_tensor")


def _check_input(codec: Codec, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.ndim != 1 or not x.is_floating_point():
        codec.encode(x)  # type: ignore[arg-type]  # raises the reference's CodecError
        raise CodecError(f"cannot encode {type(x).__name__}")  # pragma: no cover
    return x.detach().to(torch.float32).contiguous()


def encode_rows(codec: Codec, x: torch.Tensor) -> torch.Tensor:
    """x: (R, m) float32 -> (R, encoded_size(m)) uint8, each row encoded on its own by a
    float or block codec."""
    return _encode_rows(codec, x)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(R, m) int8 codes below 2**bits -> (R, ceil(m * bits / 8)) uint8, low bits first."""
    return _pack_bits(codes, bits)


def _encode_rows(codec: Codec, x: torch.Tensor) -> torch.Tensor:
    """x: (R, m) float32 -> (R, encoded_size(m)) uint8, each row encoded on its own."""
    if x.shape[1] == 0:
        return torch.empty((x.shape[0], 0), dtype=torch.uint8, device=x.device)
    if codec.name in _FLOATS:
        return _encode_float_rows(codec, x)
    return _encode_block_rows(codec, x)


def _encode_float_rows(codec: Codec, x: torch.Tensor) -> torch.Tensor:
    dtype = _FLOATS[codec.name]
    h = x if dtype == torch.float32 else x.to(dtype)  # (R, m), round-to-nearest-even
    if not bool(torch.isfinite(h).all()):
        _raise_reference(codec, x)
    return h.contiguous().view(torch.uint8)  # (R, m * itemsize): little-endian bytes


def _encode_block_rows(codec: Codec, x: torch.Tensor) -> torch.Tensor:
    rows, m = x.shape
    bs = codec.block_size
    nb = -(-m // bs)
    if nb * bs != m:  # a short last block: zeros change neither its absmax nor its codes
        x = torch.nn.functional.pad(x, (0, nb * bs - m))
    blocks = x.view(rows, nb, bs)  # (R, nb, bs)
    spec = _spec(codec)
    scale = (_mean_abs(codec, blocks, m) if spec.quantizer == "sign"
             else _scales(codec, blocks))  # (R, nb)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero block: 0/1 = 0
    ratio = blocks / safe[..., None]  # (R, nb, bs), IEEE division by a tensor
    codes = _codes(spec, blocks, ratio).view(rows, nb * bs)[:, :m]  # (R, m)
    payload = (codes.view(torch.uint8) if spec.bits == 8 else _pack_nibbles(codes)
               if spec.bits == 4 else _pack_bits(codes, spec.bits))
    return torch.cat([scale.view(torch.uint8), payload], dim=1)  # (R, 4 nb + payload)


def _mean_abs(codec: Codec, blocks: torch.Tensor, m: int) -> torch.Tensor:
    """(R, nb, bs) zero-padded rows of m values -> (R, nb) float32 mean |x| per block, by
    the passes of `lowbit_codecs.mean_abs_scales` (float64, pairwise, one rounding)."""
    if not bool(torch.isfinite(blocks).all()):
        _raise_reference(codec, blocks.reshape(-1))
    rows, nb, bs = blocks.shape
    width = 1 << max(bs - 1, 0).bit_length()
    a = torch.nn.functional.pad(blocks.abs().double(), (0, width - bs))  # (R, nb, width)
    counts = torch.full((nb,), float(bs), dtype=torch.float64, device=blocks.device)
    if m % bs:
        counts[-1] = float(m % bs)
    return (halving_sum(a) / counts).to(torch.float32)  # (R, nb)


def _scales(codec: Codec, blocks: torch.Tensor) -> torch.Tensor:
    """(R, nb, bs) -> (R, nb) float32 scales, as `_BlockCodec.block_scales` computes them."""
    absmax = blocks.abs().amax(dim=-1)  # (R, nb); NaN and Inf propagate
    if not bool(torch.isfinite(absmax).all()):
        _raise_reference(codec, blocks.reshape(-1))
    qmax = _spec(codec).qmax
    if qmax == 1.0:
        return absmax
    # A tensor divisor, not the number: CUDA would multiply by a rounded reciprocal.
    scale = absmax / torch.full_like(absmax, qmax)
    too_big = scale.double() * qmax >= _F32_OVERFLOW
    return torch.where(too_big, torch.nextafter(scale, torch.zeros_like(scale)), scale)


def _codes(spec: CodecSpec, blocks: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """(R, nb, bs) values and values/scale -> (R, nb, bs) int8 codes (4-bit ones in the low
    nibble)."""
    if spec.quantizer == "sign":
        return (blocks < 0).to(torch.int8)
    if spec.quantizer == "fp4":
        r = ratio.abs_()
        code = torch.zeros(r.shape, dtype=torch.uint8, device=r.device)
        for mid in _FP4_MIDPOINTS:  # exact float32 constants: the comparison is exact
            code += r > mid
        neg = (blocks < 0) & (code > 0)  # no negative zero from the encoder
        return (code | (neg.to(torch.uint8) << 3)).view(torch.int8)
    qmax = spec.qmax
    return ratio.round_().clamp_(-qmax, qmax).to(torch.int8)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """(R, m) int8 codes -> (R, ceil(m / 2)) uint8: even index in the low nibble."""
    u = codes.view(torch.uint8) & 15  # (R, m)
    if u.shape[1] % 2:
        u = torch.nn.functional.pad(u, (0, 1))  # zero padding nibble
    pairs = u.view(u.shape[0], -1, 2)  # (R, m / 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(R, m) int8 codes -> (R, ceil(m * bits / 8)) uint8, as `lowbit_codecs.pack_codes`."""
    per = 8 // bits
    u = codes.view(torch.uint8) & ((1 << bits) - 1)  # (R, m)
    if u.shape[1] % per:
        u = torch.nn.functional.pad(u, (0, per - u.shape[1] % per))
    groups = u.view(u.shape[0], -1, per)  # (R, bytes, per)
    out = groups[..., 0].clone()
    for j in range(1, per):
        out |= groups[..., j] << (bits * j)
    return out


def _raise_reference(codec: Codec, x: torch.Tensor) -> None:
    """Raise the reference codec's CodecError for x (which it must refuse)."""
    get_codec(codec.name, codec.block_size).encode(x.detach().reshape(-1).cpu())
    raise AssertionError("reference codec accepted what the device codec refused")


# ---------------------------------------------------------------------------- decode


def decode_torch(codec: Codec, data: torch.Tensor, meta: CodecMeta,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """(encoded_size(n),) uint8 on any device -> (n,) float32 on that device (into `out`,
    float32 (n,) on the same device, if given): what `codec.decode` returns, with its checks.
    """
    if _composite(codec) and isinstance(data, torch.Tensor):
        values = codec.decode_device(data, meta)  # type: ignore[attr-defined]
        return values if out is None else out.copy_(values)
    n = meta.numel if isinstance(meta, CodecMeta) else -1
    if (not isinstance(meta, CodecMeta) or meta.codec != codec.name or n < 0
            or (codec.name not in _FLOATS and meta.block_size != codec.block_size)
            or not isinstance(data, torch.Tensor) or data.dtype != torch.uint8
            or data.numel() != codec.encoded_size(n)):
        _decode_reference(codec, data, meta)  # raises the reference's CodecError
        raise CodecError("decode_torch: needs a 1-D uint8 tensor")  # pragma: no cover
    data = data.reshape(-1)
    if data.storage_offset() % _SCALE_BYTES:
        data = data.clone()  # float views need 4-byte alignment
    values = (_decode_float(codec, data, meta) if codec.name in _FLOATS
              else _decode_block(codec, data, meta))  # (n,) float32
    if out is None:
        return values
    return out.copy_(values)


def _decode_float(codec: Codec, data: torch.Tensor, meta: CodecMeta) -> torch.Tensor:
    values = data.view(_FLOATS[codec.name]).to(torch.float32)  # (n,) (a copy for 16-bit)
    if not bool(torch.isfinite(values).all()):
        _decode_reference(codec, data, meta)
    return values


def _decode_block(codec: Codec, data: torch.Tensor, meta: CodecMeta) -> torch.Tensor:
    spec = _spec(codec)
    n, bs, qmax = meta.numel, codec.block_size, spec.qmax
    nb = -(-n // bs)
    scale = data[:nb * _SCALE_BYTES].view(torch.float32)  # (nb,)
    payload = data[nb * _SCALE_BYTES:]  # (P,)
    bad = ~((scale >= 0) & (scale.double() * qmax < _F32_OVERFLOW)).all()  # () bool
    if spec.bits == 8:
        q = payload.view(torch.int8)  # (n,)
        bad |= (q == -128).any()
        unit = q.to(torch.float32)
    elif spec.bits < 4:
        shifts = torch.arange(0, 8, spec.bits, dtype=torch.uint8, device=payload.device)
        codes = ((payload[:, None] >> shifts) & ((1 << spec.bits) - 1)).view(-1)  # (8 P / bits,)
        bad |= (codes[n:] != 0).any()  # padding codes
        codes = codes[:n]
        if spec.quantizer == "int":  # 2-bit two's complement; 0b10 (-2) is refused
            bad |= (codes == 2).any()
            unit = ((codes ^ 2).to(torch.int8) - 2).to(torch.float32)
        else:  # sign: 1 is negative
            unit = 1.0 - 2.0 * codes.to(torch.float32)
    else:
        nib = torch.stack([payload & 15, payload >> 4], dim=1).view(-1)  # (2P,) uint8
        if n % 2:
            bad |= nib[-1] != 0  # padding nibble
        nib = nib[:n]  # (n,)
        if spec.quantizer == "int":
            bad |= (nib == 8).any()
        unit = _nibble_values(spec, nib)  # (n,) float32
    if bool(bad):
        _decode_reference(codec, data, meta)
    if nb * bs != n:
        unit = torch.nn.functional.pad(unit, (0, nb * bs - n))
    return (unit.view(nb, bs) * scale[:, None]).view(-1)[:n]  # (n,)


def _nibble_values(spec: CodecSpec, nib: torch.Tensor) -> torch.Tensor:
    """(n,) uint8 codes 0..15 -> (n,) float32 unit values of int4 or fp4."""
    if spec.quantizer == "int":
        return ((nib ^ 8).to(torch.int8) - 8).to(torch.float32)  # two's complement
    mag_code = (nib & 7).to(torch.int32)  # (n,)
    # 2^(c - 7) as float32 bits: biased exponent 120 + c, zero mantissa.
    mag = torch.where(mag_code > 0, ((mag_code + 120) << 23).view(torch.float32),
                      torch.zeros((), dtype=torch.float32, device=nib.device))
    return torch.where(nib >= 8, -mag, mag)  # nibble 0b1000 decodes to -0.0, as the table


def _decode_reference(codec: Codec, data: object, meta: object) -> None:
    """Raise the reference codec's CodecError for `data` (which it must refuse)."""
    raw = data.detach().cpu().numpy().tobytes() if isinstance(data, torch.Tensor) else data
    get_codec(codec.name, codec.block_size).decode(raw, meta)  # type: ignore[arg-type]
    raise CodecError(f"{codec.name}: decode_torch needs a 1-D uint8 tensor")
