"""Wire messages of the butterfly all-reduce, as validated, immutable pydantic models.

Six messages exist. Three make the handshake that opens every connection: `Hello` (who is
speaking, for which run, with its public key and a nonce), `HelloAck` and `HelloAuth` (each
side's proof of its identity and of the swarm secret; `dilonode.net.channel`). The
three round messages are `Contribution` (a member's encoded chunk of someone else's part),
`Result` (the part owner's averaged chunk, sent back to everyone) and `Abort` (a member gives
up the round, naming the members it blames). Each is a msgpack map whose `type` key names
the message; the other keys are the model's fields in declaration order
(protocol/README.md is the normative spec).

Use `message_to_dict` / `message_from_dict` to go between models and plain maps; framing.py
adds msgpack and the length prefix. Validation is strict (no "1" -> 1 coercion, no bools as
ints) because everything here comes from untrusted peers. Semantic checks that need round
context (is this the chunk we expect? does the payload length match the codec?) live in
`dilonode.allreduce.round`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    ValidationError,
    field_validator,
    model_validator,
)

from dilonode import PROTOCOL_VERSION
from dilonode.wire.errors import RemoteProtocolError, one_line

__all__ = [
    "ABORT_REASON_MAX",
    "MAX_MEMBERS",
    "MAX_WEIGHT",
    "MESSAGE_TYPES",
    "Abort",
    "Contribution",
    "HandshakeMessage",
    "Hello",
    "HelloAck",
    "HelloAuth",
    "Message",
    "Result",
    "RoundMessage",
    "message_from_dict",
    "message_to_dict",
    "message_to_json",
]

MAX_MEMBERS = 4096
MAX_WEIGHT = 1e15  # tokens in one contribution; far above any real round
ABORT_REASON_MAX = 256
HANDSHAKE_KEY_MAX = 1024
HANDSHAKE_NONCE_MAX = 64
HANDSHAKE_SIG_MAX = 512
HANDSHAKE_MAC_MAX = 64
_U32 = 2**32 - 1
_U63 = 2**63 - 1

Member = Annotated[int, Field(ge=0, lt=MAX_MEMBERS)]
U32 = Annotated[int, Field(ge=0, le=_U32)]
U63 = Annotated[int, Field(ge=0, le=_U63)]
# Round messages must carry these keys on the wire even though the models default them, so
# a peer built before they existed is refused instead of silently joining attempt 0.
_ROUND_KEYS_REQUIRED = ("attempt", "group")


def _payload(value: object) -> bytes | memoryview:
    # A received payload may be a read-only view of its frame (framing's zero-copy path);
    # anything else that is not bytes is refused, as strict mode would.
    if type(value) is bytes:
        return value
    if (isinstance(value, memoryview) and value.readonly and value.format == "B"
            and value.ndim == 1 and value.c_contiguous):
        return value
    raise ValueError(f"must be bytes, got {type(value).__name__}")


def _as_is(value: bytes | memoryview) -> bytes | memoryview:
    return value


# The encoded values a message carries: bytes, or a read-only 1-D memoryview of bytes.
Payload = Annotated[bytes, PlainValidator(_payload), PlainSerializer(_as_is, return_type=Any)]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class Hello(_Model):
    """First frame on every connection: the connecting peer's id, run and protocol version,
    its libp2p public key and a fresh nonce (handshake: protocol/README.md section 9)."""

    type: Literal["hello"] = Field("hello", exclude=True)
    version: int = Field(PROTOCOL_VERSION, ge=0, le=_U32)
    run_id: str = Field(min_length=1, max_length=128)
    peer_id: str = Field(min_length=1, max_length=128)
    public_key: bytes = Field(b"", max_length=HANDSHAKE_KEY_MAX)
    nonce: bytes = Field(b"", max_length=HANDSHAKE_NONCE_MAX)


class HelloAck(_Model):
    """The acceptor's answer to a `Hello`: its identity and nonce, and its proofs (signature
    with its identity key, MAC with the swarm key) over the handshake transcript."""

    type: Literal["hello_ack"] = Field("hello_ack", exclude=True)
    version: int = Field(PROTOCOL_VERSION, ge=0, le=_U32)
    run_id: str = Field(min_length=1, max_length=128)
    peer_id: str = Field(min_length=1, max_length=128)
    public_key: bytes = Field(b"", max_length=HANDSHAKE_KEY_MAX)
    nonce: bytes = Field(max_length=HANDSHAKE_NONCE_MAX)
    signature: bytes = Field(b"", max_length=HANDSHAKE_SIG_MAX)
    mac: bytes = Field(max_length=HANDSHAKE_MAC_MAX)


class HelloAuth(_Model):
    """The connecting peer's proofs over the same transcript; round frames follow it."""

    type: Literal["auth"] = Field("auth", exclude=True)
    version: int = Field(PROTOCOL_VERSION, ge=0, le=_U32)
    run_id: str = Field(min_length=1, max_length=128)
    signature: bytes = Field(b"", max_length=HANDSHAKE_SIG_MAX)
    mac: bytes = Field(max_length=HANDSHAKE_MAC_MAX)


