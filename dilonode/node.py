"""Composition root of a training node: DHT, data plane, trainer and heartbeat wired together.

`Node(cfg, worker_id=...)` does no I/O. `start()` joins the DHT (hivemind, in its own
process; started first because it forks), brings up the all-reduce data plane on a background
event loop, publishes this node's peer record (`Membership`) and waits for
`network.min_peers`. `run(stop)`
trains on the calling thread until `total_steps` or until `stop` is set, then lands in-flight
syncs. `close()` withdraws the peer record and shuts everything down within seconds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dilonode.allreduce.driver import FormedGroup, NetworkCollective, RoundPolicy
from dilonode.config import RunConfig
from dilonode.swarm.dht import SwarmDHT
from dilonode.swarm.membership import Membership

__all__ = ["Node", "NodeSummary", "summary_json"]

log = logging.getLogger(__name__)


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
    compute_utilization: float = 0.0
    wall_s: float = 0.0
    outer_digest: str = ""
    stopped_early: bool = False


class Node:
    """One training node; see the module docstring for its life cycle."""

    def __init__(self, cfg: RunConfig, worker_id: str | None = None) -> None:
        self.cfg = cfg
        self.worker_id = worker_id
        self.dht: SwarmDHT | None = None
        self.collective: NetworkCollective | None = None
        self.worker: Any = None
        self.membership: Membership | None = None

    # -- life cycle ------------------------------------------------------------------------
    def start(self) -> None:
        net = self.cfg.network
        self.dht = SwarmDHT(self.cfg.run_id, list(net.initial_peers), net.identity_path,
                            net.host, net.dht_port).start()
        policy = RoundPolicy(codec=self.cfg.codec.name, block_size=self.cfg.codec.block_size,
                             chunk_numel=net.chunk_numel, timeout=net.allreduce_timeout,
                             max_attempts=net.max_attempts)
        self.collective = NetworkCollective(self.dht.peer_id, self.cfg.run_id, self._form,
                                            policy, host=net.host, port=net.port)
        address = self.collective.start()
        if net.announce_host:
            address = f"{net.announce_host}:{address.rsplit(':', 1)[1]}"
        self.membership = Membership(self.dht, self.cfg.run_id, net, address, self._status)
        self.membership.start()
        self.membership.wait_for_peers(net.min_peers, net.start_timeout)
        self._build_worker()
        log.info("node %s up: data %s, maddrs %s", self.peer_id, self.collective.address,
                 self.dht.visible_maddrs())

    async def _form(self, fragment: int, round_no: int, attempt: int,
                    exclude: set[str]) -> FormedGroup:
        # The collective is created before membership (membership needs its address).
        assert self.membership is not None
        return await self.membership.form(fragment, round_no, attempt, exclude)

    def _status(self) -> dict[str, Any]:
        w = self.worker
        return {"step": w.step if w is not None else 0, "worker": self.worker_id}

    @property
    def peer_id(self) -> str:
        assert self.dht is not None, "Node.start() first"
        return self.dht.peer_id

    def _build_worker(self) -> None:
        # Built after the DHT has forked, so its process does not carry a copy of the model.
        from dilonode.train.data import load_data
        from dilonode.train.worker import Worker

        self.data = load_data(self.cfg.data)
        assert self.collective is not None
        self.worker = Worker(self.cfg, self.data, self.collective,
                             identity=self.worker_id or self.peer_id)

    def close(self) -> None:
        """Withdraw the peer record, stop the data plane and the DHT (idempotent)."""
        if self.membership is not None:
            self.membership.close()
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
        batches = self.data.eval_batches(self.cfg.data.seq_len, self.cfg.data.batch_size,
                                         self.cfg.data.eval_batches)
        rep = train_loop(self.worker, steps, self.cfg.eval_every, batches, stop, on_step)
        return self._summary(rep)

    def _summary(self, rep: Any) -> NodeSummary:
        st = self.worker.stats
        flat = self.worker.outer_flat().contiguous().numpy().tobytes()
        return NodeSummary(
            peer_id=self.peer_id, worker_id=str(self.worker_id or self.peer_id),
            steps=rep.steps, tokens=rep.tokens, final_eval_loss=rep.eval_history[-1][1],
            bytes_sent=st.bytes_sent, bytes_received=st.bytes_received,
            rounds_per_fragment=dict(sorted(st.rounds.items())), skipped_rounds=st.skipped,
            retried_rounds=st.retried,
            dropped_peers=list(st.dropped), compute_utilization=rep.compute_utilization,
            wall_s=rep.wall_s, outer_digest=hashlib.sha256(flat).hexdigest(),
            stopped_early=rep.stopped_early)

    def save_outer(self, path: Path) -> None:
        """Write the outer weights (state dict) for comparisons and evaluation."""
        import torch

        torch.save(self.worker.outer_model().state_dict(), path)


def summary_json(summary: NodeSummary) -> str:
    return json.dumps({"event": "summary", **asdict(summary)})
