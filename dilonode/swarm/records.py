"""What a node publishes in the swarm DHT, and the DHT keys it publishes under.

Pure data, no hivemind: `dilonode.swarm.dht` stores the bytes made here and hands read bytes
back to `decode_record`, which is the one place that decides whether a foreign record is
usable. Two kinds exist:

* `PeerRecord`: a node's presence in a run (where its TCP data path listens, its bandwidth,
  its step), stored under `peers_key(run_id)` with the peer id as subkey and refreshed by a
  heartbeat before it expires.
* `GroupEntry`: a node's registration for one matchmaking attempt of one fragment round,
  stored under `group_key(run_id, fragment, round, attempt)` with the peer id as subkey.
* `ClockRecord`: the swarm clock a node follows (start time, seconds per reference step),
  under `clock_key(run_id)`; every node republishes the one it follows, so it outlives
  any node (`dilonode.swarm.clock`).
* `LinkRecord`: how long a node's link takes for a round of every fragment, before its
  rounds measure it (a joiner, from its state fetch), under `link_key(run_id)`, read by
  the clock's pacemaker.
* `FinalRecord`: the digest of a node's outer weights at the end of the run, under
  `final_key(run_id)`, which the end-of-run agreement check compares
  (`dilonode.swarm.agreement`).

Encoding is a msgpack map of the model's fields, sealed in the signed envelope of
`dilonode.net.auth.seal_record` with the author's identity key (bound to the run id and the
swarm secret). `decode_record` checks the envelope and signature first (the author must be
admitted and must be the peer the record names), then the protocol version, the run id and
every field, and raises `ValueError` with a one-line reason (`AuthError`, a subclass, for
authentication failures) so callers can log and count a bad record without a traceback.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dilonode import PROTOCOL_VERSION
from dilonode.net.auth import AuthError, Credentials, open_record, seal_record

__all__ = [
    "MAX_RECORD_BYTES",
    "PEER_ID_PATTERN",
    "RUN_ID_PATTERN",
    "VersionMismatch",
    "ClockRecord",
    "FinalRecord",
    "GroupEntry",
    "LinkRecord",
    "MAX_ROSTER",
    "PeerRecord",
    "Record",
    "RosterMember",
    "decode_record",
    "SignedRecord",
    "clock_key",
    "encode_record",
    "final_key",
    "group_key",
    "link_key",
    "peers_key",
]

# Records are small; anything bigger is garbage or abuse and is refused before msgpack
# allocates anything for it.
MAX_RECORD_BYTES = 64 * 1024
# A clock's retunings (`ClockRecord.epochs`): about 20 bytes each, so a full history stays
# well inside a record; the pacemaker adds none past it.
MAX_CLOCK_EPOCHS = 1024
# Same rule as RunConfig.run_id: keeps keys and the group digest unambiguous.
RUN_ID_PATTERN = r"^[A-Za-z0-9._-]{1,128}$"
# libp2p peer ids in their base58 text form.
PEER_ID_PATTERN = r"^[1-9A-HJ-NP-Za-km-z]{1,128}$"
_OPTIONAL_PEER_ID = f"^({PEER_ID_PATTERN[1:-1]})?$"  # a peer id or ""
_KEY_PREFIX = "dilonode"

R = TypeVar("R", bound="SignedRecord")


def _check_data_addr(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{value!r} is not 'host:port' with port 1..65535")
    return value


def _check_finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(f"{value} is not finite")
    return value


class SignedRecord(BaseModel):
    """Fields every published record carries; strict so a peer's types are never coerced."""

    # extra="ignore": a peer of the same protocol version may add optional fields without
    # breaking older readers; incompatible changes bump PROTOCOL_VERSION instead.
    model_config = ConfigDict(frozen=True, strict=True, extra="ignore")

    peer_id: str = Field(pattern=PEER_ID_PATTERN)
    run_id: str = Field(pattern=RUN_ID_PATTERN)
    version: int = Field(PROTOCOL_VERSION, ge=1)


class Record(SignedRecord):
    """A record of a node reachable on the data path."""

    data_addr: str = Field(description="'host:port' of the node's TCP data path")

    @field_validator("data_addr")
    @classmethod
    def _data_addr(cls, value: str) -> str:
        return _check_data_addr(value)


