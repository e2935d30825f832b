"""Where a round's numbers live: the host path (CPU) and the torch path (any device).

`AllReduceRound` asks its path to encode contributions and results, to accept (check) a
contribution on arrival, to fold the accepted contributions of a chunk into the result
(`butterfly.reduction_steps`), and to decode result chunks into the output. Both paths
compute the same bits; they differ in where:

* `HostPath` (CPU tensors): the codecs of `codecs.py` (compiled kernels by default). An
  accepted contribution stays encoded (the payload, checked) until its chunk is complete;
  the owner then dequantizes each contribution straight into the result in member order,
  one pass per contribution. float32 payloads are summed from the received bytes and
  checked only through their sum: NaN and Inf survive a sum, the mean's encode refuses a
  non-finite one, and only then is each contribution checked to name its sender
  (`culprit`), one pass fewer over every contribution.
* `TorchPath` (a CUDA tensor, or any tensor when asked): `torch_codecs.py` on the tensor's
  device. Contributions are encoded for all other parts at once when the round starts and
  copied to the host in one piece per part; received payloads are copied to the device and
  decoded there; the reduction runs there. Only encoded bytes cross to the host, except
  the decoded result chunks that the digests hash (BLAKE3 over float32 values: protocol
  section 5.1). Off a GPU, bytes go into page-locked (pinned) host memory, 4x faster than
  pageable, and a result chunk is hashed on every core: a GPU host's cores have little
  else to do while it trains, and one core's BLAKE3 took a third of a 50M-value int4
  round (docs/reports/2026-11-28-gpu-allreduce-h200.md). A float32 result chunk is hashed
  from its payload, which holds the values' bytes, with no copy off the device.

Either path takes an `encoded` contribution (`algo/spliced.SplicedEncoding`: the node's
ranks encoded their slices in parallel): chunks it covers are sent as it has them, the
others encoded here as usual. Neither path does I/O; the round stays sans-IO.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Union

import blake3
import numpy as np
import torch

from dilonode.algo.codecs import (
    Codec,
    CodecError,
    CodecMeta,
    accumulate_tensor,
    check_layout,
    decode_shared,
    fold_float32,
    sums_raw_values,
)
from dilonode.algo.sliced_encoding import SplicedEncoding
from dilonode.algo.torch_codecs import decode_torch, encode_chunks_torch, encode_torch

__all__ = ["Accepted", "DataPath", "HostPath", "TorchPath", "chunk_hash", "make_path"]

Payload = Union[bytes, memoryview]  # noqa: UP007 (a runtime alias)
# What a path keeps of a contribution between its arrival and its chunk's reduction.
Accepted = Union[Payload, torch.Tensor]  # noqa: UP007
# Below this many bytes one core hashes a chunk faster than a thread pool starts on it.
_THREADED_HASH_BYTES = 1 << 20


def lossless(codec: Codec) -> bool:
    """decode(encode(x)) == x, bit for bit, for finite x: float32, whose payload is the
    values' own little-endian bytes (a round trip or a decode of it can be skipped)."""
    return codec.name == "float32"


def chunk_hash(values: torch.Tensor, *, threads: int = 1) -> bytes:
    """blake3 of one decoded result chunk, as little-endian float32 bytes (32 bytes).
    `threads`: blake3's max_threads (`blake3.blake3.AUTO`: every core); the same digest."""
    arr = np.ascontiguousarray(values.detach().cpu().numpy(), dtype="<f4")
    return _blake3(arr.view(np.uint8).data, threads)


def _blake3(data: Payload, threads: int) -> bytes:
    if threads != 1 and len(data) < _THREADED_HASH_BYTES:
        threads = 1
    return blake3.blake3(data, max_threads=threads).digest()


