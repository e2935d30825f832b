"""Wire messages of state sync (protocol/README.md, "State sync"), validated, and their framing.

A joiner opens one TCP connection to each serving peer's state listener, authenticates it
(`link`: each frame is then followed by a MAC tag) and sends requests; the server answers
each in order, so a client may pipeline several. Frames are a 4-byte big-endian body length
and a msgpack map whose `type` names the message:

    manifest?  {version, run_id}                 -> manifest | error
    chunk?     {digest}                          -> chunk | error
    manifest   {version, run_id, config_digest, step, current_step, rounds, outer_steps,
                chunk_bytes, tensors: [{name, numel, chunks: [BLAKE3-256 bytes, ...]}, ...],
                replays: [{fragment, round, codec, block_size, numels, nbytes, chunks}, ...],
                chains}
    chunk      {digest, payload}                 (blake3(payload) == digest)
    error      {reason}

Chunks are asked for by content (their BLAKE3 hash), so a chunk survives a newer snapshot when its
fragment has not changed, and a joiner never downloads bytes it already holds. A manifest's
`replays` name, per fragment, the encoded results of the last rounds that fragment landed
(`algo/replay.py`), cut into chunks the same way: a joiner holding chunks of the fragment
from before those rounds fetches them and replays the rounds instead of fetching the
chunks again. No I/O here.
"""

from __future__ import annotations

import struct
from typing import Annotated, Any, Literal

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dilonode import PROTOCOL_VERSION
from dilonode.train.state import tensor_names
from dilonode.wire.errors import RemoteProtocolError, one_line

__all__ = ["BUSY", "HEADER", "MAX_FRAME_BYTES", "Chunk", "ChunkRequest", "Error", "Manifest",
           "ManifestRequest", "RoundReplay", "StateMessage", "TensorChunks", "chunk_count",
           "decode_body", "encode_frame", "replay_name"]

BUSY = "busy"  # an Error reason with this prefix: ask again shortly
HEADER = struct.Struct(">I")
# The largest chunk (64 MiB, StateSyncConfig.chunk_bytes) plus room for its envelope; a
# manifest of a 1B-parameter state at 1 MiB chunks is ~0.3 MB.
MAX_FRAME_BYTES = (64 << 20) + (1 << 16)
_U63 = 2**63 - 1
Digest = Annotated[bytes, Field(min_length=32, max_length=32)]
Count = Annotated[int, Field(ge=0, le=_U63)]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class ManifestRequest(_Model):
    type: Literal["manifest?"] = "manifest?"
    version: int = PROTOCOL_VERSION
    run_id: str = Field(min_length=1, max_length=128)


class ChunkRequest(_Model):
    type: Literal["chunk?"] = "chunk?"
    digest: Digest


class TensorChunks(_Model):
    """One float32 tensor of the state and the BLAKE3 hash of each of its chunks, in order."""

    name: str = Field(min_length=1, max_length=64)
    numel: int = Field(ge=1, le=2**40)
    chunks: list[Digest] = Field(min_length=1)


