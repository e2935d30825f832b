"""Matchmaking: which peers average one fragment round together, agreed through the DHT.

`form_group` is blocking (run it in a thread or executor). Protocol for one attempt:

1. Register: store our `GroupEntry` under `group_key(run_id, fragment, round, attempt)` with
   subkey = our peer id, expiring `timeout + window` seconds later (long enough for every
   peer whose window overlaps ours to read it, short enough that the key dies soon after).
2. Wait up to `window` after our own registration, polling the key every `poll_interval`
   seconds to re-store our entry if it is not visible (a refused or lost store). The wait
   ends early once every `expected` peer (those the caller believes alive, from the peer
   records) has registered: in a steady swarm a round forms in a few DHT round trips. A
   peer that is not expected, or is late, is only seen if it registers within the window.
3. Read the key once more (`latest=True`). The members are all valid entries of that read
   plus ourselves, sorted by peer id; weights are their bandwidths. An entry is valid only
   if it is signed by the peer it names and that peer is admitted (swarm secret,
   allowlist: `board.credentials`), so no one can register another peer or slip in.

Peers that register at different times may read different sets. That is tolerated here and
caught by the all-reduce layer: its first message carries `Group.digest()`, a mismatch fails
the attempt, and the caller retries with `attempt + 1` (a fresh key). A group of one is a
valid result. Everything is bounded by `timeout`; failure to register or to read the final
set raises `MatchmakingError`.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

from dilonode.auth import Credentials
from dilonode.swarm.dht import RawEntry, decode_entries
from dilonode.swarm.records import GroupEntry, encode_record, group_key

__all__ = ["Group", "GroupBoard", "MatchmakingError", "form_group"]

log = logging.getLogger(__name__)

# Final read budget kept out of the window when `timeout` is tight.
_READ_RESERVE_S = 0.5


class MatchmakingError(RuntimeError):
    """The attempt could not register or read its group within the timeout."""


class GroupBoard(Protocol):
    """The part of `SwarmDHT` that matchmaking uses (lets tests substitute a fake)."""

    @property
    def peer_id(self) -> str: ...

    @property
    def credentials(self) -> Credentials: ...

    def store_raw(self, key: str, subkey: str, value: bytes, ttl: float,
                  timeout: float | None = None) -> bool: ...

    def get_raw(self, key: str, timeout: float | None = None) -> dict[str, RawEntry]: ...

    def note_rejected(self, key: str, subkey: str, reason: str, *,
                      unauthorized: bool = False) -> None: ...


@dataclass(frozen=True)
class Group:
    """The outcome of one matchmaking attempt as seen by this node."""

    members: tuple[str, ...]
    data_addrs: tuple[str, ...]
    weights: tuple[float, ...]
    my_index: int
    run_id: str
    fragment: int
    round: int
    attempt: int

    def digest(self) -> str:
        """sha256 hex of run id, fragment, round, attempt and the sorted members, '\\n'-joined.

        Run ids (`[A-Za-z0-9._-]`) and base58 peer ids contain no newline, so the joined
        text is unambiguous.
        """
        parts = [self.run_id, str(self.fragment), str(self.round), str(self.attempt),
                 *self.members]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()

    @property
    def size(self) -> int:
        return len(self.members)


def _check_args(board: GroupBoard, run_id: str, fragment: int, round: int, attempt: int,
                me: GroupEntry, window: float, timeout: float) -> None:
    if (me.run_id, me.fragment, me.round, me.attempt) != (run_id, fragment, round, attempt):
        raise ValueError(f"entry is for {me.run_id}/{me.fragment}/{me.round}/{me.attempt}, "
                         f"not {run_id}/{fragment}/{round}/{attempt}")
    if me.peer_id != board.peer_id:
        raise ValueError(f"entry names peer {me.peer_id}, this node is {board.peer_id}")
    if not 0.0 <= window < timeout:
        raise ValueError(f"need 0 <= window < timeout, got window={window}, timeout={timeout}")


def _valid_entries(board: GroupBoard, key: str, raw: dict[str, RawEntry],
                   me: GroupEntry) -> dict[str, GroupEntry]:
    out = {}
    for subkey, got in decode_entries(board, key, raw, GroupEntry, board.credentials).items():
        if (got.fragment, got.round, got.attempt) != (me.fragment, me.round, me.attempt):
            board.note_rejected(key, subkey, "entry for another fragment/round/attempt")
        else:
            out[subkey] = got
    return out


def _register(board: GroupBoard, key: str, me: GroupEntry, ttl: float, deadline: float) -> None:
    try:
        ok = board.store_raw(key, me.peer_id, encode_record(me, board.credentials), ttl,
                             timeout=max(deadline - time.monotonic(), 0.0))
    except TimeoutError as exc:
        raise MatchmakingError(f"could not register under {key}: {exc}") from None
    if not ok:
        # Refused: an entry with a later expiration is already there (ours from a retry).
        log.debug("store under %s refused; relying on the existing entry", key)


def _wait_window(board: GroupBoard, key: str, me: GroupEntry, ttl: float, window_end: float,
                 poll_interval: float, expected: frozenset[str]) -> None:
    """Poll until the window ends, or earlier once every expected peer has registered."""
    while (left := window_end - time.monotonic()) > 0:
        try:
            seen = board.get_raw(key, timeout=left)
            if me.peer_id not in seen:
                board.store_raw(key, me.peer_id, encode_record(me, board.credentials), ttl,
                                timeout=max(window_end - time.monotonic(), 0.0))
            elif expected and expected <= seen.keys():
                return  # everyone we know to be alive is in: no need to wait longer
        except TimeoutError:
            pass  # only the final read counts; a slow poll is not an error
        time.sleep(max(min(poll_interval, window_end - time.monotonic()), 0.0))


def _build(entries: dict[str, GroupEntry], me: GroupEntry) -> Group:
    entries[me.peer_id] = me  # we are a member even if our own store was not visible yet
    ordered = [entries[p] for p in sorted(entries)]
    members = tuple(e.peer_id for e in ordered)
    return Group(
        members=members,
        data_addrs=tuple(e.data_addr for e in ordered),
        weights=tuple(e.bandwidth_mbps for e in ordered),
        my_index=members.index(me.peer_id),
        run_id=me.run_id, fragment=me.fragment, round=me.round, attempt=me.attempt,
    )


def form_group(board: GroupBoard, run_id: str, fragment: int, round: int, attempt: int,
               me: GroupEntry, window: float, timeout: float, *,
               poll_interval: float = 0.5, expected: Collection[str] = ()) -> Group:
    """Register `me` for this attempt, wait `window`, and return the group read at its end.

    `expected` (peer ids believed alive, e.g. from the peer records) ends the wait early once
    all of them have registered; peers registering later join the next round.

    `board` is a started `SwarmDHT`. Returns within `timeout` seconds or raises
    `MatchmakingError`; see the module docstring for the protocol.
    """
    _check_args(board, run_id, fragment, round, attempt, me, window, timeout)
    deadline = time.monotonic() + timeout
    key = group_key(run_id, fragment, round, attempt)
    ttl = timeout + window
    _register(board, key, me, ttl, deadline)
    reserve = min(_READ_RESERVE_S, timeout - window)
    window_end = min(time.monotonic() + window, deadline - reserve)
    _wait_window(board, key, me, ttl, window_end, poll_interval, frozenset(expected))
    try:
        raw = board.get_raw(key, timeout=max(deadline - time.monotonic(), 0.0))
    except TimeoutError as exc:
        raise MatchmakingError(f"could not read the group under {key}: {exc}") from None
    group = _build(_valid_entries(board, key, raw, me), me)
    log.info("group %s: %d member(s), I am #%d, digest %s", key, group.size, group.my_index,
             group.digest()[:12])
    return group