class HostPath:
    """CPU tensors and the `codecs.py` codecs (see the module docstring)."""

    name = "host"

    def __init__(self, codec: Codec, local: torch.Tensor,
                 encoded: SplicedEncoding | None = None) -> None:
        self.codec = codec
        self.local = local  # (numel,) float32 CPU, contiguous, checked finite
        self.lossless = lossless(codec)
        self.encoded = encoded  # `local` as the node's ranks encoded it, or None
        self.deferred = sums_raw_values(codec)  # values checked through their sum

    def meta(self, numel: int) -> CodecMeta:
        return CodecMeta(codec=self.codec.name, numel=numel, block_size=self.codec.block_size)

    def prepare(self, chunks: Sequence[tuple[int, int]]) -> None:
        """Called once at start with the (start, numel) of every contribution to send."""

    def contribution(self, start: int, numel: int) -> Payload:
        """Our encoded values [start, start + numel) of `local`."""
        own = self.local[start:start + numel]
        if self.encoded is not None and not self.lossless:
            got = self.encoded.payload(start, numel)
            if got is not None:
                return got
        if self.lossless:
            # float32 bytes as they are, a read-only view of `local` (checked finite at
            # construction; the caller leaves it alone: `run_round`).
            return memoryview(own.numpy()).cast("B").toreadonly()
        return self.codec.encode(own)[0]

    def accept(self, payload: Payload, meta: CodecMeta) -> Accepted:
        """Check a contribution (CodecError if bad) and keep it for its chunk's reduction;
        float32 values are checked later, through their sum (module docstring)."""
        if self.deferred:
            check_layout(self.codec, payload, meta)
        else:
            self.codec.check(payload, meta)
        return payload

    def culprit(self, accepted: Sequence[Accepted], numel: int) -> tuple[int, str] | None:
        """The first accepted contribution whose values `accept` did not check and that
        are bad, and why; None if there is none (a sum of finite values overflowed)."""
        if not self.deferred:
            return None
        meta = self.meta(numel)
        for i, item in enumerate(accepted):
            assert not isinstance(item, torch.Tensor)
            try:
                self.codec.check(item, meta)
            except CodecError as exc:
                return i, str(exc)
        return None

    def own(self, start: int, numel: int) -> Accepted:
        """Our own contribution to our part, treated as everyone's: encoded."""
        return self.contribution(start, numel)

    def combine(self, accepted: Sequence[Accepted], steps: Sequence[tuple[str, float]],
                out: torch.Tensor) -> torch.Tensor:
        """Fold the chunk's contributions (member order) into out by `steps`."""
        meta = self.meta(out.numel())
        for item, (step, coef) in zip(accepted, steps, strict=True):
            assert not isinstance(item, torch.Tensor)
            self.codec.accumulate(item, meta, out, step, coef)
        return out

    def combine_encode(self, accepted: Sequence[Accepted], steps: Sequence[tuple[str, float]],
                       out: torch.Tensor) -> tuple[torch.Tensor, Payload]:
        """`combine`, then `encode` of the result (CodecError if it is not finite); float32
        payloads in one sweep per four of them (`codecs.fold_float32`)."""
        if self.deferred:
            payloads = [item for item in accepted if not isinstance(item, torch.Tensor)]
            if (encoded := fold_float32(self.codec, payloads, steps, out)) is not None:
                return out, encoded
        value = self.combine(accepted, steps, out)
        return value, self.encode(value)

    def values(self, item: Accepted, numel: int) -> torch.Tensor:
        """The decoded values of an accepted contribution (robust aggregators need them)."""
        assert not isinstance(item, torch.Tensor)
        return decode_shared(self.codec, bytes(item), self.meta(numel))

    def encode(self, values: torch.Tensor) -> Payload:
        return self.codec.encode(values)[0]

    def decode_into(self, payload: Payload, meta: CodecMeta, out: torch.Tensor) -> None:
        self.codec.decode_into(payload, meta, out)

    def hash_chunk(self, values: torch.Tensor, payload: Payload) -> bytes:
        """`chunk_hash` of a decoded result chunk (`payload` encodes it): on one core, the
        others train."""
        return chunk_hash(values)

    def empty(self, numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=torch.float32)


