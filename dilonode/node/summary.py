"""The run summary a node prints and writes as JSON when it stops (`NodeSummary`), and how
it is made from what the run left: the train loop's report, the worker's counters, the
end-of-run verdict, and how the data plane reached its peers."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from dilonode.status.snapshot import mfu

__all__ = ["NodeSummary", "data_paths", "summary_json"]


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
    # Share of wall time not blocked on the network: on round results (`sync_wait_s`) or
    # fetching the swarm's state between steps to catch up (`catch_up_s`).
    compute_utilization: float = 0.0
    step_share: float = 0.0  # share of wall time inside train_step alone
    sync_wait_s: float = 0.0
    catch_up_s: float = 0.0
    wall_s: float = 0.0
    outer_digest: str = ""
    stopped_early: bool = False
    # fragment (-1: DDP gradients) -> rounds, mean and max seconds from start to result,
    # and the mean of those seconds spent forming groups (matchmaking; the rest: transfer)
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
    # Training throughput over the training steps' wall time (`LoopReport.train_s`), and
    # its model FLOPs utilization against the devices' peak (None when the peak is unknown).
    tokens_per_s: float = 0.0
    mfu: float | None = None
    train_s: float = 0.0
    # Where train_s went (`LoopReport.phases`: train_step, starting rounds, applying results,
    # waiting, the per-step hook; CPU of the training thread and of the other threads).
    phases: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of_run(cls, rep: Any, worker: Any, *, peer_id: str, worker_id: str,
               flops_per_token: float = 0.0, peak_flops: float | None = None,
               **node: Any) -> NodeSummary:
        """The summary of a run: `rep` the train loop's report, `worker` the trained
        `Worker`; `node` the fields only the node knows (agreement, bans, checkpoint age,
        devices, reachability, data paths); MFU from `flops_per_token` and `peak_flops`."""
        st = worker.stats
        tokens_per_s = rep.tokens / rep.train_s if rep.train_s > 0 else 0.0
        share = mfu(tokens_per_s, flops_per_token, peak_flops)
        return cls(
            peer_id=peer_id, worker_id=worker_id,
            steps=rep.steps, tokens=rep.tokens, final_eval_loss=rep.eval_history[-1][1],
            bytes_sent=st.bytes_sent, bytes_received=st.bytes_received,
            rounds_per_fragment=dict(sorted(st.rounds.items())), skipped_rounds=st.skipped,
            retried_rounds=st.retried,
            dropped_peers=list(st.dropped), compute_utilization=rep.compute_utilization,
            step_share=rep.step_share, sync_wait_s=rep.sync_wait_s,
            catch_up_s=round(rep.catch_up_s, 3),
            wall_s=rep.wall_s, outer_digest=worker.outer_digest(),
            stopped_early=rep.stopped_early,
            round_latency_s={p: {"n": n, "mean": total / n, "max": worst,
                                 "forming_mean": st.forming.get(p, 0.0) / n}
                             for p, (n, total, worst) in sorted(st.latency.items())},
            rounds_with_peers=st.grouped, missed_rounds=st.missed,
            late_rounds=st.late, diverged_rounds=st.diverged,
            grouped=worker.grouped, largest_group=st.largest_group,
            tokens_per_s=round(tokens_per_s, 1), train_s=round(rep.train_s, 3),
            phases={k: round(v, 4) for k, v in getattr(rep, "phases", {}).items()},
            mfu=None if share is None else round(share, 4), **node)


def summary_json(summary: NodeSummary) -> str:
    return json.dumps({"event": "summary", **asdict(summary)})


def data_paths(plane_stats: dict[str, int], tunnel: Any = None) -> dict[str, int]:
    """How the data plane reached its peers, from its counters (`DataPlane.stats`) and the
    libp2p tunnel's (`swarm.tunnel.Tunnel`, None without one)."""
    out = {k: plane_stats.get(k, 0) for k in ("connections_out", "fallback_connections",
                                              "fallback_accepts", "direct_failures")}
    relayed = tunnel.stats if tunnel is not None else {}
    relay = tunnel.relay.stats if tunnel is not None and tunnel.relay else {}
    return {"direct_out": out["connections_out"] - out["fallback_connections"],
            "stream_out": out["fallback_connections"],
            "stream_in": out["fallback_accepts"],
            "direct_failures": out["direct_failures"],
            "relayed_out": relayed.get("relayed_out", 0),
            "relayed_for_others": relay.get("relayed", 0)}