class PeerRecord(Record):
    """A node's presence in a run; `expires_at` is stamped by `SwarmDHT.publish`."""

    bandwidth_mbps: float = Field(ge=0.0)
    step: int = Field(ge=0)
    # Free-form summary for the bootstrap's swarm view (`NodeStatus.summary()`), or
    # {"leaving": True} when withdrawn; readers must treat its contents as untrusted.
    status: dict[str, Any] | None = None
    expires_at: float = Field(0.0, description="DHT time after which the record is void")
    # Where joiners fetch this node's outer state (dilonode/statesync); None: not serving.
    state_addr: str | None = None
    # False: behind a NAT (network.reachable, swarm/reach.py): `data_addr` cannot be
    # dialled, peers open a libp2p stream to the peer id instead. Optional, so readers of
    # the same protocol version that predate it ignore it.
    reachable: bool = True
    # A joiner's first round, on the swarm clock (`diloco.pacing = "time"`): the reference
    # step from which rounds count it. Every round of any fragment that starts at or after
    # it waits for it in matchmaking; every round that starts before it is in the state it
    # adopts. Peers thus agree on which rounds count it whenever each read its record.
    # None: rounds started once the record is read (members, step pacing). Optional, as
    # `reachable` is.
    joins_from: float | None = None

    @field_validator("bandwidth_mbps", "expires_at")
    @classmethod
    def _finite(cls, value: float) -> float:
        return _check_finite(value)

    @field_validator("joins_from")
    @classmethod
    def _joins_from(cls, value: float | None) -> float | None:
        return None if value is None else _check_finite(value)

    @field_validator("state_addr")
    @classmethod
    def _state_addr(cls, value: str | None) -> str | None:
        return None if value is None else _check_data_addr(value)


_CHAIN_PATTERN = r"^([0-9a-f]{32})?$"
_DIGEST_PATTERN = r"^[0-9a-f]{64}$"


class ClockRecord(SignedRecord):
    """The swarm clock: reference step s starts at `t0 + s * step_seconds` (Unix time),
    started by `origin`. Republished unchanged by every node that follows it."""

    t0: float
    step_seconds: float = Field(gt=0.0, le=86400.0)
    origin: str = Field(pattern=PEER_ID_PATTERN)
    # Later epochs: [reference step it starts at, seconds per step], increasing starts.
    epochs: list[list[float]] = Field(default_factory=list, max_length=MAX_CLOCK_EPOCHS)
    # Who added the last epoch ("" when none or unknown): of two pacemakers at once, the
    # smaller id's epoch stands and the other defers to it while it publishes the clock.
    # Optional, so readers of the same protocol version that predate it ignore it.
    paced_by: str = Field("", pattern=_OPTIONAL_PEER_ID)

    @field_validator("t0", "step_seconds")
    @classmethod
    def _finite(cls, value: float) -> float:
        return _check_finite(value)

    @field_validator("epochs")
    @classmethod
    def _epochs(cls, value: list[list[float]]) -> list[list[float]]:
        starts = []
        for pair in value:
            if len(pair) != 2 or not all(isinstance(x, float) and math.isfinite(x)
                                         for x in pair) or not 0 < pair[1] <= 86400.0:
                raise ValueError("each epoch must be [start step, seconds per step > 0]")
            starts.append(pair[0])
        if starts != sorted(set(starts)) or (starts and starts[0] < 0):
            raise ValueError("epoch starts must be >= 0 and increasing")
        return value


class LinkRecord(SignedRecord):
    """Seconds of the author's link a round of every fragment takes
    (`algo.pacing.link_busy_seconds`), from the rate it measured (`rate_Bps`, bytes/s each
    way), published while it has no round latencies of its own: the pacemaker slows the
    clock for it before it takes part; 0 once they have (the need is withdrawn: its
    latencies carry it, and counting both would slow the clock twice for one link)."""

    busy_s: float = Field(ge=0.0, le=86400.0)
    rate_Bps: float = Field(gt=0.0)

    @field_validator("busy_s", "rate_Bps")
    @classmethod
    def _finite(cls, value: float) -> float:
        return _check_finite(value)