class TorchPath:
    """Tensors on one device and the `torch_codecs.py` codecs (see the module docstring)."""

    name = "torch"

    def __init__(self, codec: Codec, local: torch.Tensor,
                 encoded: SplicedEncoding | None = None) -> None:
        self.codec = codec
        self.local = local  # (numel,) float32 on self.device, contiguous, checked finite
        self.encoded = encoded  # `local` as the node's ranks encoded it, or None
        self.device = local.device
        self.lossless = lossless(codec)
        self._sent: dict[int, memoryview] = {}  # contribution start -> its encoded bytes
        self._n = torch.empty(0)  # the group size as a device scalar (see `_divide`)
        self._pinned = local.device.type == "cuda"
        self._staging: torch.Tensor | None = None  # pinned float32, a result chunk to hash

    def meta(self, numel: int) -> CodecMeta:
        return CodecMeta(codec=self.codec.name, numel=numel, block_size=self.codec.block_size)

    def prepare(self, chunks: Sequence[tuple[int, int]]) -> None:
        """Encode every contribution we will send, batched per run of consecutive chunks
        (a part), and bring each run to the host in one copy."""
        for run in _runs(chunks):
            start, end = run[0][0], run[-1][0] + run[-1][1]
            enc = encode_chunks_torch(self.codec, self.local[start:end], run[0][1])
            host = memoryview(self._to_host(enc).numpy()).cast("B").toreadonly()  # (E_run,)
            offset = 0
            for chunk_start, numel in run:
                size = self.codec.encoded_size(numel)
                self._sent[chunk_start] = host[offset:offset + size]
                offset += size

    def contribution(self, start: int, numel: int) -> Payload:
        got = self.encoded.payload(start, numel) if self.encoded is not None else None
        if got is not None:
            return got
        sent = self._sent.pop(start, None)
        if sent is not None and len(sent) == self.codec.encoded_size(numel):
            return sent
        return self.encode(self.local[start:start + numel])

    def accept(self, payload: Payload, meta: CodecMeta) -> Accepted:
        return decode_torch(self.codec, self._to_device(payload), meta)  # (numel,)

    def culprit(self, accepted: Sequence[Accepted], numel: int) -> tuple[int, str] | None:
        return None  # every contribution was decoded, and so checked, on arrival

    def own(self, start: int, numel: int) -> Accepted:
        data = encode_torch(self.codec, self.local[start:start + numel])
        return decode_torch(self.codec, data, self.meta(numel))  # decode(encode(own))

    def combine(self, accepted: Sequence[Accepted], steps: Sequence[tuple[str, float]],
                out: torch.Tensor) -> torch.Tensor:
        for v, (step, coef) in zip(accepted, steps, strict=True):
            assert isinstance(v, torch.Tensor)
            accumulate_tensor(v, out, step,
                              self._divisor(coef) if step == "add_divide" else coef)
        return out

    def combine_encode(self, accepted: Sequence[Accepted], steps: Sequence[tuple[str, float]],
                       out: torch.Tensor) -> tuple[torch.Tensor, Payload]:
        value = self.combine(accepted, steps, out)
        return value, self.encode(value)

    def values(self, item: Accepted, numel: int) -> torch.Tensor:
        assert isinstance(item, torch.Tensor)
        return item

    def encode(self, values: torch.Tensor) -> Payload:
        host = self._to_host(encode_torch(self.codec, values))
        return memoryview(host.numpy()).cast("B").toreadonly()

    def decode_into(self, payload: Payload, meta: CodecMeta, out: torch.Tensor) -> None:
        decode_torch(self.codec, self._to_device(payload), meta, out=out)

    def hash_chunk(self, values: torch.Tensor, payload: Payload) -> bytes:
        """`chunk_hash` of a decoded result chunk (`payload` encodes it), on every core; a
        float32 payload holds the values' own bytes (little-endian, as decoded)."""
        if self.lossless:
            return _blake3(payload, blake3.blake3.AUTO)
        if self._pinned:
            n = values.numel()
            if self._staging is None or self._staging.numel() < n:
                self._staging = torch.empty(n, dtype=torch.float32, pin_memory=True)
            values = self._staging[:n].copy_(values)  # synchronous: done before the hash
        return chunk_hash(values, threads=blake3.blake3.AUTO)

    def empty(self, numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=torch.float32, device=self.device)

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of t, never a view of it; page-locked off a GPU (PyTorch caches
        page-locked blocks, so a round's copies reuse the last round's)."""
        if not self._pinned:
            return t.to("cpu", copy=True)
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)

    def _to_device(self, payload: Payload) -> torch.Tensor:
        """Host bytes -> (len,) uint8 on the device."""
        if not len(payload):
            return torch.empty(0, dtype=torch.uint8, device=self.device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffer: never written
            host = torch.frombuffer(payload, dtype=torch.uint8)
        return host.to(self.device)

    def _divisor(self, n: float) -> torch.Tensor:
        # A device tensor: CUDA computes `t / number` as `t * (1 / number)` (butterfly).
        if self._n.numel() != 1 or float(self._n) != n:
            self._n = torch.full((), n, dtype=torch.float32, device=self.device)
        return self._n


DataPath = HostPath | TorchPath


def make_path(codec: Codec, local: torch.Tensor, kind: str | None = None,
              encoded: SplicedEncoding | None = None) -> DataPath:
    """The path for `local`: "torch" for a tensor off the CPU, else "host"; `kind` forces
    one ("torch" also runs on CPU tensors: the tests compare both paths there). `encoded`:
    `local` already encoded by slices (see the module docstring)."""
    kind = kind or ("host" if local.device.type == "cpu" else "torch")
    if kind == "host":
        if local.device.type != "cpu":
            raise ValueError("the host path needs a CPU tensor")
        return HostPath(codec, local, encoded)
    if kind == "torch":
        return TorchPath(codec, local, encoded)
    raise ValueError(f"unknown data path {kind!r}; expected 'host' or 'torch'")


def _runs(chunks: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Split (start, numel) chunks, in order, into runs of adjacent chunks where every chunk
    but the last has the run's first chunk's size (a part's chunks form one run)."""
    runs: list[list[tuple[int, int]]] = []
    for start, numel in sorted(chunks):
        last = runs[-1] if runs else None
        if (last is not None and last[-1][0] + last[-1][1] == start
                and last[-1][1] == last[0][1] and numel <= last[0][1]):
            last.append((start, numel))
        else:
            runs.append([(start, numel)])
    return [run for run in runs if run[0][1]]
