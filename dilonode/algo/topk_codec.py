"""The chunked top-k codec (`codec.kind = topk`): per chunk the k largest |x| with positions.

SparseLoCo-style sparsification as a `Codec`: a vector is cut into chunks of
`sparse.SPARSE_CHUNK` (4096) consecutive values; each chunk keeps the k_c values of largest
magnitude (ties: the lower index), and encodes, on its own:

* its positions: uint16 little-endian offsets in the chunk, increasing (2 k_c bytes), or a
  bitmap of the chunk (ceil(length / 8) bytes, the offset 8i + j in bit j of byte i,
  padding bits 0), whichever is smaller (offsets on a tie), as `sparse.positions_bytes`;
* its k_c values in the value codec (`codec_table`, e.g. int2 or int4), blocks of
  `block_size` starting at the chunk's first kept value.

k is the count of a full chunk, in the wire name ``topk<k>_<value codec>`` (e.g.
``topk64_int2``: 64 of 4096, 1.56%); a short last chunk of length L keeps
ceil(k L / 4096) (at least 1). Every chunk is encoded independently, so the encoding of a
vector cut at multiples of 4096 is the concatenation of its pieces' encodings (a round's
parts and frames are cut there: `codecs.part_align`). Decoding gives the dense vector, zeros
outside the positions. Decoders refuse offsets out of the chunk, unsorted or repeated
offsets, a bitmap with another count than k_c, and whatever the value codec refuses.

Encoding runs with torch ops on the vector's device (`torch.topk` and a tie rule pick the
positions, the value codec's device encoder packs the values), the CPU codec included: one
arithmetic. Decoding runs on the host. Pure: no I/O.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from dilonode.algo import torch_codecs
from dilonode.algo.codec_table import CODECS, SCALE_BYTES
from dilonode.algo.dense_codecs import (
    Buffer,
    CodecError,
    CodecMeta,
    accumulate_tensor,
    all_finite,
    as_float32_vector,
    check_count,
    get_codec,
    out_array,
    raise_non_finite,
)
from dilonode.algo.sparse import SPARSE_CHUNK, chunk_k, positions_bytes

__all__ = ["TopkCodec", "is_topk_name", "parse_topk_name", "topk_chunk_k", "topk_name"]

_NAME = re.compile(r"topk([1-9][0-9]{0,3})_([a-z0-9]+)")


def topk_name(value_codec: str, density: float) -> str:
    """The wire name of top-k at `density` with values in `value_codec`."""
    return f"topk{chunk_k(SPARSE_CHUNK, density)}_{value_codec}"


def is_topk_name(name: object) -> bool:
    return isinstance(name, str) and name.startswith("topk")


def parse_topk_name(name: str) -> tuple[int, str]:
    """``topk<k>_<value codec>`` -> (k, value codec name); CodecError naming what is wrong."""
    m = _NAME.fullmatch(name)
    if m is None or int(m.group(1)) > SPARSE_CHUNK or m.group(2) not in CODECS:
        raise CodecError(f"unknown codec {name!r}; a top-k codec is topk<k>_<value codec> "
                         f"with 1 <= k <= {SPARSE_CHUNK} and a value codec among "
                         f"{', '.join(CODECS)}")
    return int(m.group(1)), m.group(2)


def topk_chunk_k(k: int, length: int) -> int:
    """Values a chunk of `length` keeps when a full chunk keeps k: ceil(k length / 4096),
    at least 1 (integer arithmetic: every member gets the same)."""
    if length <= 0:
        return 0
    return min(length, max(1, -(-k * length // SPARSE_CHUNK)))


def _largest(rows: torch.Tensor, kc: int) -> torch.Tensor:
    """(R, L) finite -> (R, kc) int64 increasing offsets of each row's kc largest |x|, ties
    to the lower offset: all above the kc-th largest magnitude t, then the first ones equal
    to t. (torch.topk alone breaks ties in no fixed order; a full stable sort gives the same
    set ~3x slower.)"""
    a = rows.abs()  # (R, L)
    t = torch.topk(a, kc, dim=1, sorted=False).values.amin(dim=1, keepdim=True)  # (R, 1)
    above = a > t
    tied = a == t
    need = kc - above.sum(dim=1, keepdim=True)  # (R, 1) ties to take, >= 1
    keep = above | (tied & (tied.cumsum(dim=1) <= need))  # (R, L), kc per row
    return keep.nonzero()[:, 1].view(rows.shape[0], kc)  # row-major: increasing per row


class TopkCodec:
    """Chunked top-k over a value codec (module docstring)."""

    chunk = SPARSE_CHUNK

    def __init__(self, name: str, block_size: int, *, reference: bool = False) -> None:
        self.k, value_name = parse_topk_name(name)
        self.name = name
        self.value = get_codec(value_name, block_size, reference=reference)
        self.block_size = self.value.block_size

    def __repr__(self) -> str:
        return f"get_codec({self.name!r}, {self.block_size})"

    def _layout(self, length: int) -> tuple[int, int, int]:
        """(k_c, position bytes, value bytes) of a chunk of `length` values."""
        kc = topk_chunk_k(self.k, length)
        return kc, positions_bytes(kc, length), self.value.encoded_size(kc)

    def _chunks(self, numel: int) -> tuple[int, int]:
        return divmod(numel, self.chunk)  # (full chunks, tail length)

    def encoded_size(self, numel: int) -> int:
        full, tail = self._chunks(check_count(numel))
        return sum(n * (p + v) for n, (_, p, v) in
                   ((full, self._layout(self.chunk)), (1, self._layout(tail))))

    # ------------------------------------------------------------------------ encode

    def encode(self, x: torch.Tensor) -> tuple[bytes, CodecMeta]:
        x = as_float32_vector(x)
        data = self.encode_tensor(x)
        return data.numpy().tobytes(), self._meta(x.numel())

    def _meta(self, numel: int) -> CodecMeta:
        return CodecMeta(codec=self.name, numel=numel, block_size=self.block_size)

    def encode_tensor(self, x: torch.Tensor) -> torch.Tensor:
        """(n,) float32 on any device -> (encoded_size(n),) uint8 on that device."""
        if not all_finite(x):
            raise_non_finite(x.cpu())
        full, tail = self._chunks(x.numel())
        pieces = []
        if full:
            pieces.append(self._encode_rows(x[:full * self.chunk].view(full, self.chunk)))
        if tail:
            pieces.append(self._encode_rows(x[full * self.chunk:][None, :]))
        if not pieces:
            return torch.empty(0, dtype=torch.uint8, device=x.device)
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    def _encode_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """(R, L) chunks -> (R * chunk bytes,) uint8: each chunk's positions then values."""
        n_rows, length = rows.shape
        kc, pos_bytes, _ = self._layout(length)
        idx = _largest(rows, kc)  # (R, kc) increasing offsets
        values = rows.gather(1, idx)  # (R, kc)
        if 2 * kc <= pos_bytes:
            pos = idx.to(torch.int16).view(torch.uint8)  # (R, 2 kc) little-endian uint16
        else:
            mask = torch.zeros(n_rows, pos_bytes * 8, dtype=torch.int8, device=rows.device)
            mask.scatter_(1, idx, 1)
            pos = torch_codecs.pack_bits(mask, 1)  # (R, pos_bytes)
        vals = torch_codecs.encode_rows(self.value, values)  # (R, value bytes)
        return torch.cat([pos, vals], dim=1).reshape(-1)

    # ------------------------------------------------------------------------ decode

    def decode(self, data: Buffer, meta: CodecMeta) -> torch.Tensor:
        n = self._check_meta(meta)
        raw = self._raw(data, n)  # before allocating: a peer's numel is not trusted
        out = torch.zeros(n, dtype=torch.float32)
        self._decode_raw(raw, out.numpy())
        return out

    def decode_into(self, data: Buffer, meta: CodecMeta, out: torch.Tensor) -> None:
        n = self._check_meta(meta)
        dst = out_array(out, n)
        raw = self._raw(data, n)
        dst[:] = 0
        self._decode_raw(raw, dst)

    def decode_device(self, data: torch.Tensor, meta: CodecMeta) -> torch.Tensor:
        """`decode` of a uint8 tensor on any device, the result on that device."""
        host = data.detach().reshape(-1).cpu().numpy().data
        return self.decode(host, meta).to(data.device)

    def check(self, data: Buffer, meta: CodecMeta) -> None:
        self.decode(data, meta)

    def accumulate(self, data: Buffer, meta: CodecMeta, out: torch.Tensor, step: str,
                   coef: float = 1.0) -> None:
        accumulate_tensor(self.decode(data, meta), out, step, coef)

    def _check_meta(self, meta: object) -> int:
        if not isinstance(meta, CodecMeta):
            raise CodecError(f"meta must be a CodecMeta, got {type(meta).__name__}")
        if meta.codec != self.name or meta.block_size != self.block_size:
            raise CodecError(f"meta says {meta.codec!r}/{meta.block_size!r} but this codec is "
                             f"{self.name!r}/{self.block_size}")
        return check_count(meta.numel, "meta.numel")

    def _raw(self, data: Buffer, numel: int) -> np.ndarray:
        try:
            mv = memoryview(data).cast("B")
        except TypeError as e:
            raise CodecError(f"decode needs a contiguous bytes-like object: {e}") from None
        expected = self.encoded_size(numel)
        if len(mv) != expected:
            raise CodecError(f"{self.name} data for numel={numel} must be {expected} bytes, "
                             f"got {len(mv)}")
        return np.frombuffer(mv, dtype=np.uint8)

    def _decode_raw(self, raw: np.ndarray, out: np.ndarray) -> None:
        """Scatter every chunk of `raw` (length checked) into `out` (n,) float32 zeros."""
        full, tail = self._chunks(out.size)
        kc, p, v = self._layout(self.chunk)
        cut = full * (p + v)
        if full:
            rows = raw[:cut].reshape(full, p + v)
            self._decode_rows(rows, out[:full * self.chunk].reshape(full, self.chunk), 0)
        if tail:
            self._decode_rows(raw[cut:][None, :], out[full * self.chunk:][None, :], full)

    def _decode_rows(self, rows: np.ndarray, out: np.ndarray, first: int) -> None:
        """rows (R, chunk bytes) -> out (R, L): chunk `first + r` in row r."""
        length = out.shape[1]
        kc, p, v = self._layout(length)
        idx = self._offsets(rows[:, :p], kc, length, first)  # (R, kc) int64
        values = np.empty((rows.shape[0], kc), np.float32)
        if not self._decode_values_at_once(rows[:, p:], values):
            meta = CodecMeta(codec=self.value.name, numel=kc, block_size=self.value.block_size)
            for r in range(rows.shape[0]):
                try:
                    self.value.decode_into(rows[r, p:].data, meta,
                                           torch.from_numpy(values[r]))
                except CodecError as e:
                    raise CodecError(f"{self.name} data, chunk {first + r}: {e}") from None
        np.put_along_axis(out, idx, values, axis=1)

    def _decode_values_at_once(self, vals: np.ndarray, out: np.ndarray) -> bool:
        """Decode every row's values (R, value bytes) into out (R, kc) with one call of the
        value codec, where the rows' blocks are whole (kc a multiple of the block size): the
        rows' scales, then the rows' codes, are then one encoding of R * kc values. False,
        having decoded nothing for sure, where that does not apply or a row is malformed
        (the caller's per-row pass then names the chunk)."""
        n_rows, kc = out.shape
        bs = self.value.block_size
        if kc % bs or n_rows < 2:
            return False
        scale_bytes = (kc // bs) * SCALE_BYTES if CODECS[self.value.name].is_block else 0
        data = np.concatenate([vals[:, :scale_bytes].reshape(-1),
                               vals[:, scale_bytes:].reshape(-1)])
        meta = CodecMeta(codec=self.value.name, numel=n_rows * kc, block_size=bs)
        try:
            self.value.decode_into(data.data, meta, torch.from_numpy(out.reshape(-1)))
        except CodecError:
            return False
        return True

    def _offsets(self, pos: np.ndarray, kc: int, length: int, first: int) -> np.ndarray:
        """(R, position bytes) -> (R, kc) increasing offsets below `length`, checked."""
        if 2 * kc <= pos.shape[1]:
            idx = np.ascontiguousarray(pos).view("<u2").astype(np.int64)  # (R, kc)
            bad = (idx >= length).any(axis=1) | (np.diff(idx, axis=1) <= 0).any(axis=1)
            if bad.any():
                raise CodecError(f"{self.name} data, chunk {first + int(bad.argmax())}: "
                                 f"offsets must be strictly increasing and below {length}")
            return idx
        bits = np.unpackbits(pos, axis=1, bitorder="little")  # (R, 8 * position bytes)
        count = bits.sum(axis=1)
        bad = (count != kc) | bits[:, length:].any(axis=1)
        if bad.any():
            r = int(bad.argmax())
            raise CodecError(f"{self.name} data, chunk {first + r}: bitmap holds "
                             f"{int(bits[r, :length].sum())} position(s) in {length} values "
                             f"(padding bits {int(bits[r, length:].sum())}), expected {kc}")
        return np.nonzero(bits)[1].reshape(-1, kc).astype(np.int64)