class FinalRecord(SignedRecord):
    """A node's outer state when its run ended: the sha256 of its outer weights, its round
    counters and chains, and the tokens it trained (who stands if nodes disagree)."""

    digest: str = Field(pattern=_DIGEST_PATTERN)
    rounds: list[int] = Field(max_length=4096)
    chains: list[str] = Field(max_length=4096)
    tokens: int = Field(ge=0, lt=2**63)
    end_step: int = Field(ge=0, lt=2**63)
    # The digest this node is fetching through state sync right now ("" when none): the
    # holders of those weights wait for it rather than give up after a round's timeout.
    # Optional, so readers of the same protocol version that predate it ignore it.
    adopting: str = Field("", pattern=r"^([0-9a-f]{64})?$")
    # True once this node's own check has ended and it is about to leave: the peers holding
    # its weights keep their DHT up until they read it, since a record that lives only on
    # nodes that have left can no longer be read (optional, as `adopting`).
    checked: bool = False


# Longest roster a leader may publish: keeps an entry well under MAX_RECORD_BYTES.
MAX_ROSTER = 256
# Round settings are a handful of scalars (codec, chunking, aggregator).
_MAX_SETTINGS = 32


class RosterMember(BaseModel):
    """One member of a closed group, as its leader read it: who, where, what weight."""

    model_config = ConfigDict(frozen=True, strict=True, extra="ignore")

    peer_id: str = Field(pattern=PEER_ID_PATTERN)
    data_addr: str
    bandwidth_mbps: float = Field(gt=0.0)

    @field_validator("data_addr")
    @classmethod
    def _data_addr(cls, value: str) -> str:
        return _check_data_addr(value)

    @field_validator("bandwidth_mbps")
    @classmethod
    def _finite(cls, value: float) -> float:
        return _check_finite(value)


class GroupEntry(Record):
    """A node's registration for one matchmaking attempt; `bandwidth_mbps` is its weight.

    `settings` are the round settings every member must share (codec, chunking, how owners
    aggregate); entries whose settings differ from ours are not grouped with us. `roster`
    is set only by a group's leader when it closes the group (`dilonode.swarm.matchmaking`).
    """

    fragment: int = Field(ge=0, lt=2**32)
    round: int = Field(ge=0, lt=2**63)
    attempt: int = Field(ge=0, lt=2**32)
    bandwidth_mbps: float = Field(gt=0.0)
    settings: dict[str, str | int | float] = Field(default_factory=dict,
                                                   max_length=_MAX_SETTINGS)
    roster: list[RosterMember] | None = Field(None, min_length=1, max_length=MAX_ROSTER)
    # The fragment's outer-state chain before this round (algo/chain.py; "" unknown) and
    # the tokens this node has trained in all: matchmaking groups only equal chains, the
    # one with most members (then most tokens, then lowest peer id) standing.
    chain: str = Field("", pattern=_CHAIN_PATTERN)
    tokens: int = Field(0, ge=0, lt=2**63)
    # Bounded groups (algo/groups.py): the registrant counts more live peers than
    # network.max_group_size; on a leader's closing entry, the key was split into groups
    # (every member derives its own from the roster) and their states mix.
    grouped: bool = False

    @field_validator("bandwidth_mbps")
    @classmethod
    def _finite(cls, value: float) -> float:
        return _check_finite(value)

    @field_validator("roster")
    @classmethod
    def _roster(cls, value: list[RosterMember] | None) -> list[RosterMember] | None:
        if value is not None:
            ids = [m.peer_id for m in value]
            if ids != sorted(set(ids)):
                raise ValueError("roster members must be sorted by peer id, without repeats")
        return value


def peers_key(run_id: str) -> str:
    """DHT key holding every PeerRecord of a run (subkey: peer id)."""
    return f"{_KEY_PREFIX}/{run_id}/peers"


def group_key(run_id: str, fragment: int, round: int, attempt: int, index: int = 0) -> str:
    """DHT key of one matchmaking attempt (subkey: peer id); `index` is the key of a
    grouped swarm (`algo.groups.key_index`), 0 the one key of a swarm that is not."""
    base = f"{_KEY_PREFIX}/{run_id}/group/{fragment}/{round}/{attempt}"
    return base if index == 0 else f"{base}/k{index}"


