"""What `dilonode run` reports while it trains: the JSON events it prints on stdout
(`started`, `recovered`, `progress`; `dilonode swarm` reads them) and the text of its live
progress line. Builds strings and dicts from the objects it is handed; imports nothing heavy.
"""

from __future__ import annotations

import json
from typing import Any

from dilonode.fmt import human_bytes, key_values

__all__ = ["progress_event", "progress_text", "recovered_event", "started_event",
           "summary_text"]


def started_event(node: Any) -> str:
    return json.dumps({"event": "started", "peer_id": node.peer_id,
                       "data_addr": node.collective.address,
                       "status_url": node.status_url or None})


def recovered_event(rec: Any) -> str:
    """How a joiner got the outer state (a `statesync` recovery)."""
    return json.dumps({"event": "recovered", "step": rec.state.step,
                       "bytes": rec.fetched_bytes, "reused_bytes": rec.reused_bytes,
                       "seconds": round(rec.seconds, 3),
                       "fetch_seconds": round(rec.fetch_seconds, 3),
                       "manifest_seconds": round(rec.manifest_seconds, 3),
                       "publish_wait_seconds": round(rec.publish_wait_seconds, 3),
                       "passes": rec.passes, "replayed": rec.replayed,
                       "peers": rec.sources})


def progress_event(worker: Any, rep: Any, snap: dict[str, Any]) -> str:
    """One `progress` event: the worker's counters, its report and the status snapshot."""
    return json.dumps({"event": "progress", "step": worker.step,
                       "progress": getattr(worker, "swarm_step", worker.step),
                       "tokens": rep.tokens,
                       "loss": round(worker.stats.last_loss, 4),
                       "eval_loss": round(rep.eval_history[-1][1], 4)
                       if rep.eval_history else None,
                       "bytes_sent": worker.stats.bytes_sent,
                       "rounds": {str(p): n for p, n in worker.stats.rounds.items()},
                       "tokens_per_s": snap["tokens_per_s"],
                       "utilization": round(rep.compute_utilization, 4)})


def progress_text(worker: Any, snap: dict[str, Any]) -> str:
    """The live line: step, losses, throughput, bytes sent, peers, compute share."""
    total = f"/{snap['total_steps']}" if snap["total_steps"] else ""
    eval_loss = "-" if snap["eval_loss"] is None else format(snap["eval_loss"], ".3f")
    swarm = getattr(worker, "swarm_step", worker.step)
    where = (f"step {worker.step}{total}" if swarm == worker.step
             else f"swarm step {swarm}{total} (own {worker.step})")
    return (f"{where} | loss {worker.stats.last_loss:.3f} | eval "
            f"{eval_loss} | {snap['tokens_per_s'] or 0:,.0f} tok/s | sent "
            f"{human_bytes(snap['bytes_sent'])} | peers {snap['peers_seen']} | compute "
            f"{100 * snap['compute_utilization']:.0f}%")


def summary_text(summary: dict[str, Any]) -> str:
    """The `summary` event as aligned `key  value` lines (what a terminal gets at the end)."""
    return key_values([(k, f"{v:.4g}" if isinstance(v, float) else str(v))
                       for k, v in summary.items() if k != "event"], indent="  ")