class _Base(_Model):
    """Fields every round message carries: who sent it, for which run, fragment, round,
    retry attempt and agreed group (`group` is the sha256 hex of the member list, or "")."""

    version: int = Field(PROTOCOL_VERSION, ge=0, le=_U32)
    run_id: str = Field(min_length=1, max_length=128)
    fragment: U32
    round: U63
    attempt: U32 = 0
    group: str = Field("", pattern=r"^([0-9a-f]{64})?$")
    sender: Member


class _Chunk(_Base):
    """Fields shared by the two messages that carry an encoded chunk of a part."""

    owner: Member
    chunk: U32
    n_chunks: int = Field(ge=1, le=_U32)
    offset: U63
    numel: int = Field(ge=1, le=_U32)
    codec: str = Field(min_length=1, max_length=32, pattern=r"^[a-z0-9_]+$")
    block_size: int = Field(ge=1, le=1 << 20)

    @model_validator(mode="after")
    def _chunk_in_range(self) -> _Chunk:
        if self.chunk >= self.n_chunks:
            raise ValueError(f"chunk: {self.chunk} must be < n_chunks {self.n_chunks}")
        return self


class Contribution(_Chunk):
    """`sender`'s encoded values [offset, offset + numel) of the part owned by `owner`;
    `weight` is the tokens the sender trained on since it last synced this fragment (the
    owner's mean is weighted by it; the same in every chunk of one round)."""

    type: Literal["contribution"] = Field("contribution", exclude=True)
    weight: float = Field(ge=0.0, le=MAX_WEIGHT, allow_inf_nan=False)
    payload: Payload


class Result(_Chunk):
    """The owner's averaged chunk; the last chunk carries the sha256 `digest` of the part.

    `rejected` lists the contributors whose chunk the owner's checks left out of this
    chunk's aggregate (robust aggregation); absent when none was.
    """

    type: Literal["result"] = Field("result", exclude=True)
    contributors: tuple[Member, ...] = Field(min_length=1, max_length=MAX_MEMBERS)
    rejected: tuple[Member, ...] | None = Field(None, min_length=1, max_length=MAX_MEMBERS)
    payload: Payload
    digest: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")

    @field_validator("contributors", "rejected", mode="before")
    @classmethod
    def _list_to_tuple(cls, value: Any) -> Any:
        # msgpack yields arrays as lists; strict mode would refuse a list for a tuple.
        return tuple(value) if isinstance(value, list) else value

    @model_validator(mode="after")
    def _rejected_among_contributors(self) -> Result:
        if self.rejected is None:
            return self
        if list(self.rejected) != sorted(set(self.rejected)):
            raise ValueError("rejected: must be strictly increasing member indices")
        if not set(self.rejected) < set(self.contributors):
            raise ValueError("rejected: must be a proper subset of contributors")
        return self

    @model_validator(mode="after")
    def _digest_on_last(self) -> Result:
        last = self.chunk == self.n_chunks - 1
        if last and self.digest is None:
            raise ValueError("digest: required on the last chunk")
        if not last and self.digest is not None:
            raise ValueError("digest: only the last chunk carries it")
        return self


