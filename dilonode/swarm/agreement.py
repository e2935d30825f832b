"""The end-of-run agreement check: do the nodes that finished the run hold one model?

Every node that reaches the end of the run publishes a `FinalRecord` (the sha256 of its
outer weights, its round counters and chains, the tokens it trained) under
`final_key(run)`, reads the records of the peers it expects (the members of its last
rounds, and any other live peer that published one), and compares. Pure decisions here
(`Verdict`, `standing_digest`); the node does the waiting and, when its weights are not
the ones that stand, adopts them through state sync before it checks again
(`dilonode.node.daemon`). A node that still differs says in one line from whom, and exits
non-zero: a swarm never ends as two models with every node reporting success.

A record lives on the DHT nodes that store it, and those leave when their runs end. So a
node that agrees republishes its record marked `checked` and stays until every peer holding
its weights has done the same (`FinalBoard.linger`): the last node to check, typically the
one that served the others its weights, still finds their adopted records to read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from dilonode.swarm.dht import read_records, store_record
from dilonode.swarm.records import FinalRecord, final_key

__all__ = ["FinalBoard", "Verdict", "standing_digest", "verdict"]

log = logging.getLogger(__name__)


def standing_digest(records: Mapping[str, FinalRecord]) -> str:
    """The weights that stand among nodes that disagree: held by most nodes, then most
    tokens trained, then by the smallest peer id (the rule matchmaking applies to chains)."""
    holders: dict[str, list[str]] = {}
    for peer, rec in sorted(records.items()):
        holders.setdefault(rec.digest, []).append(peer)
    return min(holders, key=lambda d: (-len(holders[d]),
                                       -sum(records[p].tokens for p in holders[d]),
                                       holders[d][0]))


@dataclass
class Verdict:
    """How our final outer weights compare with the peers'."""

    digest: str
    same: list[str] = field(default_factory=list)  # peers holding our weights
    differ: dict[str, str] = field(default_factory=dict)  # peer -> its digest
    missing: list[str] = field(default_factory=list)  # expected, published nothing in time
    adopted: bool = False  # we took the standing weights from peers at the end
    unconfirmed: list[str] = field(default_factory=list)  # left before these ended their check

    @property
    def agrees(self) -> bool | None:
        """True: every peer that answered holds our weights; None: nobody answered."""
        if self.differ:
            return False
        return True if self.same else None

    def line(self) -> str:
        if self.agrees is False:
            who = ", ".join(f"{p} ({d[:12]})" for p, d in sorted(self.differ.items()))
            return (f"outer weights {self.digest[:12]} differ from {len(self.differ)} "
                    f"peer(s): {who}")
        if self.agrees is None:
            return "no peer to compare the final outer weights with"
        extra = f"; {len(self.missing)} expected peer(s) did not report" if self.missing else ""
        return (f"outer weights {self.digest[:12]} identical on {len(self.same) + 1} "
                f"node(s){extra}")

    def as_dict(self) -> dict[str, Any]:
        return {"agrees": self.agrees, "digest": self.digest, "same": sorted(self.same),
                "differ": dict(sorted(self.differ.items())), "missing": sorted(self.missing),
                "adopted": self.adopted, "unconfirmed": sorted(self.unconfirmed),
                "line": self.line()}


def verdict(mine: FinalRecord, others: Mapping[str, FinalRecord],
            expected: Collection[str]) -> Verdict:
    """Compare our record with the peers' (only records for the same end step count)."""
    out = Verdict(mine.digest)
    for peer, rec in sorted(others.items()):
        if peer == mine.peer_id or rec.end_step != mine.end_step:
            continue
        if rec.digest == mine.digest:
            out.same.append(peer)
        else:
            out.differ[peer] = rec.digest
    out.missing = sorted(set(expected) - set(out.same) - set(out.differ) - {mine.peer_id})
    return out


