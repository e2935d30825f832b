"""Composition root of a training node: DHT, data plane, trainer and heartbeat wired together.

`Node(cfg, worker_id=..., resume=...)` does no I/O. `start()` joins the DHT (hivemind, in its
own process; started first because it forks), brings up the all-reduce data plane on a
background event loop, builds the worker, lets `StateKeeper` resume it from a checkpoint
and/or recover the run's state from live peers, publishes this node's peer record
(`Membership`) and waits for `network.min_peers`. `run(stop)` trains on the calling thread
until `total_steps` or until `stop` is set, then lands in-flight syncs (abandoning those not
done within `network.leave_timeout` when stopped). `close()` stops serving state, withdraws
the peer record and shuts everything down within seconds.

Once started, a `Supervisor` (dilonode/node/supervisor.py, parts in
dilonode/node/supervised_parts.py) watches the
DHT process and p2pd, the data plane, state and status listeners and restarts them in place;
a `Remerger` (swarm/remerge.py) finds the swarm again after a partition. If a part cannot be
brought back, the node stops training, writes its exit checkpoint and `failure` holds the
one-line reason (the CLI then exits non-zero).

On a node with several local devices this is rank 0 (`ranks`, dilonode/train/ranks/node_ranks.py):
it
alone runs the network side, and its Worker announces every model operation to the other
ranks, which `follow` it; to the swarm the node is one peer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dilonode.algo.robust import BanTracker
from dilonode.allreduce.network_collective import NetworkCollective
from dilonode.allreduce.retry import RoundPolicy
from dilonode.collective import FormedGroup, GroupRequest
from dilonode.config import RunConfig
from dilonode.net.admission import Admission
from dilonode.statesync.keeper import StateKeeper
from dilonode.status.isolation import AloneWatch
from dilonode.status.snapshot import NodeStatus, ObservedCollective, device_summary
from dilonode.swarm import reachability as reach
from dilonode.swarm.dht import SwarmDHT
from dilonode.swarm.membership import Membership

__all__ = ["Node", "NodeSummary", "summary_json"]

log = logging.getLogger(__name__)

# End-of-run passes (adopt the standing weights, wait for the others) before giving up.
_AGREE_PASSES = 3


@dataclass
class NodeSummary:
    """What a node did, printed and written as JSON when it stops."""

    peer_id: str
    worker_id: str
    steps: int = 0
    tokens: int = 0
    final_eval_loss: float = float("nan")
    bytes_sent: int = 0
    bytes_received: int = 0
    rounds_per_fragment: dict[int, int] = field(default_factory=dict)
    skipped_rounds: int = 0
    retried_rounds: int = 0
    dropped_peers: list[str] = field(default_factory=list)
    compute_utilization: float = 0.0  # share of wall time not blocked on the network
    step_share: float = 0.0  # share of wall time inside train_step alone
    sync_wait_s: float = 0.0
    wall_s: float = 0.0
    outer_digest: str = ""
    stopped_early: bool = False
    # fragment (-1: DDP gradients) -> rounds, mean and max seconds from start to result
    round_latency_s: dict[int, dict[str, float]] = field(default_factory=dict)
    # Robust aggregation: rounds in which a majority of owners rejected a peer, and bans.
    peer_convictions: int = 0
    peer_bans: int = 0
    checkpoint_age_s: float | None = None  # age of the newest good checkpoint (None: none)
    # Pacing: rounds this node took part in with others, missed (its pacer jumped over),
    # waited for (result late when the fragment's next round was due), left out of for a
    # diverged state.
    rounds_with_peers: int = 0
    missed_rounds: int = 0
    late_rounds: int = 0
    diverged_rounds: int = 0
    # The end-of-run check (swarm/agreement.py): {"agrees": bool | None, ...}; {} if the
    # node stopped before the end.
    agreement: dict[str, Any] = field(default_factory=dict)
    # Bounded groups: whether the swarm averaged in groups at the end, the largest group.
    grouped: bool = False
    largest_group: int = 0
    # network.reachable as resolved ("public" / "private"), and how the data plane reached
    # peers: connections out (direct TCP or libp2p stream), streams accepted, failed dials.
    reachability: str = "public"
    data_paths: dict[str, int] = field(default_factory=dict)
    devices: str = ""  # the node's devices, one per rank ("2 x cpu ...")


class Node:
    """One training node; see the module docstring for its life cycle."""

    def __init__(self, cfg: RunConfig, worker_id: str | None = None,
                 resume: bool = False, secret: bytes = b"", ranks: Any = None) -> None:
        self.cfg = cfg
        self.ranks = ranks  # NodeRanks of a multi-rank node (we are rank 0), else None
        self.worker_id = worker_id
        self._secret = secret  # the swarm secret (auth config), read by the CLI
        self.keeper = StateKeeper(cfg, resume)  # checkpoints, resume, state sync
        self.dht: SwarmDHT | None = None
        self.collective: NetworkCollective | None = None
        self.worker: Any = None
        self.membership: Membership | None = None
        self.tunnel: Any = None  # libp2p-stream fallback of the data plane (swarm.tunnel)
        self.bans: BanTracker | None = None  # peers left out for repeated rejections
        # Caps on incoming connections and peer-caused log lines, per listening port.
        self.admission = Admission(interval=cfg.admission.log_interval)
        sup = cfg.supervise
        self.status = NodeStatus(cfg.run_id, cfg.total_steps, history=cfg.status.history,
                                 peers=self._peers_seen, trust=self._trust_counters,
                                 admission=self.admission.snapshot,
                                 checkpoint_age=self.keeper.checkpointer.age_s,
                                 alone=AloneWatch(sup.alone_warn_rounds, sup.alone_log_every),
                                 live_others=self._live_others, health=self._health)
        self.status_server: Any = None
        self.clock: Any = None  # ClockKeeper: the swarm clock (pacing = "time")
        self.reachability: reach.Reachability = "public"  # resolved in start()
        self.verdict: Any = None  # the end-of-run agreement Verdict
        self.supervisor: Any = None  # dilonode.node.supervisor.Supervisor, once started
        self.remerger: Any = None  # dilonode.node.remerge.Remerger, once started
        self.failure: str | None = None  # why the node gave up, if it did
        self._stop: threading.Event | None = None  # run()'s stop event
        self._hard_exit: threading.Timer | None = None

    # -- life cycle ------------------------------------------------------------------------
    def start(self, stop: threading.Event | None = None) -> None:
        """Join the swarm (see the module docstring). `stop` (run()'s event) abandons a
        state recovery in progress and the wait for `network.min_peers`: a node signalled
        while it starts stops at once."""
        net = self.cfg.network
        self.admission.setup(self.cfg.admission)  # before the DHT forks: it inherits the limit
        self.reachability = reach.resolve(net.reachable, net.host, net.announce_host,
                                          net.initial_peers)
        p2p_options, p2pd_flags = reach.dht_options(self.reachability, net.initial_peers)
        self.dht = SwarmDHT(self.cfg.run_id, list(net.initial_peers), net.identity_path,
                            net.host, net.dht_port, secret=self._secret,
                            allowed=self.cfg.auth.allowed(), p2p_options=p2p_options,
                            p2pd_flags=p2pd_flags).start()
        if self.reachability == "private":
            log.info("reachability: private (network.reachable = %s): DHT client, relay "
                     "slots at the initial peers, peers reach this node (data, state) by "
                     "libp2p streams", net.reachable)
        policy = RoundPolicy(codec=self.cfg.codec.name, block_size=self.cfg.codec.block_size,
                             chunk_numel=net.chunk_numel, timeout=net.allreduce_timeout,
                             max_attempts=net.max_attempts,
                             aggregator=self.cfg.aggregator.spec(),
                             max_group_size=net.max_group_size, mix_every=net.mix_state_every)
        agg = self.cfg.aggregator
        self.bans = (BanTracker(agg.ban_after, agg.ban_window, agg.ban_seconds)
                     if agg.ban_after else None)
        plane_options: dict[str, Any] = {"auth": self.dht.credentials,
                                         "gate": self.admission.gate("data"),
                                         "tcp_congestion": net.tcp_congestion,
                                         # rotating groups: idle peers' connections close
                                         "max_idle_inbound": 4 * net.max_group_size}
        if net.p2p_fallback:
            from dilonode.swarm.tunnel import Tunnel, relay_peers

            private = self.reachability == "private"
            # Streams to private nodes go through a relay at our initial peers unless p2pd
            # holds a direct connection; public nodes relay for others (swarm/tunnel.py).
            self.tunnel = Tunnel(self.dht.p2p_daemon_maddr(), self.cfg.run_id,
                                 private=private, relays=relay_peers(net.initial_peers),
                                 private_peers=self._private_peers,
                                 admitted=None if private else self._is_live)
            plane_options["fallback"] = self.tunnel.open
        self.collective = NetworkCollective(self.dht.peer_id, self.cfg.run_id, self._form,
                                            policy, host=net.host, port=net.port,
                                            bans=self.bans, plane_options=plane_options,
                                            reuse_results=True,  # the trainer lands first
                                            keep_encoded=_serves_replays(self.cfg))
        address = self.collective.start()
        if self.tunnel is not None:
            self.collective.thread.run(self.tunnel.start(self.collective.plane.accept_stream),
                                       timeout=30.0)
        self.status.peer_id, self.status.worker_id = self.peer_id, str(self.worker_id or "")
        self._start_status_server()
        if net.announce_host:
            address = f"{net.announce_host}:{address.rsplit(':', 1)[1]}"
        # Recover before publishing our record, so peers do not wait for us in matchmaking.
        self._build_worker()
        plane = self.collective.plane
        self.membership = Membership(self.dht, self.cfg.run_id, net, address, self._status,
                                     settings=policy.settings(), gone=plane.gone.copy)
        self.keeper.source.counts = self.membership.counts
        self.membership.reachable = self.reachability == "public"
        self.membership.state_addr = self.keeper.start_server(
            self.collective.thread, self.dht.credentials, self.admission.gate("state"))
        if self.tunnel is not None:
            # Peers behind a NAT serve and fetch state over libp2p streams too.
            self.keeper.opener = self.tunnel.open_state
            if self.keeper.server is not None:
                self.collective.thread.run(
                    self.tunnel.serve_state(self.keeper.server.accept_stream), timeout=30.0)
        self._start_clock()
        self.keeper.prepare(self.worker, self.collective.thread, self.dht,
                            publish=self.membership.start, stop=stop,
                            first_round=self._first_round)
        self.membership.wait_for_peers(net.min_peers, net.start_timeout, stop)
        log.info("node %s up: data %s, maddrs %s", self.peer_id, self.collective.address,
                 self.dht.visible_maddrs())
        self._supervise()

    def _supervise(self) -> None:
        """Watch our parts (supervise.enabled) and re-merge after partitions (.remerge)."""
        from dilonode.node.remerge import Remerger
        from dilonode.node.supervised_parts import node_parts
        from dilonode.node.supervisor import Supervisor

        sup = self.cfg.supervise
        if sup.enabled:
            self.supervisor = Supervisor(node_parts(self), sup, self._give_up,
                                         on_change=self._part_changed)
            self.supervisor.start()
        if sup.remerge:
            assert self.dht is not None
            self.remerger = Remerger(self.dht, sup)
            self.remerger.start()

    def _give_up(self, reason: str) -> None:
        """The supervisor's loud exit: stop training (the exit checkpoint is written as on
        any stop), and exit hard if that does not happen within supervise.exit_grace."""
        self.failure = reason
        self.status.set_state("failed")
        if self._stop is not None:
            self._stop.set()
        grace = self.cfg.supervise.exit_grace
        self._hard_exit = threading.Timer(grace, _exit_hard, args=(reason, grace))
        self._hard_exit.daemon = True
        self._hard_exit.start()

    def _part_changed(self, part: str, down: bool) -> None:
        """Our data listener is back: reset the connections peers had open to it (they may
        sit in TCP retransmission backoff after an outage, and would cost the next round a
        timeout) and publish our record at once, so that peers that left us out while we
        sat rounds out (`_away`, carried by the heartbeat) expect us again."""
        if part != "data" or down or self.membership is None or self.collective is None:
            return
        outage = self._health()["parts"]["data"]["last_outage_s"] or 0.0
        if outage < 2 * self.cfg.supervise.check_interval:
            return  # back within a restart (a destroyed listener): nothing went stale
        plane = self.collective.plane

        async def reset() -> int:
            return plane.reset_inbound()

        dropped = self.collective.thread.run(reset(), timeout=5.0)
        log.info("data listener back: reset %d connection(s) peers had open to it", dropped)
        self.membership.publish()

    def _away(self) -> str | None:
        """Why we are sitting rounds out, or None: our data listener has been down for
        longer than a restart takes (a destroyed listener is back within a check; one that
        peers cannot reach stays down, and every round with us would cost them a timeout).
        A round we sit out is a lone round: we re-sync after it, as after any other."""
        down = self.supervisor.down_for("data") if self.supervisor is not None else None
        if down is not None and down >= 2 * self.cfg.supervise.check_interval:
            return f"data listener down for {down:.0f}s"
        return None

    def _health(self) -> dict[str, Any]:
        return self.supervisor.snapshot() if self.supervisor is not None else {}

    def _live_others(self) -> int:
        """Other peers with a live record, from membership's last read (no DHT call)."""
        if self.membership is None or self.dht is None:
            return 0
        me = self.dht.peer_id
        return sum(r.peer_id != me for r in self.membership.live_peers(max_age=math.inf))

    def _first_round(self, view_s: float) -> int | None:
        """We are about to publish our record after recovering a running swarm's state:
        name our first round in it, the first reference step `pacing.first_round` allows
        once `view_s` has passed, so that every peer counts us from the same round on
        whenever it reads the record. Returns the step our state must reach (every round
        before it), or None when rounds are not paced by an agreed clock."""
        from dilonode.algo.pacing import TimePacer, first_round

        w = self.worker
        if (w is None or self.membership is None or not isinstance(w.pacer, TimePacer)
                or w.pacer.clock is None):
            return None
        joins_from = first_round(w.pacer.clock.ref_step(w.pacer.now() + view_s))
        self.membership.joins_from = joins_from
        log.info("state sync: our first round is reference step %.1f of the swarm clock",
                 joins_from)
        return w.joining_floor(joins_from)

    def _start_clock(self) -> None:
        """pacing = "time": agree on the swarm clock through the DHT (swarm/clock.py)."""
        from dilonode.algo.pacing import TimePacer

        if not isinstance(self.worker.pacer, TimePacer):
            return
        from dilonode.swarm.clock import ClockKeeper

        a = self.cfg.diloco.effective()
        w, fixed = self.worker, a.step_seconds
        floor = a.min_round_seconds / a.sync_every

        def propose() -> float | None:
            # Measured over a few steps (the first ones include warm-up), unless configured;
            # never so short that a fragment's rounds come faster than a group can form.
            if fixed:
                return fixed
            return max(w.pacer.step_s, floor) if w.step >= 5 and w.pacer.step_s else None

        self.clock = ClockKeeper(self.dht, self.cfg.run_id, w.pacer, propose,
                                 frozen=lambda: any(w.next_round) or bool(w.pending),
                                 ttl=max(4 * self.cfg.network.peer_ttl, 60.0),
                                 retune=self._retune if a.retune_clock else None,
                                 pacemaker=self._is_pacemaker, lead_steps=a.sync_every,
                                 link_unmeasured=lambda: len(w.stats.recent_latency) < 3)
        self.keeper.on_link = self._announce_link
        try:
            self.clock.tick()  # a clock that already stands is followed from the first step
        except (TimeoutError, RuntimeError) as exc:
            log.warning("swarm clock: first read failed (%s); reading again shortly", exc)
        self.clock.start()

    def _is_pacemaker(self) -> bool:
        """The live node with the smallest peer id retunes the swarm clock (one at a time;
        two at once, in a partition, resolve by the clock records' rule). A node whose own
        record is not among them yet (a joiner still fetching the state) is not live: it
        knows no round latencies of its own, and a second pacemaker's epoch races the
        first's."""
        if self.membership is None:
            return False
        live = {r.peer_id for r in self.membership.live_peers(max_age=math.inf)}
        return self.peer_id in live and self.peer_id == min(live)

    def _announce_link(self, rate_Bps: float, result_bytes: dict[int, int], peers: int) -> None:
        """Our state fetch measured our link. If it is slower than `network.bandwidth_mbps`,
        take that as our weight in rounds (a smaller part of each round's traffic goes
        through it); and tell the pacemaker how long a round of every fragment takes on it
        (`pacing.link_busy_seconds`), so that the clock slows before our first round, not
        after slow ones. Fragments whose results the manifests did not list count as the
        mean of those that did."""
        from dilonode.algo.pacing import link_busy_seconds

        if self.membership is not None and self.membership.advertise_bandwidth(
                rate_Bps * 8e-6):
            log.info("link: state sync moved %.1f Mbit/s, under network.bandwidth_mbps = %g: "
                     "our rounds give us a part of that weight", rate_Bps * 8e-6,
                     self.cfg.network.bandwidth_mbps)
        if self.clock is None or not result_bytes:
            return
        mean = sum(result_bytes.values()) / len(result_bytes)
        sizes = [result_bytes.get(p, mean)
                 for p in range(self.cfg.diloco.effective().num_fragments)]
        # As if our part were an equal one, though our weight may now be smaller: while we
        # fetch, the clock must also leave our link room for the results of every round
        # that lands meanwhile (B / rate each), or the fetch chases them pass after pass
        # while our peers wait for our first round. Counting the smaller part (1.07 B
        # against 1.6 B here) set a 22% faster clock, and in that run the joiner took 20 s
        # from its publish to its first round, its peers waiting (docs/autotune-results.md).
        busy = link_busy_seconds(sizes, peers, rate_Bps)
        log.info("link: state sync moved %.2f MB/s; a round of every fragment with %d peers "
                 "takes %.1f s of it (published until our rounds measure it)",
                 rate_Bps / 1e6, peers, busy)
        if busy > 0:
            self.clock.announce_link(busy, rate_Bps)

    def _retune(self, clock: Any, ref_now: float,
                link_busy: Sequence[float] = ()) -> float | None:
        """Seconds per reference step the swarm needs (`pacing.retune_step_seconds`), from
        the round latencies, what the links of nodes not yet in rounds take for a round of
        every fragment, and, when the clock was measured rather than set by hand
        (diloco.step_seconds unset), the paces (wall seconds per own step) that live nodes
        publish."""
        from dilonode.algo.pacing import retune_step_seconds
        from dilonode.status.snapshot import p90

        a = self.cfg.diloco.effective()
        measured = a.step_seconds is None
        own = p90(list(self.worker.stats.recent_latency))
        latencies = [own] if own is not None else []
        steps = [s] if measured and (s := self.worker.pacer.pace_s) else []
        behind = [float(self.worker.swarm_step - self.worker.step)] if steps else []
        for rec in self.membership.live_peers(max_age=math.inf) if self.membership else []:
            status = rec.status or {}
            if (value := _positive(status.get("round_p90_s"))) is not None:
                latencies.append(value)
            if measured and (value := _positive(status.get("pace_s"))) is not None:
                steps.append(value)
                if (lag := _steps_behind(status)) is not None:
                    behind.append(lag)
        if not latencies and not steps and not link_busy:
            return None
        return retune_step_seconds(clock, latencies, steps, a.sync_every,
                                   a.min_round_seconds, a.max_round_seconds, link_busy,
                                   behind)

    async def _form(self, request: GroupRequest) -> FormedGroup:
        # The collective is created before membership (membership needs its address).
        assert self.membership is not None and self.collective is not None
        if self._away() is not None and (away := await self._wait_back(request.attempt)) \
                is not None:
            raise ConnectionError(f"sitting this round out: {away}")  # do not register
        if self.tunnel is not None and self.tunnel.private:
            # Before we register: the public peers' streams to us must find a direct
            # libp2p connection, not a limited relayed one (swarm/tunnel.py).
            seen = self.membership.live_peers(max_age=math.inf)  # the last read
            await self.tunnel.reach_out(r.peer_id for r in seen
                                        if r.reachable and r.peer_id != self.peer_id)
        group = await self.membership.form(request)
        # Peers behind a NAT, as of the records just read: stream to them, no dial first.
        self.collective.plane.stream_only = self._private_peers()
        return group

    def _private_peers(self) -> frozenset[str]:
        """Peers whose last read record says they cannot be dialled (behind a NAT)."""
        if self.membership is None:
            return frozenset()
        seen = self.membership.live_peers(max_age=math.inf)  # the last read, no DHT call
        return frozenset(r.peer_id for r in seen if not r.reachable)

    def _is_live(self, peer_id: str) -> bool:
        """Whether `peer_id` has a live record (the relay serves only peers of the run)."""
        return self.membership is not None and any(
            r.peer_id == peer_id for r in self.membership.live_peers(max_age=math.inf))

    async def _wait_back(self, attempt: int) -> str | None:
        """While we sit rounds out, a round's first attempt waits as long as forming a
        group may take for our data listener to come back; None if it did. Going on at
        once instead made a node train ahead of its swarm through lone rounds, and a node
        ahead of its peers finds no newer state to re-sync to."""
        deadline = time.monotonic() + (self.cfg.network.matchmaking_timeout if attempt == 0
                                       else 0.0)
        while (away := self._away()) is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.25)
        return away

    def _status(self) -> dict[str, Any]:
        w = self.worker
        away = self._away()
        # Peers leave a "leaving" record out of their groups: while we cannot be reached
        # for rounds we are as good as gone to them, and they should not wait for us.
        return {"step": w.step if w is not None else 0, "worker": self.worker_id,
                **self.status.summary(), **({"leaving": True, "away": away} if away else {})}

    def _trust_counters(self) -> dict[str, int]:
        # Data-plane and state-sync handshakes refused, in one counter.
        return {"unauthorized_connections":
                (self.collective.unauthorized_attempts if self.collective else 0)
                + self.keeper.unauthorized_attempts,
                "unauthorized_records": self.dht.unauthorized_records if self.dht else 0,
                "rejected_contributions": self.bans.rejections_total if self.bans else 0,
                "peer_bans": self.bans.bans_total if self.bans else 0}

    def _peers_seen(self) -> int:
        # max_age=inf: the last read membership made, never a DHT call on a reader's thread.
        return len(self.membership.live_peers(max_age=math.inf)) if self.membership else 0

    def _start_status_server(self) -> None:
        """Serve /status, /metrics and the dashboard on the network loop (status.enabled)."""
        if not self.cfg.status.enabled:
            return
        from dilonode.status.metrics import node_metrics
        from dilonode.status.server import StatusServer

        assert self.collective is not None
        server = StatusServer(self.status, node_metrics, host=self.cfg.status.host,
                              port=self.cfg.status.port, gate=self.admission.gate("status"))
        self.status.url = self.collective.thread.run(server.start(), timeout=10.0)
        self.status_server = server

    @property
    def status_url(self) -> str:
        """Base URL of the status endpoint ("" when disabled or not started)."""
        return self.status.url

    @property
    def peer_id(self) -> str:
        assert self.dht is not None, "Node.start() first"
        return self.dht.peer_id

    def _build_worker(self) -> None:
        # Built after the DHT has forked, so its process does not carry a copy of the model.
        import time

        from dilonode.algo.pacing import StepPacer, TimePacer
        from dilonode.train.data import load_data
        from dilonode.train.worker import Worker

        self.data = load_data(self.cfg.data)
        assert self.collective is not None
        collective = ObservedCollective(self.collective, self.status,
                                        lambda: self.worker.step if self.worker else 0)
        timed = self.cfg.diloco.pacing == "time" and self.cfg.diloco.mode != "ddp"
        ranks, device = self._ranks()
        identity = ranks.handshake(self.worker_id or self.peer_id, device)
        self.status.devices = list(ranks.devices)
        self.worker = Worker(self.cfg, self.data, collective, identity=identity,
                             device=device, pacer=TimePacer(time.time) if timed else StepPacer(),
                             ranks=ranks)
        if self.cfg.paths.trace:
            self.worker.trace = []

    def _ranks(self) -> tuple[Any, Any]:
        """This node's ranks and our device (one process: SingleRank, cfg.device)."""
        from dilonode.train.device import pick_device
        from dilonode.train.ranks.single import SingleRank

        if self.ranks is not None:
            return self.ranks, self.ranks.device
        return SingleRank(), pick_device(self.cfg.device)

    def close(self) -> None:
        """Withdraw the peer record, stop the data plane and the DHT (idempotent)."""
        if self.ranks is not None:
            self.ranks.stop()  # the other ranks exit
        for watcher in (self.supervisor, self.remerger, self.clock):
            if watcher is not None:  # nothing restarts or re-times behind our back
                watcher.close()
        if self._hard_exit is not None:
            self._hard_exit.cancel()
        if self.collective is not None:
            self.keeper.close(self.collective.thread)
        if self.membership is not None:
            self.membership.close()
        if self.status_server is not None and self.collective is not None:
            server, self.status_server = self.status_server, None
            try:
                self.collective.thread.run(server.aclose(), timeout=5.0)
            except Exception as exc:  # closing must go on whatever the HTTP side does
                log.warning("status server did not close cleanly: %s", exc)
        if self.tunnel is not None and self.collective is not None:
            tunnel, self.tunnel = self.tunnel, None
            try:
                self.collective.thread.run(tunnel.aclose(), timeout=15.0)
            except Exception as exc:  # closing must go on whatever p2pd does
                log.warning("libp2p tunnel did not close cleanly: %s", exc)
        if self.collective is not None:
            self.collective.close()
        if self.dht is not None:
            self.dht.close()

    # -- training --------------------------------------------------------------------------
    def run(self, stop: threading.Event, total_steps: int | None = -1,
            on_step: Any = None) -> NodeSummary:
        """Train until `total_steps` (-1: the config's; None: until `stop`)."""
        from dilonode.train.loop import train_loop

        steps = self.cfg.total_steps if total_steps == -1 else total_steps
        self._stop = stop  # the supervisor sets it when it gives up
        if self.failure is not None:
            stop.set()
        batches = self.data.eval_batches(self.cfg.data.seq_len, self.cfg.data.batch_size,
                                         self.cfg.data.eval_batches)
        self.status.total_steps = steps

        def hook(worker: Any, rep: Any) -> None:
            self.keeper.on_step(worker)
            self.keeper.resync_if_behind(worker, self.collective.thread, self.dht)
            self.status.on_step(worker, rep)
            if on_step is not None:
                on_step(worker, rep)

        self.keeper.training(True)
        try:
            rep = train_loop(self.worker, steps, self.cfg.eval_every, batches, stop, hook,
                             leave_timeout=self.cfg.network.leave_timeout)
        finally:
            self.keeper.training(False)
        if steps is not None and not rep.stopped_early and self.worker.plan is not None:
            self.verdict = self._agree()
            self.status.set_agreement(self.verdict.as_dict())
            if self.verdict.adopted:  # the weights changed: evaluate what we hold now
                rep.eval_history[-1] = (self.worker.step, self.worker.evaluate(batches))
        self.keeper.finish(self.worker, abandoned=self.worker.stats.abandoned)
        self.status.set_state("stopped" if rep.stopped_early else "finished")
        return self._summary(rep)

    def _final_record(self) -> Any:
        from dilonode.swarm.records import FinalRecord

        w = self.worker
        return FinalRecord(peer_id=self.peer_id, run_id=self.cfg.run_id,
                           digest=w.outer_digest(),
                           rounds=list(w.next_round), chains=list(w.chains),
                           tokens=w.stats.tokens, end_step=w.end_step or 0)

    def _agree(self) -> Any:
        """The end-of-run check (swarm/agreement.py): publish our final weights' digest,
        compare with the peers of our last rounds; if ours are not the ones that stand,
        adopt those through state sync and compare again (a few passes: in a grouped
        swarm every group ends on its own state, and the first pass's adoptions make one
        of them stand clearly). Logs one line."""
        from dilonode.swarm.agreement import FinalBoard

        assert self.dht is not None and self.collective is not None
        net = self.cfg.network
        board = FinalBoard(self.dht, self.cfg.run_id)
        expected = self._final_peers()
        wait = net.matchmaking_timeout + net.allreduce_timeout
        mine = self._final_record()
        try:
            board.publish(mine)
            got = board.collect(mine, expected, wait, live=self._live_for_final_check)
            adopted = False
            for _ in range(_AGREE_PASSES):
                if got.agrees is not False:
                    break
                got, mine, took = self._settle(board, mine, expected, wait)
                adopted = adopted or took
            got.adopted = adopted
        except (TimeoutError, RuntimeError) as exc:
            from dilonode.swarm.agreement import Verdict

            log.error("end-of-run agreement check failed: %s", exc)
            got = Verdict(mine.digest, missing=sorted(expected))
        (log.error if got.agrees is False else log.info)("end of run: %s", got.line())
        # Stay until the peers holding our weights have read them: they may still be
        # checking, and once we leave our record can no longer be read.
        t0 = time.monotonic()
        try:
            got.unconfirmed = board.linger(mine, got.same if got.agrees else (), wait,
                                           gone=self._left_cleanly)
        except (TimeoutError, RuntimeError) as exc:
            log.warning("end-of-run check: could not say our check ended: %s", exc)
        if (stayed := time.monotonic() - t0) >= 1.0 and not got.unconfirmed:
            log.info("end of run: stayed %.1f s until the peers on our weights had checked "
                     "them", stayed)
        if got.unconfirmed:
            log.warning("end of run: left before %d peer(s) ended their check: %s",
                        len(got.unconfirmed), ", ".join(got.unconfirmed))
        return got

    def _left_cleanly(self) -> set[str]:
        """Peers whose membership record says they left (empty if the DHT cannot say)."""
        try:
            assert self.dht is not None
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
            assert self.membership is not None
            live = {r.peer_id for r in self.membership.live_peers()}
        except (TimeoutError, RuntimeError) as exc:
            log.debug("end-of-run check: could not read the peers' records: %s", exc)
            return None
        return live if self.peer_id in live else None

    def _final_peers(self) -> set[str]:
        """Whom the end-of-run check waits for: the members of our last rounds and every
        live peer. In a grouped swarm all must read the same records to pick the same
        standing weights among the groups'; and a node whose last rounds went alone (its
        state was left out) must still compare, or it would leave holding other weights."""
        expected = {m for ms in self.worker.stats.members.values() for m in ms}
        try:
            if self.membership is not None:
                expected |= {r.peer_id for r in self.membership.live_peers(max_age=1.0)}
        except (TimeoutError, RuntimeError) as exc:  # a DHT hiccup: our last groups then
            log.warning("end-of-run check: could not read the live peers: %s", exc)
        return expected - {self.peer_id}

    def _settle(self, board: Any, mine: Any, expected: set[str],
                wait: float) -> tuple[Any, Any, bool]:
        """One pass: adopt the weights that stand if ours are not them, then wait for the
        expected peers to hold one state; (verdict, our record, whether we adopted)."""
        from dilonode.swarm.agreement import standing_digest

        assert self.collective is not None
        records = {p: r for p, r in board.read().items()
                   if r.end_step == mine.end_step} | {self.peer_id: mine}
        stands = standing_digest(records)
        adopted = False
        if stands != mine.digest:
            holders = tuple(p for p, r in records.items() if r.digest == stands)
            board.publish(mine.model_copy(update={"adopting": stands}))  # holders wait
            try:
                adopted = self.keeper.adopt(self.worker, self.collective.thread, self.dht,
                                            prefer=holders)
            finally:  # adopted or not, we are no longer adopting: nobody waits on us
                mine = self._final_record()
                board.publish(mine)
        # Ours stands (or is now the standing one): give the others time to adopt it.
        return board.collect(mine, expected, wait, settle=True, live=self._live_for_final_check,
                             patience=self.cfg.statesync.recover_timeout), mine, adopted

    def _summary(self, rep: Any) -> NodeSummary:
        st = self.worker.stats
        return NodeSummary(
            peer_id=self.peer_id, worker_id=str(self.worker_id or self.peer_id),
            steps=rep.steps, tokens=rep.tokens, final_eval_loss=rep.eval_history[-1][1],
            bytes_sent=st.bytes_sent, bytes_received=st.bytes_received,
            rounds_per_fragment=dict(sorted(st.rounds.items())), skipped_rounds=st.skipped,
            retried_rounds=st.retried,
            dropped_peers=list(st.dropped), compute_utilization=rep.compute_utilization,
            step_share=rep.step_share, sync_wait_s=rep.sync_wait_s,
            wall_s=rep.wall_s, outer_digest=self.worker.outer_digest(),
            stopped_early=rep.stopped_early,
            round_latency_s={p: {"n": n, "mean": total / n, "max": worst}
                             for p, (n, total, worst) in sorted(st.latency.items())},
            peer_convictions=self.bans.rejections_total if self.bans else 0,
            peer_bans=self.bans.bans_total if self.bans else 0,
            rounds_with_peers=st.grouped, missed_rounds=st.missed,
            late_rounds=st.late, diverged_rounds=st.diverged,
            agreement=self.verdict.as_dict() if self.verdict is not None else {},
            grouped=self.worker.grouped, largest_group=st.largest_group,
            checkpoint_age_s=self.keeper.checkpointer.age_s(),
            devices=device_summary(self.status.devices),
            reachability=self.reachability, data_paths=self._data_paths())

    def _data_paths(self) -> dict[str, int]:
        st = self.collective.plane.stats if self.collective and self.collective.plane else {}
        out = {k: st.get(k, 0) for k in ("connections_out", "fallback_connections",
                                         "fallback_accepts", "direct_failures")}
        tunnel = self.tunnel.stats if self.tunnel is not None else {}
        relay = self.tunnel.relay.stats if self.tunnel and self.tunnel.relay else {}
        return {"direct_out": out["connections_out"] - out["fallback_connections"],
                "stream_out": out["fallback_connections"],
                "stream_in": out["fallback_accepts"],
                "direct_failures": out["direct_failures"],
                "relayed_out": tunnel.get("relayed_out", 0),
                "relayed_for_others": relay.get("relayed", 0)}

    def save_outer(self, path: Path) -> None:
        """Write the outer weights (state dict) for comparisons and evaluation."""
        import torch

        torch.save(self.worker.outer_state_dict(), path)


