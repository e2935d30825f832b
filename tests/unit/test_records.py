"""Tests of dilonode.swarm.records: round trips, one-line rejections, key naming.

Signature checks (forged authors, wrong secret, allowlist) are in tests/unit/test_auth.py.
"""

from __future__ import annotations

import msgpack
import pytest

from dilonode import PROTOCOL_VERSION
from dilonode.net.auth import Credentials, Identity, seal_record
from dilonode.swarm.records import (
    MAX_RECORD_BYTES,
    GroupEntry,
    PeerRecord,
    decode_record,
    encode_record,
    group_key,
    peers_key,
)

RUN = "run-1"
CREDS = Credentials(Identity.generate(), RUN)
PEER = CREDS.peer_id


def _peer(**over: object) -> PeerRecord:
    fields = dict(peer_id=PEER, run_id=RUN, data_addr="127.0.0.1:4000", bandwidth_mbps=100.0,
                  step=7, status={"loss": 3.5, "phase": "inner"}, expires_at=1.5e9)
    return PeerRecord(**{**fields, **over})


def _entry(**over: object) -> GroupEntry:
    fields = dict(peer_id=PEER, run_id=RUN, data_addr="127.0.0.1:4000", bandwidth_mbps=50.0,
                  fragment=2, round=9, attempt=1)
    return GroupEntry(**{**fields, **over})


def _raw(record: PeerRecord | GroupEntry, **over: object) -> bytes:
    """The record's fields with `over` applied, validly signed by CREDS."""
    return seal_record(CREDS, msgpack.packb({**record.model_dump(), **over}, use_bin_type=True))


def _reason(kind: type, raw: object) -> str:
    with pytest.raises(ValueError) as info:
        decode_record(kind, raw, CREDS)  # type: ignore[arg-type]
    message = str(info.value)
    assert "\n" not in message and message.startswith(kind.__name__ + ":")
    return message


@pytest.mark.parametrize("record", [_peer(), _peer(status=None), _peer(joins_from=41.5),
                                    _entry()])
def test_round_trip(record: PeerRecord | GroupEntry) -> None:
    raw = encode_record(record, CREDS)
    assert isinstance(raw, bytes)
    assert decode_record(type(record), raw, CREDS) == record


def test_version_defaults_to_protocol_version() -> None:
    assert _peer().version == PROTOCOL_VERSION == _entry().version


def test_unknown_extra_field_is_tolerated() -> None:
    assert decode_record(PeerRecord, _raw(_peer(), future_field=1), CREDS) == _peer()


@pytest.mark.parametrize("raw", [b"", b"\xc1\xc1", b"\x93\x01\x02\x03", b"\xa3abc", b"\x01"])
def test_garbage(raw: bytes) -> None:
    _reason(PeerRecord, raw)


def test_not_bytes_and_oversize() -> None:
    assert "expected bytes" in _reason(PeerRecord, "text")
    assert str(MAX_RECORD_BYTES) in _reason(PeerRecord, b"\x00" * (MAX_RECORD_BYTES + 1))


def test_wrong_run_id() -> None:
    reason = _reason(PeerRecord, _raw(_peer(), run_id="other"))
    assert "run id 'other' != 'run-1'" in reason


def test_unsigned_record_of_an_older_version_is_named_as_such() -> None:
    bare = msgpack.packb({**_peer().model_dump(), "version": 2}, use_bin_type=True)
    assert f"protocol version 2 != {PROTOCOL_VERSION}" in _reason(PeerRecord, bare)


@pytest.mark.parametrize("version", [PROTOCOL_VERSION + 1, 0, "1", True, None])
def test_wrong_version(version: object) -> None:
    reason = _reason(GroupEntry, _raw(_entry(), version=version))
    assert "protocol version" in reason


def test_version_is_checked_before_run_id() -> None:
    raw = _raw(_peer(run_id="other"), version=PROTOCOL_VERSION + 1)
    assert "protocol version" in _reason(PeerRecord, raw)


@pytest.mark.parametrize("over, field", [
    ({"step": "7"}, "step"),
    ({"step": -1}, "step"),
    ({"bandwidth_mbps": float("nan")}, "bandwidth_mbps"),
    ({"joins_from": float("inf")}, "joins_from"),
    ({"joins_from": "41"}, "joins_from"),
    ({"data_addr": "no-port"}, "data_addr"),
    ({"data_addr": "127.0.0.1:70000"}, "data_addr"),
    ({"peer_id": "not base58 0OIl"}, "peer_id"),
    ({"peer_id": None}, "peer_id"),
])
def test_bad_peer_fields(over: dict[str, object], field: str) -> None:
    assert field in _reason(PeerRecord, _raw(_peer(), **over))


@pytest.mark.parametrize("over, field", [
    ({"bandwidth_mbps": 0.0}, "bandwidth_mbps"),
    ({"fragment": -1}, "fragment"),
    ({"round": 1.0}, "round"),
    ({"attempt": "0"}, "attempt"),
])
def test_bad_entry_fields(over: dict[str, object], field: str) -> None:
    assert field in _reason(GroupEntry, _raw(_entry(), **over))


def test_missing_field() -> None:
    data = _peer().model_dump()
    del data["data_addr"]
    assert "data_addr" in _reason(PeerRecord, seal_record(CREDS, msgpack.packb(data)))


def test_int_bandwidth_is_accepted_as_float() -> None:
    # msgpack writes 100.0 as a float, but another implementation may send an int.
    record = decode_record(PeerRecord, _raw(_peer(), bandwidth_mbps=100), CREDS)
    assert record.bandwidth_mbps == 100


def test_key_naming() -> None:
    assert peers_key(RUN) == "dilonode/run-1/peers"
    assert group_key(RUN, 2, 9, 1) == "dilonode/run-1/group/2/9/1"
    keys = {group_key(RUN, f, r, a) for f in range(3) for r in range(3) for a in range(3)}
    assert len(keys) == 27 and peers_key(RUN) not in keys
    assert peers_key("run-2") != peers_key(RUN)