def clock_key(run_id: str) -> str:
    """DHT key of the swarm clock records (subkey: the republishing peer's id)."""
    return f"{_KEY_PREFIX}/{run_id}/clock"


def link_key(run_id: str) -> str:
    """DHT key of the link records (subkey: peer id)."""
    return f"{_KEY_PREFIX}/{run_id}/link"


def final_key(run_id: str) -> str:
    """DHT key of the end-of-run records (subkey: peer id)."""
    return f"{_KEY_PREFIX}/{run_id}/final"


def encode_record(record: SignedRecord, creds: Credentials) -> bytes:
    """The signed bytes that `decode_record` accepts; `creds` must be the record's author."""
    if (record.peer_id, record.run_id) != (creds.peer_id, creds.run_id):
        raise ValueError(f"record of {record.peer_id}@{record.run_id} cannot be signed by "
                         f"{creds.peer_id}@{creds.run_id}")
    return seal_record(creds, msgpack.packb(record.model_dump(mode="python"),
                                            use_bin_type=True))


def _unsigned_version(raw: bytes) -> object:
    """The `version` of a bare (pre-v3, unsigned) record map, to name an older peer."""
    try:
        data = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception:  # garbage: no version to report
        return None
    return data.get("version") if isinstance(data, dict) else None


def _one_line(kind: type[SignedRecord], exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(p) for p in err["loc"]) or "record"
        parts.append(f"{where}: {err['msg']}")
    # Pydantic messages are one line today; flatten anyway so the log line stays one line.
    return f"{kind.__name__}: " + "; ".join(parts).replace("\n", " ")


def decode_record(kind: type[R], raw: bytes, creds: Credentials) -> R:
    """Parse `raw` as a `kind` signed by an admitted peer of run `creds.run_id`.

    Raises AuthError (a ValueError) for a missing or bad signature, an author outside the
    allowlist, or a record naming a peer other than its signer; ValueError with a one-line
    reason for a body that is not a msgpack map, a different protocol version (checked
    first, so a newer peer is named as such), a different run id, or any invalid field.
    """
    if not isinstance(raw, bytes | bytearray):
        raise ValueError(f"{kind.__name__}: expected bytes, got {type(raw).__name__}")
    if len(raw) > MAX_RECORD_BYTES:
        raise ValueError(f"{kind.__name__}: {len(raw)} bytes > {MAX_RECORD_BYTES}")
    try:
        body, author = open_record(creds, bytes(raw))
    except AuthError as exc:
        version = _unsigned_version(bytes(raw))
        if version is not None and version != PROTOCOL_VERSION:
            raise VersionMismatch(kind, version) from None
        raise AuthError(f"{kind.__name__}: {exc}") from None
    record = _parse(kind, body, creds.run_id)
    if record.peer_id != author:
        raise AuthError(f"{kind.__name__}: names peer {record.peer_id} but is signed by "
                        f"{author}")
    return record


class VersionMismatch(ValueError):
    """A record of another protocol version: the one line names both versions."""

    def __init__(self, kind: type, version: Any) -> None:
        super().__init__(f"{kind.__name__}: protocol version {version!r} != "
                         f"{PROTOCOL_VERSION} (the peer speaks {version!r}, this node "
                         f"{PROTOCOL_VERSION}): not averaging with it")
        self.version = version


def _parse(kind: type[R], raw: bytes, run_id: str) -> R:
    try:
        data = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        detail = (str(exc) or type(exc).__name__).replace("\n", " ")[:80]
        raise ValueError(f"{kind.__name__}: not msgpack ({detail})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{kind.__name__}: expected a msgpack map, got {type(data).__name__}")
    version = data.get("version")
    if version != PROTOCOL_VERSION or isinstance(version, bool):
        raise VersionMismatch(kind, version)
    if data.get("run_id") != run_id:
        raise ValueError(f"{kind.__name__}: run id {data.get('run_id')!r} != {run_id!r}")
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        raise ValueError(_one_line(kind, exc)) from None
