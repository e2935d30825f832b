"""`StateKeeper`: everything a node does to keep its outer state across arrivals, crashes and
restarts, behind four calls the node makes.

    keeper = StateKeeper(cfg, resume=True, opener=..., on_link=...)
    addr = keeper.start_server(loop_thread, creds)    # advertise it in the peer record
    keeper.prepare(worker, loop_thread, dht, publish, counts=...)  # resume, recover, serve
    ... keeper.on_step(worker) after every step (snapshots for joiners, checkpoints) ...
    keeper.finish(worker)                             # checkpoint on a clean stop
    keeper.close(loop_thread)

`prepare` loads the newest valid checkpoint when resuming, then, when live peers serve a state
newer than ours, recovers it from them (chunks we hold are not fetched), publishes our peer
record about `_PEER_VIEW_S` before its last transfer ends, logs one line with bytes and
seconds, writes the recovered state as a checkpoint, and from then on serves our state to
later joiners. Mode ddp has no outer state: the keeper only publishes there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from dilonode.algo.replay import Replayer, replayer
from dilonode.algo.schedule import SyncPlan
from dilonode.config import RunConfig
from dilonode.net.admission import Gate
from dilonode.net.auth import Credentials
from dilonode.net.channel import StreamOpener
from dilonode.statesync.client import LinkHook, Recovery, RecoveryError, recover
from dilonode.statesync.server import SnapshotSource, StateServer
from dilonode.train.checkpoint import Checkpointer, data_position, load_latest, resume_data
from dilonode.train.lr import outer_lr
from dilonode.train.state import config_digest, snapshot_error

__all__ = ["StateKeeper", "check_config", "checkpoint_dir", "min_rounds"]

log = logging.getLogger(__name__)

# Membership reads live peer records at most 1 s old when it forms a group; the rest is
# time for our record to reach the DHT nodes that store it.
_PEER_VIEW_S = 2.0


def checkpoint_dir(cfg: RunConfig) -> Path:
    return cfg.checkpoint.dir or cfg.paths.checkpoint_dir or Path(cfg.paths.out_dir) / "ckpt"


def check_config(cfg: RunConfig) -> None:
    """ValueError for a schedule whose state cannot be snapshotted (checkpoints, joiners):
    found when the node is built, not when the first checkpoint fails."""
    if cfg.diloco.mode != "ddp":
        a = cfg.diloco.effective()
        if why := snapshot_error(SyncPlan(a.sync_every, a.num_fragments,
                                          a.fragment_sync_delay)):
            raise ValueError(why)


def min_rounds(ours: Sequence[int], same_rounds: bool, prefer: Sequence[str]) -> int:
    """The rounds (summed over fragments) a state must exceed to be taken: more than ours;
    as many will do after a lone round (`same_rounds`); any count from the peers whose
    state stands (`prefer`): rounds we went through alone, at the end of a run above all,
    may have taken our counters past theirs, and theirs are still the weights to hold."""
    if prefer:
        return -1
    return sum(ours) - int(same_rounds)


class StateKeeper:
    """Checkpoints, resume, state serving and recovery of one node (see module docstring).

    `opener`: streams to the state servers of peers behind a NAT (the node's libp2p
    tunnel; without one those peers are left out). `on_link`: called once per recovery
    whose transfer ran long enough to measure our link, with (bytes/s, each fragment's
    round result bytes, peers counting us) (`recover`)."""

    def __init__(self, cfg: RunConfig, resume: bool = False, *,
                 opener: StreamOpener | None = None, on_link: LinkHook | None = None) -> None:
        check_config(cfg)
        self.cfg, self.resume = cfg, resume
        self.active = cfg.diloco.mode != "ddp"
        self.digest = config_digest(cfg)
        ck = cfg.checkpoint
        self.checkpointer = Checkpointer(checkpoint_dir(cfg), cfg.run_id, self.digest,
                                         ck.every_steps, ck.keep)
        self.source = SnapshotSource()
        self.server: StateServer | None = None
        self.recovery: Recovery | None = None
        self.resumed_from: Path | None = None
        self._alone_seen = 0
        self._refused = 0  # peers our recoveries refused (impostor, tampered frame)
        self.opener, self.on_link = opener, on_link
        self._streamed: frozenset[str] = frozenset()  # the peers of the last read `opener` reaches

    # -- start -------------------------------------------------------------------------
    @property
    def unauthorized_attempts(self) -> int:
        """State-sync connections refused in the handshake or for a bad MAC, both ways."""
        return self._refused + (self.server.unauthorized_attempts if self.server else 0)

    def start_server(self, thread: Any, auth: Credentials,
                     gate: Gate | None = None) -> str | None:
        """Listen for joiners that `auth` admits (answering "no state yet" until `prepare`
        is done), admitted through `gate` (`dilonode.net.admission`); returns the address to
        advertise, or None when not serving."""
        if not (self.active and self.cfg.statesync.enabled):
            return None
        self.server = StateServer(self.source, self.cfg.run_id, self.digest,
                                  self.cfg.statesync, host=self.cfg.network.host, auth=auth,
                                  gate=gate, tcp_congestion=self.cfg.network.tcp_congestion)
        address = thread.run(self.server.start(), timeout=10.0)
        announce = self.cfg.network.announce_host
        return f"{announce}:{address.rsplit(':', 1)[1]}" if announce else address

    def prepare(self, worker: Any, thread: Any, dht: Any,
                publish: Callable[[], None], stop: threading.Event | None = None, *,
                first_round: Callable[[float], int | None] | None = None,
                counts: Callable[[int, int, str], bool] | None = None) -> None:
        """Resume and/or recover into `worker`, calling `publish()` (our peer record) once:
        just before the last recovery pass, or at the end when there is nothing to recover.
        Then serve the state. `stop` set (the node was told to stop) abandons a recovery
        in progress: a fetch over a slow link can take minutes. `first_round(view_s)`,
        called before publishing when recovering: names our first round in the record
        (`PeerRecord.joins_from`), at least `view_s` from now, and returns the step the
        state adopted must reach (every round before it), or None (no swarm clock).
        `counts(fragment, round, joiner)`: whether a round in flight here counts a joiner
        (`Membership.counts`), for the floors we serve (`SnapshotSource.step_now`)."""
        published = False

        async def before_final() -> int | None:
            nonlocal published
            floor = None if first_round is None else first_round(_PEER_VIEW_S)
            await asyncio.to_thread(publish)
            published = True
            # Peers read live records at most _PEER_VIEW_S old: rounds they start after
            # this wait expect us, rounds started before land in the last pass's state.
            await asyncio.sleep(_PEER_VIEW_S)
            return floor

        if self.active and self.resume:
            self._resume(worker)
        if self.active and self.cfg.statesync.enabled:
            # Publish so that the wait ends about when the transfer does: rounds the peers
            # start after it wait for us while we read manifests once more, as they did
            # when we published after the transfer.
            self._recover(worker, thread, _serving_peers(dht, self), dht.credentials,
                          before_final, final_lead=_PEER_VIEW_S, stop=stop)
        if not published:
            publish()
        self.checkpointer.start_from(worker.step)
        if self.active:
            if self.recovery is not None and self.cfg.checkpoint.every_steps:
                self.checkpointer.save_async(worker.export_state(), data_position(worker))
            self.source.attach(worker, counts)
            worker.wait_hook = self.source.blocked

    def _resume(self, worker: Any) -> None:
        found = load_latest(self.checkpointer.directory, self.cfg.run_id, self.digest)
        if found is None:
            log.warning("--resume: no valid checkpoint in %s; starting fresh",
                        self.checkpointer.directory)
            return
        state, path = found
        worker.import_state(state)
        resume_data(worker, path)
        self.resumed_from = path
        self.checkpointer.note_good(path)
        log.info("resumed from checkpoint %s at step %d", path.name, state.step)

    def _recover(self, worker: Any, thread: Any, peers: dict[str, str], auth: Credentials,
                 before_final: Callable[[], Awaitable[int | None]], *,
                 same_rounds: bool = False, final_lead: float = 0.0,
                 prefer: tuple[str, ...] = (), stop: threading.Event | None = None) -> None:
        """`same_rounds`: also take a state with as many rounds as ours (ours may have
        diverged in a lone round), but only when its content differs from ours.
        `final_lead`: see `recover` (start publishing before the transfer ends). `stop`:
        see `prepare`."""
        if not peers:
            return
        sc = self.cfg.statesync
        local = worker.export_state()
        # After a lone round, peers that formed its group without us may still be landing
        # it: give them as long as a round may take, if they got as far as its start.
        net = self.cfg.network
        wait = net.matchmaking_timeout + net.allreduce_timeout if same_rounds else 0.0
        started = local.step - self.cfg.diloco.effective().fragment_sync_delay - 1
        job = recover(peers, local, self.cfg.run_id, self.digest, sc,
                      min_rounds=min_rounds(local.rounds, same_rounds, prefer),
                      before_final=before_final, auth=auth, final_lead=final_lead,
                      own_candidate=same_rounds and not prefer, wait_behind=wait,
                      wait_from_step=started, replayer=self._replayer(), prefer=prefer,
                      opener=self.opener, streamed=self._streamed,
                      floor_patience=net.matchmaking_timeout + net.allreduce_timeout,
                      on_link=self.on_link)
        future = thread.submit(asyncio.wait_for(job, sc.recover_timeout))
        try:
            got = _result_unless(future, stop, sc.recover_timeout + 10.0)
        except TimeoutError:
            raise RecoveryError(f"state sync: no complete state within statesync."
                                f"recover_timeout = {sc.recover_timeout} s") from None
        except concurrent.futures.CancelledError:
            log.info("state sync: stopped before a state arrived; not recovering")
            return
        if got is not None:
            self._refused += got.refused
        if got is None:
            log.info("state sync: %d peer(s) serve no state with more rounds than ours %s; "
                     "not recovering", len(peers), list(local.rounds))
            return
        if same_rounds and got.fetched_bytes == 0 and got.state.rounds == local.rounds:
            log.info("state sync: peers hold the same state as ours; nothing to adopt")
            return
        if worker.in_flight() and not self._import_settled(worker, got.state, local):
            return
        if not worker.in_flight():
            with self.source.replacing():
                worker.import_state(got.state)
        self.recovery = got
        log.info("state sync: recovered step %d (rounds %s) from %d peer(s): %d bytes "
                 "fetched (%.2f s transferring), %d reused, in %.2f s (%d passes, %.2f s "
                 "waiting for manifests, %.2f s for the publish wait; agreed by %d; "
                 "%d fragment(s) replayed)",
                 got.state.step, list(got.state.rounds), len(got.sources), got.fetched_bytes,
                 got.fetch_seconds, got.reused_bytes, got.seconds, got.passes,
                 got.manifest_seconds, got.publish_wait_seconds, len(got.agreed_by),
                 got.replayed)

    def _import_settled(self, worker: Any, state: Any, local: Any) -> bool:
        """Rounds of some fragments in flight (paced by the clock, nearly always): adopt
        the others, where the peers' state differs from ours and is at least as far on;
        False when that leaves nothing to adopt."""
        chains = state.chains or ()
        in_flight = worker.in_flight()
        take = [p for p in range(len(state.rounds)) if p not in in_flight
                and state.rounds[p] >= local.rounds[p]
                and (not chains or chains[p] != worker.frags[p].chain
                     or state.rounds[p] != local.rounds[p])]
        if not take:
            log.info("state sync: nothing to adopt between rounds in flight %s", in_flight)
            return False
        with self.source.replacing():
            worker.import_fragments(state, take)
        log.info("state sync: adopted fragment(s) %s (rounds in flight on the others)", take)
        return True

    def _replayer(self) -> Replayer:
        """This run's outer step, for replaying a round on a fragment (algo/replay.py)."""
        a = self.cfg.diloco.effective()
        plan = SyncPlan(a.sync_every, a.num_fragments, a.fragment_sync_delay)

        def lr_at(fragment: int, round_no: int) -> float:
            return outer_lr(self.cfg, plan.start_step(fragment, round_no))

        return replayer(lr_at, a.outer_momentum, a.outer_nesterov)

    # -- training thread -----------------------------------------------------------------
    def resync_if_behind(self, worker: Any, thread: Any, dht: Any) -> None:
        """After a round this node went through alone while peers are live, it is behind
        them (a timeout cost it more than the matchmaking window, so it can no longer meet
        them) or its copy diverged: fetch the state of peers that landed more rounds and
        jump to it, as a joiner does. When matchmaking left it out for holding another
        state than its group's (`worker.diverged_from`), it takes that group's state.
        Between steps; fragments with a round in flight keep theirs (`_import_settled`)."""
        if (not (self.active and self.cfg.statesync.enabled)
                or len(worker.in_flight()) == len(worker.frags)
                or worker.stats.alone == self._alone_seen):
            return
        self._alone_seen = worker.stats.alone
        if getattr(worker, "grouped", False) and not worker.diverged_from:
            return  # a grouped swarm: replicas differ anyway, the next mixing pulls us in
        prefer, worker.diverged_from = tuple(worker.diverged_from), ()
        self.adopt(worker, thread, dht, prefer)

    def adopt(self, worker: Any, thread: Any, dht: Any, prefer: tuple[str, ...] = ()) -> bool:
        """Take the state the live peers agree on (or, with `prefer`, the state of those
        peers) if it differs from ours; True if ours was replaced. Nothing may be in flight."""
        def announce(peers: int) -> None:
            if prefer:
                log.info("outer state differs from the one that stands: adopting the state "
                         "of %s", ", ".join(prefer))
            else:
                log.info("went on alone with %d live peer(s) around: checking whether they "
                         "are ahead", peers)

        return self._recover_now(worker, thread, dht, announce, "after a lone round",
                                 same_rounds=True, prefer=prefer)

    def catch_up(self, worker: Any, thread: Any, dht: Any) -> bool:
        """A resumed node, once `network.min_peers` are live, before its first step: take a
        state with more rounds than its checkpoint's if the peers now visible hold one.
        When a whole swarm restarts, nodes come back one at a time; the first ones found
        nobody serving when they prepared, and would otherwise train on from an older
        checkpoint until a lone round told them they are behind."""
        if not self.resume:
            return False
        return self._recover_now(worker, thread, dht, lambda peers: None,
                                 "after the wait for peers")

    def _recover_now(self, worker: Any, thread: Any, dht: Any,
                     announce: Callable[[int], None], when: str, *,
                     same_rounds: bool = False, prefer: tuple[str, ...] = ()) -> bool:
        """A recovery pass between steps, our record already published; True if our
        state was replaced."""
        if not (self.active and self.cfg.statesync.enabled):
            return False
        try:
            peers = _serving_peers(dht, self)
        except (RuntimeError, TimeoutError) as exc:  # the DHT is down or restarting
            log.warning("cannot read the peers now to re-sync: %s", exc)
            return False
        if not peers:
            return False

        async def already_visible() -> None:
            return None

        announce(len(peers))
        before = self.recovery
        # Peers that went alone in the same round are asking us at the same time: serve
        # them directly (nothing is in flight) rather than wait for a step we are not taking.
        self.source.blocked(True)
        t0 = time.perf_counter()
        try:
            self._recover(worker, thread, peers, dht.credentials, already_visible,
                          same_rounds=same_rounds, prefer=prefer)
        except (RecoveryError, OSError, ValueError) as exc:
            log.warning("state sync %s failed: %s", when, exc)
        finally:
            self.source.blocked(False)
            worker.stats.catch_up_s += time.perf_counter() - t0  # training stood still
        return self.recovery is not before

    def training(self, on: bool) -> None:
        self.source.training(on)

    def on_step(self, worker: Any) -> None:
        if self.active:
            self.source.poll(worker)
            self.checkpointer.maybe_save(worker)

    def finish(self, worker: Any, abandoned: int = 0) -> None:
        """Clean stop: write a last checkpoint. Rounds abandoned while stopping are not in
        it: the worker's counters were set back to the rounds that landed, so the state is
        the one after those (a resumed node takes part in the next rounds, or re-syncs)."""
        if abandoned:
            self.source.detach()  # stopping with rounds unfinished: serve nothing more
        if not (self.active and self.cfg.checkpoint.on_exit):
            self.checkpointer.wait()
            return
        if abandoned:
            log.info("exit checkpoint: the rounds that landed; %d round(s) abandoned while "
                     "stopping are not in it", abandoned)
        self.checkpointer.save_now(worker)

    def close(self, thread: Any) -> None:
        if self.server is not None and thread.loop is not None:
            server, self.server = self.server, None
            try:
                thread.run(server.aclose(), timeout=5.0)
            except Exception as exc:  # closing must go on whatever the sockets do
                log.warning("state server did not close cleanly: %s", exc)
        self.checkpointer.wait(timeout=30.0)


def _result_unless(future: concurrent.futures.Future[Any], stop: threading.Event | None,
                   timeout: float) -> Any:
    """`future`'s result within `timeout` s (TimeoutError after); once `stop` is set,
    cancel it and raise CancelledError."""
    deadline = time.monotonic() + timeout
    while True:
        if stop is not None and stop.is_set():
            future.cancel()
            raise concurrent.futures.CancelledError
        try:
            return future.result(min(0.2, max(deadline - time.monotonic(), 0.0)))
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise


def _serving_peers(dht: Any, keeper: StateKeeper | None = None) -> dict[str, str]:
    """Live peers (not us, not leaving) that advertise a state listener. With `keeper`,
    note there which of them are behind a NAT (reached through `keeper.opener`; without
    an opener they are left out: nobody could dial them)."""
    out, private = {}, set()
    for r in dht.fetch_peers():
        if r.peer_id != dht.peer_id and r.state_addr and not (r.status or {}).get("leaving"):
            if not r.reachable:
                if keeper is None or keeper.opener is None:
                    continue
                private.add(r.peer_id)
            out[r.peer_id] = r.state_addr
    if keeper is not None:
        keeper._streamed = frozenset(private)
    return out