def chunk_count(numel: int, chunk_bytes: int) -> int:
    """Chunks of `chunk_bytes` bytes (the last one shorter) covering `numel` float32 values."""
    return -(-numel * 4 // chunk_bytes)


def replay_name(fragment: int, round_no: int) -> str:
    """How servers and the fetch plan name a replay's bytes among the state's tensors."""
    return f"replay.{fragment}.{round_no}"


class RoundReplay(_Model):
    """The encoded result of round `round` of `fragment` (the one that took its counter to
    `round + 1`): `numels[i]` values per codec piece, `nbytes` in all, then chunked."""

    fragment: int = Field(ge=0, le=4095)
    round: Count
    codec: str = Field(min_length=1, max_length=32)  # as the round's messages
    block_size: int = Field(ge=1, le=1 << 20)
    numels: list[Annotated[int, Field(ge=1, le=2**40)]] = Field(min_length=1,
                                                                 max_length=1 << 20)
    nbytes: int = Field(ge=1, le=2**42)
    chunks: list[Digest] = Field(min_length=1)


class Manifest(_Model):
    """A server's snapshot: its step, per-fragment counters and the chunk digests."""

    type: Literal["manifest"] = "manifest"
    version: int = PROTOCOL_VERSION
    run_id: str = Field(min_length=1, max_length=128)
    config_digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    step: Count
    current_step: Count  # the step the asker must reach (SnapshotSource.step_now)
    rounds: list[Count] = Field(min_length=1, max_length=4096)
    outer_steps: list[Count] = Field(min_length=1, max_length=4096)
    chunk_bytes: int = Field(ge=4096, le=64 << 20)
    tensors: list[TensorChunks] = Field(min_length=2, max_length=8192)
    replays: list[RoundReplay] = Field(default_factory=list, max_length=4096)
    # Per fragment, the hash chain of the rounds applied (algo/chain.py); [] if unknown.
    chains: list[Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]] = Field(
        default_factory=list, max_length=4096)

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        if len(self.rounds) != len(self.outer_steps):
            raise ValueError("rounds and outer_steps differ in length")
        if self.chains and len(self.chains) != len(self.rounds):
            raise ValueError(f"{len(self.chains)} chains for {len(self.rounds)} fragments")
        names = [t.name for t in self.tensors]
        if names != tensor_names(len(self.rounds)):
            raise ValueError(f"tensors {one_line(str(names), 120)} are not the "
                             f"{len(self.rounds)}-fragment state")
        for t in self.tensors:
            if len(t.chunks) != chunk_count(t.numel, self.chunk_bytes):
                raise ValueError(f"tensor {t.name}: {len(t.chunks)} chunks for {t.numel} "
                                 f"values at {self.chunk_bytes} bytes per chunk")
        last: dict[int, int] = {}  # fragment -> the round listed before
        for r in self.replays:
            what = f"replay of fragment {r.fragment} round {r.round}"
            if r.fragment >= len(self.rounds):
                raise ValueError(f"{what}: not a fragment of this state")
            if r.fragment in last and last[r.fragment] + 1 != r.round:
                raise ValueError(f"{what}: listed after its round {last[r.fragment]} "
                                 "(a fragment's replays are consecutive rounds, in order)")
            last[r.fragment] = r.round
            if sum(r.numels) != self.tensors[2 * r.fragment].numel:
                raise ValueError(f"{what}: {sum(r.numels)} values, the fragment has "
                                 f"{self.tensors[2 * r.fragment].numel}")
            if len(r.chunks) != -(-r.nbytes // self.chunk_bytes):
                raise ValueError(f"{what}: {len(r.chunks)} chunks for {r.nbytes} bytes at "
                                 f"{self.chunk_bytes} bytes per chunk")
        for p, r in last.items():
            if r + 1 != self.rounds[p]:
                raise ValueError(f"replay of fragment {p} round {r}: the fragment's last "
                                 f"replay, but the state has landed {self.rounds[p]} rounds")
        return self

    def tensor_digests(self) -> set[bytes]:
        """Every chunk digest of the state's tensors (not of its replays)."""
        return {d for t in self.tensors for d in t.chunks}

    def replays_of(self, fragment: int) -> dict[int, RoundReplay]:
        """Round -> the replay of that round of `fragment`."""
        return {r.round: r for r in self.replays if r.fragment == fragment}

    def content_key(self) -> tuple[Any, ...]:
        """What two manifests must share to describe the same state (the step may differ)."""
        return (tuple(self.rounds), tuple(self.outer_steps), tuple(self.chains),
                self.chunk_bytes, tuple((t.name, t.numel, tuple(t.chunks))
                                        for t in self.tensors))

    @property
    def nbytes(self) -> int:
        return sum(t.numel * 4 for t in self.tensors)


class Chunk(_Model):
    type: Literal["chunk"] = "chunk"
    digest: Digest
    payload: bytes


class Error(_Model):
    type: Literal["error"] = "error"
    reason: str = Field(max_length=512)


StateMessage = ManifestRequest | ChunkRequest | Manifest | Chunk | Error
_TYPES: dict[str, type[StateMessage]] = {
    "manifest?": ManifestRequest, "chunk?": ChunkRequest, "manifest": Manifest,
    "chunk": Chunk, "error": Error}


def encode_frame(msg: StateMessage) -> bytes:
    body = msgpack.packb(msg.model_dump(), use_bin_type=True)
    if len(body) > MAX_FRAME_BYTES:
        raise ValueError(f"state sync {msg.type}: {len(body)} bytes > {MAX_FRAME_BYTES}")
    return HEADER.pack(len(body)) + body


def decode_body(body: bytes) -> StateMessage:
    """One frame body -> message; RemoteProtocolError with a one-line reason otherwise."""
    try:
        data = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise RemoteProtocolError(f"state sync frame is not msgpack ({type(exc).__name__})") \
            from None
    kind = _TYPES.get(str(data.get("type"))) if isinstance(data, dict) else None
    if kind is None:
        got = data.get("type") if isinstance(data, dict) else type(data).__name__
        raise RemoteProtocolError(f"state sync: unknown message type {one_line(repr(got), 40)}")
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in err["loc"]) or kind.__name__
        raise RemoteProtocolError(f"state sync {data['type']}: {where}: {err['msg']}") \
            from None
