"""Hostile input, continued: the state-sync decoder (protocol/README.md section 11) and the
matchmaking entries that carry a leader's roster (section 12), fuzzed like test_fuzz_wire:
mutations of valid seeds plus raw garbage; every input ends in a valid object or the clean
one-line rejection (`RemoteProtocolError`, or `ValueError` naming the record kind).

Cases per run: state-sync bodies 1500, roster entries 600.
"""

from __future__ import annotations

import msgpack
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dilonode.net.auth import seal_record
from dilonode.statesync.plan import manifest_of
from dilonode.statesync.protocol import (
    HEADER,
    MAX_FRAME_BYTES,
    Chunk,
    ChunkRequest,
    Error,
    ManifestRequest,
    decode_body,
    encode_frame,
)
from dilonode.swarm.records import GroupEntry, RosterMember, decode_record, encode_record
from dilonode.train.state import WorkerState
from dilonode.wire.errors import RemoteProtocolError
from tests.unit.test_fuzz_wire import CREDS, FUZZ, RUN, mutated

_STATE = WorkerState(12, (2, 1), (2, 1), {
    f"outer.{p}.{k}": torch.arange(1500 + p, dtype=torch.float32)
    for p in range(2) for k in ("weights", "momentum")})
_MESSAGES = [ManifestRequest(run_id=RUN), ChunkRequest(digest=b"\x01" * 32),
             manifest_of(_STATE, RUN, "ab" * 32, 4096),
             Chunk(digest=b"\x02" * 32, payload=b"\x00\x00\x80\x3f" * 8),
             Error(reason="busy: try again")]
BODIES = [encode_frame(m)[HEADER.size:] for m in _MESSAGES]


def test_seeds_round_trip() -> None:
    assert [decode_body(b) for b in BODIES] == _MESSAGES
    assert HEADER.unpack(encode_frame(_MESSAGES[0])[:HEADER.size])[0] <= MAX_FRAME_BYTES


@settings(FUZZ, max_examples=1500)
@given(body=st.one_of(mutated(BODIES), st.binary(max_size=64)))
def test_state_sync_bodies_are_accepted_or_rejected_cleanly(body: bytes) -> None:
    try:
        decode_body(body)
    except RemoteProtocolError as exc:
        assert exc.reason and "\n" not in exc.reason


_ROSTER = [RosterMember(peer_id=CREDS.peer_id, data_addr="127.0.0.1:4000", bandwidth_mbps=5.0)]
_CLOSING = GroupEntry(peer_id=CREDS.peer_id, run_id=RUN, data_addr="127.0.0.1:4000",
                      bandwidth_mbps=10.0, fragment=1, round=2, attempt=0,
                      settings={"codec": "int4", "block_size": 64, "norm_bound": 0.0},
                      roster=_ROSTER)
ROSTER_BODIES = [msgpack.packb(_CLOSING.model_dump(), use_bin_type=True)]


def test_a_closing_entry_round_trips() -> None:
    assert decode_record(GroupEntry, encode_record(_CLOSING, CREDS), CREDS) == _CLOSING


@settings(FUZZ, max_examples=600)
@given(body=mutated(ROSTER_BODIES))
def test_signed_roster_entries_are_accepted_or_rejected_cleanly(body: bytes) -> None:
    # Signed with the run's key, so mutations reach the roster and settings validation.
    try:
        decode_record(GroupEntry, seal_record(CREDS, body), CREDS)
    except ValueError as exc:
        assert str(exc).startswith("GroupEntry") and "\n" not in str(exc)
