"""The end-of-run agreement of a node (`swarm/agreement.py` holds the records and the
rule): publish our final weights' digest, compare with the peers of our last rounds and
every live peer; if ours are not the ones that stand, adopt those through state sync and
compare again; then stay until the peers holding our weights have read them.

`EndOfRun(cfg, dht, membership, keeper, thread)` takes the node's parts; `agree(worker)`
runs the check once training ended and returns the `Verdict`, logging one line.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from dilonode.config import RunConfig
from dilonode.statesync.keeper import StateKeeper
from dilonode.swarm.agreement import FinalBoard, Verdict, standing_digest
from dilonode.swarm.dht import SwarmDHT
from dilonode.swarm.membership import Membership
from dilonode.swarm.records import FinalRecord

__all__ = ["EndOfRun"]

log = logging.getLogger(__name__)

# End-of-run passes (adopt the standing weights, wait for the others) before giving up.
_AGREE_PASSES = 3


class EndOfRun:
    """The end-of-run check of one node (see the module docstring). `thread`: the node's
    network loop thread, on which state sync runs."""

    def __init__(self, cfg: RunConfig, dht: SwarmDHT, membership: Membership,
                 keeper: StateKeeper, thread: Any) -> None:
        self.cfg, self.dht, self.membership = cfg, dht, membership
        self.keeper, self.thread = keeper, thread
        self.peer_id = dht.peer_id
        net = cfg.network
        self.wait = net.matchmaking_timeout + net.allreduce_timeout

    def agree(self, worker: Any) -> Verdict:
        """Compare (a few passes: in a grouped swarm every group ends on its own state, and
        the first pass's adoptions make one of them stand clearly), then linger; logs one
        line with the outcome."""
        board = FinalBoard(self.dht, self.cfg.run_id)
        expected = self._final_peers(worker)
        mine = self._final_record(worker)
        try:
            board.publish(mine)
            got = board.collect(mine, expected, self.wait, live=self._live_for_final_check)
            adopted = False
            for _ in range(_AGREE_PASSES):
                if got.agrees is not False:
                    break
                got, mine, took = self._settle(worker, board, mine, expected)
                adopted = adopted or took
            got.adopted = adopted
        except (TimeoutError, RuntimeError) as exc:
            log.error("end-of-run agreement check failed: %s", exc)
            got = Verdict(mine.digest, missing=sorted(expected))
        (log.error if got.agrees is False else log.info)("end of run: %s", got.line())
        self._linger(board, mine, got)
        return got

    def _linger(self, board: FinalBoard, mine: FinalRecord, got: Verdict) -> None:
        """Stay until the peers holding our weights have read them: they may still be
        checking, and once we leave our record can no longer be read."""
        t0 = time.monotonic()
        try:
            got.unconfirmed = board.linger(mine, got.same if got.agrees else (), self.wait,
                                           gone=self._left_cleanly)
        except (TimeoutError, RuntimeError) as exc:
            log.warning("end-of-run check: could not say our check ended: %s", exc)
        if (stayed := time.monotonic() - t0) >= 1.0 and not got.unconfirmed:
            log.info("end of run: stayed %.1f s until the peers on our weights had checked "
                     "them", stayed)
        if got.unconfirmed:
            log.warning("end of run: left before %d peer(s) ended their check: %s",
                        len(got.unconfirmed), ", ".join(got.unconfirmed))

    def _final_record(self, worker: Any) -> FinalRecord:
        return FinalRecord(peer_id=self.peer_id, run_id=self.cfg.run_id,
                           digest=worker.outer_digest(),
                           rounds=[f.next_round for f in worker.frags],
                           chains=[f.chain for f in worker.frags],
                           tokens=worker.stats.tokens, end_step=worker.end_step or 0)

    def _left_cleanly(self) -> set[str]:
        """Peers whose membership record says they left (empty if the DHT cannot say)."""
        try:
            return {r.peer_id for r in self.dht.fetch_peers(timeout=5.0)
                    if (r.status or {}).get("leaving")}
        except (TimeoutError, RuntimeError) as exc:
            log.debug("end-of-run check: could not read the peers' records: %s", exc)
            return set()

    def _live_for_final_check(self) -> set[str] | None:
        """The peers with a live membership record (not expired, not marked leaving), for
        the end-of-run check to stop waiting for the others; None when the DHT cannot say,
        or when the read missed our own record (no evidence that the others are gone)."""
        try:
            live = {r.peer_id for r in self.membership.live_peers()}
        except (TimeoutError, RuntimeError) as exc:
            log.debug("end-of-run check: could not read the peers' records: %s", exc)
            return None
        return live if self.peer_id in live else None

    def _final_peers(self, worker: Any) -> set[str]:
        """Whom the end-of-run check waits for: the members of our last rounds and every
        live peer. In a grouped swarm all must read the same records to pick the same
        standing weights among the groups'; and a node whose last rounds went alone (its
        state was left out) must still compare, or it would leave holding other weights."""
        expected = {m for ms in worker.stats.members.values() for m in ms}
        try:
            expected |= {r.peer_id for r in self.membership.live_peers(max_age=1.0)}
        except (TimeoutError, RuntimeError) as exc:  # a DHT hiccup: our last groups then
            log.warning("end-of-run check: could not read the live peers: %s", exc)
        return expected - {self.peer_id}

    def _settle(self, worker: Any, board: FinalBoard, mine: FinalRecord,
                expected: set[str]) -> tuple[Verdict, FinalRecord, bool]:
        """One pass: adopt the weights that stand if ours are not them, then wait for the
        expected peers to hold one state; (verdict, our record, whether we adopted)."""
        records = {p: r for p, r in board.read().items()
                   if r.end_step == mine.end_step} | {self.peer_id: mine}
        stands = standing_digest(records)
        adopted = False
        if stands != mine.digest:
            holders = tuple(p for p, r in records.items() if r.digest == stands)
            board.publish(mine.model_copy(update={"adopting": stands}))  # holders wait
            try:
                adopted = self.keeper.adopt(worker, self.thread, self.dht, prefer=holders)
            finally:  # adopted or not, we are no longer adopting: nobody waits on us
                mine = self._final_record(worker)
                board.publish(mine)
        # Ours stands (or is now the standing one): give the others time to adopt it.
        return board.collect(mine, expected, self.wait, settle=True,
                             live=self._live_for_final_check,
                             patience=self.cfg.statesync.recover_timeout), mine, adopted
