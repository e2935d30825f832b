"""Composition root of a training node: DHT, data plane, trainer and heartbeat wired together.

`Node(cfg, worker_id=..., resume=...)` does no I/O. `start()` joins the DHT (hivemind, in its
own process; started first because it forks), brings up the all-reduce data plane on a
background event loop, builds the worker, lets `StateKeeper` resume it from a checkpoint
and/or recover the run's state from live peers, publishes this node's peer record
(`Membership`) and waits for `network.min_peers`. `run(stop)` trains on the calling thread
until `total_steps` or until `stop` is set, then lands in-flight syncs (abandoning those not
done within `network.leave_timeout` when stopped). `close()` stops serving state, withdraws
the peer record and shuts everything down within seconds.

Each part is built with what it needs, in an order that lets every one take its
dependencies when it is built: the membership before the data plane (the group former,
`forming.GroupFormer`, needs it; the plane's address is attached once it listens), the
worker before the swarm clock (`pacemaker.Pacemaker`), the clock before the state keeper
(it hears what a state fetch measured of our link). The worker's rounds carry what
matchmaking needs (`collective.RoundRequest`); nothing below calls back into the node.
The end-of-run agreement is `end_of_run.EndOfRun`, the run summary `summary.NodeSummary`,
sitting rounds out while the data listener is down `sit_out.SitOut`.

Once started, a `Supervisor` (dilonode/node/supervisor.py, parts in
dilonode/node/supervised_parts.py) watches the DHT process and p2pd, the data plane, state
and status listeners and restarts them in place; a `Remerger` (node/remerge.py) finds the
swarm again after a partition. If a part cannot be brought back, the node stops training,
writes its exit checkpoint and `failure` holds the one-line reason (the CLI then exits
non-zero).

On a node with several local devices this is rank 0 (`ranks`,
dilonode/train/ranks/node_ranks.py): it alone runs the network side, and its Worker
announces every model operation to the other ranks, which `follow` it; to the swarm the
node is one peer.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
from pathlib import Path
from typing import Any

from dilonode.algo.robust import BanTracker
from dilonode.allreduce.network_collective import NetworkCollective
from dilonode.allreduce.plane_limits import PlaneLimits, PlaneOptions
from dilonode.allreduce.retry import RoundPolicy
from dilonode.config import RunConfig
from dilonode.net import sockbuf
from dilonode.net.admission import Admission
from dilonode.node.end_of_run import EndOfRun
from dilonode.node.forming import GroupFormer
from dilonode.node.pacemaker import Pacemaker
from dilonode.node.sit_out import DataListenerBack, SitOut
from dilonode.node.summary import NodeSummary, data_paths
from dilonode.statesync.keeper import StateKeeper, check_config
from dilonode.status.isolation import AloneWatch
from dilonode.status.snapshot import NodeStatus, ObservedCollective, device_summary
from dilonode.swarm import reachability as reach
from dilonode.swarm import swarm_time
from dilonode.swarm.dht import SwarmDHT
from dilonode.swarm.membership import Membership

__all__ = ["Node"]

log = logging.getLogger(__name__)


class Node:
    """One training node; see the module docstring for its life cycle."""

    def __init__(self, cfg: RunConfig, worker_id: str | None = None,
                 resume: bool = False, secret: bytes = b"", ranks: Any = None) -> None:
        check_config(cfg)  # a schedule the keeper cannot snapshot is refused here
        self.cfg = cfg
        self.ranks = ranks  # NodeRanks of a multi-rank node (we are rank 0), else None
        self.worker_id = worker_id
        self.resume = resume
        self._secret = secret  # the swarm secret (auth config), read by the CLI
        self.keeper: StateKeeper | None = None  # checkpoints, resume, state sync (start())
        self.dht: SwarmDHT | None = None
        self.collective: NetworkCollective | None = None
        self.worker: Any = None
        self.membership: Membership | None = None
        self.tunnel: Any = None  # libp2p-stream fallback of the data plane (swarm.tunnel)
        self.bans: BanTracker | None = None  # peers left out for repeated rejections
        # Caps on incoming connections and peer-caused log lines, per listening port.
        self.admission = Admission(interval=cfg.admission.log_interval)
        sup = cfg.supervise
        self.sit_out = SitOut(sup, cfg.network.matchmaking_timeout)
        self.status = NodeStatus(cfg.run_id, cfg.total_steps, history=cfg.status.history,
                                 facts=_PartsFacts(self),
                                 alone=AloneWatch(sup.alone_warn_rounds, sup.alone_log_every))
        self.status_server: Any = None
        self.pacemaker: Pacemaker | None = None  # the swarm clock (pacing = "time")
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
        self.dht = self._start_dht()
        policy = _round_policy(self.cfg)
        agg = self.cfg.aggregator
        self.bans = (BanTracker(agg.ban_after, agg.ban_window, agg.ban_seconds)
                     if agg.ban_after else None)
        self.membership = Membership(self.dht, self.cfg.run_id, net, status=self._record_status,
                                     settings=policy.settings(),
                                     reachable=self.reachability == "public")
        self.tunnel = self._tunnel(self.membership)
        former = GroupFormer(self.membership, self.sit_out, self.tunnel)
        self.collective = NetworkCollective(self.dht.peer_id, self.cfg.run_id, former.form,
                                            policy, host=net.host, port=net.port,
                                            bans=self.bans,
                                            plane_options=self._plane_options(),
                                            reuse_results=True,  # the trainer lands first
                                            keep_encoded=_serves_replays(self.cfg))
        address = self.collective.start()
        thread = self.collective.thread
        if self.tunnel is not None:
            thread.run(self.tunnel.start(self.collective.plane.accept_stream), timeout=30.0)
        if net.announce_host:
            address = f"{net.announce_host}:{address.rsplit(':', 1)[1]}"
        self.membership.attach_data_plane(address, self.collective.plane.gone.copy)
        self.status.peer_id, self.status.worker_id = self.peer_id, str(self.worker_id or "")
        self._start_status_server()
        # Recover before publishing our record, so peers do not wait for us in matchmaking.
        self._build_worker()
        self._start_state(stop)
        self.membership.wait_for_peers(net.min_peers, net.start_timeout, stop,
                                       refreshed=self.resume)
        assert self.keeper is not None
        if stop is None or not stop.is_set():
            self.keeper.catch_up(self.worker, self.collective.thread, self.dht)
        log.info("node %s up: data %s, maddrs %s", self.peer_id, self.collective.address,
                 self.dht.visible_maddrs())
        self._supervise()

    def _start_dht(self) -> SwarmDHT:
        """Our reachability resolved, the DHT (and p2pd) started in its own process."""
        net = self.cfg.network
        self.admission.setup(self.cfg.admission)  # before the DHT forks: it inherits the limit
        self.reachability = reach.resolve(net.reachable, net.host, net.announce_host,
                                          net.initial_peers)
        p2p_options, p2pd_flags = reach.dht_options(self.reachability, net.initial_peers)
        dht = SwarmDHT(self.cfg.run_id, list(net.initial_peers), net.identity_path,
                       net.host, net.dht_port, secret=self._secret,
                       allowed=self.cfg.auth.allowed(), p2p_options=p2p_options,
                       p2pd_flags=p2pd_flags, max_clock_offset=net.max_clock_offset).start()
        if self.reachability == "private":
            log.info("reachability: private (network.reachable = %s): DHT client, relay "
                     "slots at the initial peers, peers reach this node (data, state) by "
                     "libp2p streams", net.reachable)
        return dht

    def _tunnel(self, membership: Membership) -> Any:
        """The libp2p-stream fallback of the data plane (network.p2p_fallback), or None."""
        net = self.cfg.network
        if not net.p2p_fallback:
            return None
        from dilonode.swarm.tunnel import Tunnel, relay_peers

        assert self.dht is not None
        private = self.reachability == "private"
        # Streams to private nodes go through a relay at our initial peers unless p2pd
        # holds a direct connection; public nodes relay for others (swarm/tunnel.py).
        return Tunnel(self.dht.p2p_daemon_maddr(), self.cfg.run_id, private=private,
                      relays=relay_peers(net.initial_peers),
                      private_peers=membership.private_peers,
                      admitted=None if private else membership.is_live)

    def _plane_options(self) -> PlaneOptions:
        assert self.dht is not None
        net = self.cfg.network
        # Rotating groups: idle peers' connections close (max_idle_inbound).
        buffer = net.socket_buffer_bytes
        limits = PlaneLimits(tcp_congestion=net.tcp_congestion,
                             socket_buffer_bytes=(sockbuf.bdp_bytes(net.bandwidth_mbps)
                                                  if buffer == "auto" else buffer),
                             max_idle_inbound=4 * net.max_group_size)
        options: PlaneOptions = {"limits": limits, "auth": self.dht.credentials,
                                 "gate": self.admission.gate("data")}
        if self.tunnel is not None:
            options["fallback"] = self.tunnel.open
        return options

    def _start_state(self, stop: threading.Event | None) -> None:
        """The swarm clock (pacing = "time"), then the state keeper: serve state, resume
        and/or recover, publish our record."""
        assert self.dht is not None and self.membership is not None
        assert self.collective is not None
        from dilonode.algo.pacing import TimePacer

        if isinstance(self.worker.pacer, TimePacer):
            self.pacemaker = Pacemaker(self.cfg, self.dht, self.worker, self.membership)
            self.pacemaker.start()
        pm, thread = self.pacemaker, self.collective.thread
        self.keeper = StateKeeper(
            self.cfg, self.resume,
            # Peers behind a NAT serve and fetch state over libp2p streams too.
            opener=self.tunnel.open_state if self.tunnel is not None else None,
            on_link=pm.announce_link if pm is not None else None)
        self.membership.attach_state_server(self.keeper.start_server(
            thread, self.dht.credentials, self.admission.gate("state")))
        if self.tunnel is not None and self.keeper.server is not None:
            thread.run(self.tunnel.serve_state(self.keeper.server.accept_stream),
                       timeout=30.0)
        self.keeper.prepare(self.worker, thread, self.dht, publish=self.membership.start,
                            stop=stop, first_round=pm.first_round if pm is not None else None,
                            counts=self.membership.counts)

    def _supervise(self) -> None:
        """Watch our parts (supervise.enabled) and re-merge after partitions (.remerge)."""
        from dilonode.node.remerge import Remerger
        from dilonode.node.supervised_parts import node_parts
        from dilonode.node.supervisor import Supervisor

        assert self.dht is not None and self.collective is not None
        assert self.membership is not None
        sup = self.cfg.supervise
        if sup.enabled:
            back = DataListenerBack(self.sit_out, self.collective.plane, self.collective.thread,
                                    self.membership.publish)
            self.supervisor = Supervisor(node_parts(self), sup, self._give_up, on_change=back)
            self.sit_out.watch(self.supervisor)
            self.supervisor.start()
        if sup.remerge:
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

    def _record_status(self) -> dict[str, Any]:
        """The status our peer record carries (the heartbeat publishes it)."""
        w = self.worker
        away = self.sit_out.away()
        # Peers leave a "leaving" record out of their groups: while we cannot be reached
        # for rounds we are as good as gone to them, and they should not wait for us.
        return {"step": w.step if w is not None else 0, "worker": self.worker_id,
                **self.status.summary(), **({"leaving": True, "away": away} if away else {})}

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
        from dilonode.algo.pacing import StepPacer, TimePacer
        from dilonode.train.data import load_data
        from dilonode.train.flops import flops_per_token, peak_flops
        from dilonode.train.worker import Worker

        self.data = load_data(self.cfg.data)
        assert self.collective is not None
        collective = ObservedCollective(self.collective, self.status,
                                        lambda: self.worker.step if self.worker else 0)
        timed = self.cfg.diloco.pacing == "time" and self.cfg.diloco.mode != "ddp"
        ranks, device = self._ranks()
        identity = ranks.handshake(self.worker_id or self.peer_id, device)
        self.status.devices = list(ranks.devices)
        pacer = TimePacer(swarm_time.now) if timed else StepPacer()
        self.worker = Worker(self.cfg, self.data, collective, identity=identity,
                             device=device, pacer=pacer, ranks=ranks)
        if self.cfg.paths.trace:
            self.worker.trace = []
        peaks = [peak_flops(str(d.get("name", "")), self.cfg.status.peak_tflops)
                 for d in self.status.devices]
        known = bool(peaks) and all(p is not None for p in peaks)
        self.status.set_speed(flops_per_token(self.worker.model, self.cfg.data.seq_len),
                              sum(p for p in peaks if p is not None) if known else None)

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
        for watcher in (self.supervisor, self.remerger, self.pacemaker):
            if watcher is not None:  # nothing restarts or re-times behind our back
                watcher.close()
        if self._hard_exit is not None:
            self._hard_exit.cancel()
        if self.keeper is not None and self.collective is not None:
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

        assert self.keeper is not None and self.collective is not None, "Node.start() first"
        keeper, thread = self.keeper, self.collective.thread
        steps = self.cfg.total_steps if total_steps == -1 else total_steps
        self._stop = stop  # the supervisor sets it when it gives up
        if self.failure is not None:
            stop.set()
        batches = self.data.eval_batches(self.cfg.data.seq_len, self.cfg.data.batch_size,
                                         self.cfg.data.eval_batches)
        self.status.total_steps = steps

        def hook(worker: Any, rep: Any) -> None:
            keeper.on_step(worker)
            keeper.resync_if_behind(worker, thread, self.dht)
            self.status.on_step(worker, rep)
            if on_step is not None:
                on_step(worker, rep)

        keeper.training(True)
        try:
            rep = train_loop(self.worker, steps, self.cfg.eval_every, batches, stop, hook,
                             leave_timeout=self.cfg.network.leave_timeout)
        finally:
            keeper.training(False)
        if steps is not None and not rep.stopped_early and self.worker.plan is not None:
            assert self.dht is not None and self.membership is not None
            end = EndOfRun(self.cfg, self.dht, self.membership, keeper, thread)
            self.verdict = end.agree(self.worker)
            self.status.set_agreement(self.verdict.as_dict())
            if self.verdict.adopted:  # the weights changed: evaluate what we hold now
                rep.eval_history[-1] = (self.worker.step, self.worker.evaluate(batches))
        keeper.finish(self.worker, abandoned=self.worker.stats.abandoned)
        self.status.set_state("stopped" if rep.stopped_early else "finished")
        return self._summary(rep)

    def _summary(self, rep: Any) -> NodeSummary:
        assert self.keeper is not None and self.collective is not None
        return NodeSummary.of_run(
            rep, self.worker, peer_id=self.peer_id,
            worker_id=str(self.worker_id or self.peer_id),
            flops_per_token=self.status.flops_per_token, peak_flops=self.status.peak_flops,
            peer_convictions=self.bans.rejections_total if self.bans else 0,
            peer_bans=self.bans.bans_total if self.bans else 0,
            agreement=self.verdict.as_dict() if self.verdict is not None else {},
            checkpoint_age_s=self.keeper.checkpointer.age_s(),
            devices=device_summary(self.status.devices), reachability=self.reachability,
            data_paths=data_paths(self.collective.plane.stats, self.tunnel))

    def save_outer(self, path: Path) -> None:
        """Write the outer weights (state dict) for comparisons and evaluation."""
        import torch

        torch.save(self.worker.outer_state_dict(), path)


class _PartsFacts:
    """What the node's status reads of its other parts (`status.snapshot.NodeFacts`), from
    the parts started so far: membership's last read (never a DHT call on a reader's
    thread), refusal counters, the keeper's checkpoints, the supervisor."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def peers_seen(self) -> int:
        m = self.node.membership
        return len(m.live_peers(max_age=math.inf)) if m is not None else 0

    def live_others(self) -> int:
        m, dht = self.node.membership, self.node.dht
        if m is None or dht is None:
            return 0
        me = dht.peer_id
        return sum(r.peer_id != me for r in m.live_peers(max_age=math.inf))

    def trust(self) -> dict[str, int]:
        # Data-plane and state-sync handshakes refused, in one counter.
        n = self.node
        return {"unauthorized_connections":
                (n.collective.unauthorized_attempts if n.collective else 0)
                + (n.keeper.unauthorized_attempts if n.keeper else 0),
                "unauthorized_records": n.dht.unauthorized_records if n.dht else 0,
                "rejected_contributions": n.bans.rejections_total if n.bans else 0,
                "peer_bans": n.bans.bans_total if n.bans else 0}

    def admission(self) -> dict[str, Any]:
        return self.node.admission.snapshot()

    def checkpoint_age(self) -> float | None:
        keeper = self.node.keeper
        return keeper.checkpointer.age_s() if keeper is not None else None

    def health(self) -> dict[str, Any] | None:
        sup = self.node.supervisor
        return sup.snapshot() if sup is not None else {}


def _round_policy(cfg: RunConfig) -> RoundPolicy:
    net = cfg.network
    return RoundPolicy(codec=cfg.codec.wire_name, block_size=cfg.codec.block_size,
                       chunk_numel=net.chunk_numel, timeout=net.allreduce_timeout,
                       max_attempts=net.max_attempts, aggregator=cfg.aggregator.spec(),
                       max_group_size=net.max_group_size, mix_every=net.mix_state_every)


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