def summary_json(summary: NodeSummary) -> str:
    return json.dumps({"event": "summary", **asdict(summary)})


def _exit_hard(reason: str, grace: float) -> None:
    """The node gave up and did not stop within `grace` s: say why on one line and exit 1."""
    log.error("did not stop within %.0fs of giving up; exiting now", grace)
    print(f"dilonode: {reason}", file=sys.stderr, flush=True)
    os._exit(1)


def _serves_replays(cfg: RunConfig) -> bool:
    """Whether rounds keep their encoded result for joiners to replay (algo/replay.py).
    Not for float32: the result is then as large as the fragment's weights, so keeping it
    would add the model's size in memory to save a joiner at most half a fragment."""
    return cfg.statesync.enabled and cfg.diloco.mode != "ddp" and cfg.codec.name != "float32"


def _steps_behind(status: dict[str, Any]) -> float | None:
    """Reference steps the clock read minus the own steps a peer had trained, at its last
    published step (`swarm_step`, `step` of its status), else None (peers' data)."""
    ref, own = status.get("swarm_step"), status.get("step")
    if all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 40
           for v in (ref, own)):
        return float(ref - own)
    return None


def _positive(value: Any) -> float | None:
    """A finite positive number read off a peer's status, else None (peers' data)."""
    if isinstance(value, int | float) and not isinstance(value, bool) \
            and math.isfinite(value) and 0 < value < 1e5:
        return float(value)
    return None