class Abort(_Base):
    """The sender gives up the round; `reason` is for logs, `culprits` the member indices the
    sender blames, so that every member can leave the same peers out of the retry."""

    type: Literal["abort"] = Field("abort", exclude=True)
    reason: str = Field("", max_length=ABORT_REASON_MAX)
    culprits: tuple[Member, ...] = Field((), max_length=MAX_MEMBERS)

    @field_validator("culprits", mode="before")
    @classmethod
    def _list_to_tuple(cls, value: Any) -> Any:
        return tuple(value) if isinstance(value, list) else value


RoundMessage = Contribution | Result | Abort
HandshakeMessage = Hello | HelloAck | HelloAuth
Message = RoundMessage | HandshakeMessage
MESSAGE_TYPES: dict[str, type[Message]] = {
    "hello": Hello,
    "hello_ack": HelloAck,
    "auth": HelloAuth,
    "contribution": Contribution,
    "result": Result,
    "abort": Abort,
}


def message_to_dict(msg: Message) -> dict[str, Any]:
    """The msgpack map of `msg`: `type` first, then fields in declaration order.

    A `digest` of None is left out rather than sent as nil, so each message has exactly one
    encoding (golden vectors depend on it).
    """
    body: dict[str, Any] = {"type": msg.type}
    body.update(msg.model_dump(exclude={"type"}, exclude_none=True))
    return body


def message_to_json(msg: Message) -> dict[str, Any]:
    """`message_to_dict` in JSON terms (payload as hex, lists for tuples): golden vectors."""
    fields = message_to_dict(msg)
    for key, value in fields.items():
        if isinstance(value, bytes | memoryview):
            fields[key] = value.hex()
    for key in ("contributors", "rejected", "culprits"):
        if key in fields:
            fields[key] = list(fields[key])
    return fields


def _validation_reason(kind: str, err: ValidationError) -> str:
    errors = err.errors(include_url=False)
    first = errors[0]
    loc = ".".join(str(p) for p in first["loc"])
    got = first.get("input")
    shown = "" if isinstance(got, dict) else f" (got {one_line(repr(got), 60)})"
    msg = first["msg"].removeprefix("Value error, ")
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    # Cross-field validators have no location; their message starts with the field name.
    where = f"field {loc}: {msg}{shown}" if loc else f"field {msg}"
    return f"invalid {kind} message: {where}{more}"


def message_from_dict(body: Any) -> Message:
    """Validate a decoded msgpack map into a message; RemoteProtocolError on any problem.

    The version is checked before the fields so a peer on another protocol version gets
    "version mismatch" rather than a confusing field error.
    """
    if not isinstance(body, dict):
        raise RemoteProtocolError(f"message body is a {type(body).__name__}, expected a map")
    if not all(isinstance(k, str) for k in body):
        raise RemoteProtocolError("message map has a non-string key")
    kind = body.get("type")
    if kind is None:
        raise RemoteProtocolError("message has no 'type' field")
    model = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise RemoteProtocolError(f"unknown message type {one_line(repr(kind), 40)}")
    if "version" not in body:
        raise RemoteProtocolError(f"invalid {kind} message: field version: missing")
    version = body["version"]
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise RemoteProtocolError(
            f"protocol version mismatch: expected {PROTOCOL_VERSION}, "
            f"got {one_line(repr(version), 40)}")
    if model not in (Hello, HelloAck, HelloAuth):
        for key in _ROUND_KEYS_REQUIRED:
            if key not in body:
                raise RemoteProtocolError(f"invalid {kind} message: field {key}: missing")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise RemoteProtocolError(_validation_reason(kind, exc)) from None