class FinalBoard:
    """Publishes our final record and reads the peers' (bounded DHT calls)."""

    def __init__(self, dht: Any, run_id: str, ttl: float = 600.0) -> None:
        self.dht, self.run_id, self.ttl = dht, run_id, ttl

    def publish(self, record: FinalRecord, timeout: float = 10.0) -> None:
        store_record(self.dht, final_key(self.run_id), record, self.ttl, timeout=timeout)

    def read(self, timeout: float = 5.0) -> dict[str, FinalRecord]:
        return read_records(self.dht, final_key(self.run_id), FinalRecord, timeout)

    def collect(self, mine: FinalRecord, expected: Collection[str], timeout: float,
                poll: float = 0.5, settle: bool = False, patience: float = 0.0,
                live: Callable[[], Collection[str] | None] | None = None) -> Verdict:
        """Read until every expected peer has published for our end step (and, with
        `settle`, until none of them differs any more) or `timeout` passes. With `settle`,
        while every peer that differs says it is adopting our weights, wait up to
        `patience` instead: a state fetch on a loaded host outlasts a round's timeouts.
        `live`: the peers whose membership record is live (None when the DHT cannot say;
        read only while someone is missing). Once no missing peer is among them, none is
        waited for: they stay `missing` in the verdict, and a peer killed shortly before
        the end costs its peers the rest of its record's lifetime, not the whole timeout."""
        start, failed = time.monotonic(), 0
        while True:
            others, failed = self._read_counting(timeout, failed)
            got = verdict(mine, others, expected)
            if not (settle and got.differ) and (not got.missing or _none_live(got.missing, live)):
                return got
            limit = timeout
            if settle and got.differ and all(others[p].adopting == mine.digest
                                             for p in got.differ):
                limit = max(timeout, patience)
            if time.monotonic() - start >= limit:
                return got
            time.sleep(poll)

    def linger(self, mine: FinalRecord, peers: Collection[str], timeout: float,
               poll: float = 0.5, gone: Callable[[], Collection[str]] | None = None
               ) -> list[str]:
        """Publish our record as `checked`, then wait until every one of `peers` has
        published a checked record of our weights and end step, or has left cleanly
        (`gone`: the peers whose membership record is marked leaving; read only while
        someone is missing), or `timeout` passes; the peers that had not (sorted). Until
        then our DHT keeps our records, and theirs, readable for a peer still checking."""
        self.publish(mine.model_copy(update={"checked": True}))
        start, failed = time.monotonic(), 0
        while True:
            others, failed = self._read_counting(timeout, failed)
            left = sorted(p for p in peers if not _checked(others.get(p), mine))
            if left and gone is not None:
                # A peer's checked record lives on the DHT nodes that stored it, and those
                # may all have left with it; its leaving record is stored under another
                # key, so on other nodes (test_groups waited 60 s for such a peer).
                left = sorted(set(left) - set(gone()))
            if not left:
                if peers:
                    # A peer that ended its check as we did may have read just before our
                    # record was there, and reads again within `poll`. Our record lives on
                    # the DHT nodes that stored it, which may be the peers leaving now:
                    # stay until that read is done (test_groups: the last holder waited
                    # out its timeout for a peer that had left the same instant).
                    time.sleep(2 * poll)
                return left
            if time.monotonic() - start >= timeout:
                return left
            time.sleep(poll)

    def _read_counting(self, timeout: float,
                       failed: int) -> tuple[Mapping[str, FinalRecord], int]:
        """One bounded read (empty if it fails) and the count of failed reads so far; the
        first failure is a warning: a node that cannot read the records cannot agree."""
        try:
            return self.read(timeout=min(5.0, max(timeout, 0.1))), failed
        except (TimeoutError, RuntimeError) as exc:
            (log.warning if not failed else log.debug)(
                "end-of-run check: could not read the peers' final records: %s", exc)
            return {}, failed + 1


def _none_live(peers: Collection[str], live: Callable[[], Collection[str] | None] | None) -> bool:
    """Whether none of `peers` has a live membership record (False when nobody can say)."""
    now = live() if live is not None else None
    return now is not None and not set(peers) & set(now)


def _checked(rec: FinalRecord | None, mine: FinalRecord) -> bool:
    return (rec is not None and rec.checked and rec.digest == mine.digest
            and rec.end_step == mine.end_step)
