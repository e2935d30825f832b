"""Prometheus text exposition (format 0.0.4) of a node's or a swarm's snapshot.

`node_metrics(snapshot)` and `swarm_metrics(snapshot)` turn the JSON snapshots of
`dilonode.status.snapshot.NodeStatus` and `dilonode.status.swarm.SwarmView` into `Metric`s;
`render(metrics)` writes them with HELP and TYPE lines. Pure functions, no I/O; missing
figures (no eval yet) are left out rather than exported as NaN.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["CONTENT_TYPE", "Metric", "admission_metrics", "node_metrics", "render",
           "swarm_metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Metric:
    """One metric family: name, help, type and (labels, value) samples."""

    name: str
    help: str
    type: Literal["counter", "gauge"]
    samples: list[tuple[Mapping[str, str], float]] = field(default_factory=list)


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(int(value)) if float(value).is_integer() and abs(value) < 2**53 else repr(value)


def render(metrics: Iterable[Metric]) -> str:
    """The text format: `# HELP`, `# TYPE`, then one line per sample; ends with a newline."""
    lines = []
    for m in metrics:
        if not m.samples:
            continue
        lines.append(f"# HELP {m.name} {_escape_help(m.help)}")
        lines.append(f"# TYPE {m.name} {m.type}")
        for labels, value in m.samples:
            tag = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels.items())
            lines.append(f"{m.name}{{{tag}}} {_number(value)}" if tag
                         else f"{m.name} {_number(value)}")
    return "\n".join(lines) + "\n"


def _gauge(name: str, help: str, value: Any, **labels: str) -> Metric:
    samples = [] if value is None else [(labels, float(value))]
    return Metric(name, help, "gauge", samples)


def _counter(name: str, help: str, value: Any) -> Metric:
    return Metric(name, help, "counter", [] if value is None else [({}, float(value))])


def node_metrics(s: Mapping[str, Any]) -> list[Metric]:
    """Metrics of one training node from `NodeStatus.snapshot()`."""
    rounds = Metric("dilonode_sync_rounds_total", "Landed syncs per fragment ('grad': DDP).",
                    "counter", [({"fragment": x["fragment"]}, float(x["rounds"]))
                                for x in s["syncs"]])
    group = Metric("dilonode_sync_group_size", "Members of the fragment's last sync group.",
                   "gauge", [({"fragment": x["fragment"]}, float(x["last"]["group_size"]))
                             for x in s["syncs"]])
    info = {"peer_id": s["peer_id"], "run_id": s["run_id"], "version": s["version"],
            "protocol": str(s["protocol_version"])}
    return [
        Metric("dilonode_info", "Constant 1, labelled with the node's identity.", "gauge",
               [(info, 1.0)]),
        _gauge("dilonode_uptime_seconds", "Seconds since the node started.", s["uptime_s"]),
        _gauge("dilonode_step", "Inner steps done.", s["step"]),
        _counter("dilonode_tokens_total", "Training tokens consumed.", s["tokens"]),
        _gauge("dilonode_tokens_per_second", "Recent training throughput.", s["tokens_per_s"]),
        _gauge("dilonode_model_flops_utilization", "Share of the devices' peak FLOP/s the "
               "model's FLOPs reach (unset without a known peak).", s.get("mfu")),
        _gauge("dilonode_train_loss", "Loss of the last inner step.", s["train_loss"]),
        _gauge("dilonode_eval_loss", "Held-out loss of the outer weights.", s["eval_loss"]),
        _counter("dilonode_sent_bytes_total", "All-reduce payload bytes sent.", s["bytes_sent"]),
        _counter("dilonode_received_bytes_total", "All-reduce payload bytes received.",
                 s["bytes_received"]),
        _gauge("dilonode_compute_utilization", "Share of wall time spent computing.",
               s["compute_utilization"]),
        _gauge("dilonode_peers_seen", "Live peer records in the last DHT read.",
               s["peers_seen"]),
        rounds, group,
        _counter("dilonode_sync_skipped_total", "Rounds where every attempt failed.",
                 s["skipped_rounds"]),
        _counter("dilonode_sync_retried_total", "Rounds that needed more than one attempt.",
                 s["retried_rounds"]),
        *(_counter(f"dilonode_{name}_total", help, s.get("trust", {}).get(name))
          for name, help in _TRUST_COUNTERS),
        _gauge("dilonode_checkpoint_age_seconds", "Age of the newest good checkpoint.",
               s.get("checkpoint_age_s")),
        _gauge("dilonode_devices", "Devices (ranks) this node trains on.",
               len(s.get("devices") or []) or None),
        *admission_metrics(s.get("admission") or {}),
    ]


def admission_metrics(a: Mapping[str, Any]) -> list[Metric]:
    """Connections refused and closed per port and reason, connections held, and the
    peer-caused log lines (`dilonode.net.admission.Admission.snapshot()`)."""
    ports: Mapping[str, Any] = a.get("ports", {})

    def by_reason(kind: str) -> list[tuple[Mapping[str, str], float]]:
        return [({"port": port, "reason": reason}, float(n))
                for port, g in ports.items() for reason, n in g[kind].items()]

    def per_port(key: str) -> list[tuple[Mapping[str, str], float]]:
        return [({"port": port}, float(g[key])) for port, g in ports.items()]

    plog = a.get("log", {})
    return [
        Metric("dilonode_connections_refused_total", "Incoming connections refused before "
               "anything was read, by port and reason.", "counter", by_reason("refused")),
        Metric("dilonode_connections_closed_total", "Incoming connections we closed, by port "
               "and reason.", "counter", by_reason("closed")),
        Metric("dilonode_connections_open", "Incoming connections held, by port.", "gauge",
               per_port("open")),
        Metric("dilonode_connections_pending", "Incoming connections still in their "
               "handshake (status port: all), by port.", "gauge", per_port("pending")),
        _counter("dilonode_peer_log_lines_total", "Log lines written about what peers did.",
                 plog.get("lines")),
        _counter("dilonode_peer_log_folded_total", "Peer-caused events counted in a summary "
                 "line instead of a line of their own.", plog.get("folded")),
        _counter("dilonode_peer_log_truncated_total", "Peer-derived texts cut to fit a log "
                 "line.", plog.get("truncated")),
    ]


_TRUST_COUNTERS = (
    ("unauthorized_connections", "Data and state-sync connections refused in the handshake "
     "or for a bad frame MAC."),
    ("unauthorized_records", "DHT records ignored: bad signature or identity not allowed."),
    ("rejected_contributions", "Rounds in which a peer's contribution was rejected."),
    ("peer_bans", "Peers banned for repeated rejected contributions."),
)


def swarm_metrics(s: Mapping[str, Any]) -> list[Metric]:
    """Metrics of a bootstrap peer's swarm view from `SwarmView.snapshot()`."""
    def per_node(key: str) -> list[tuple[Mapping[str, str], float]]:
        return [({"peer_id": n["peer_id"]}, float(n[key])) for n in s["nodes"]
                if n.get(key) is not None]

    return [
        Metric("dilonode_info", "Constant 1, labelled with the bootstrap's identity.", "gauge",
               [({"peer_id": s["peer_id"], "run_id": s["run_id"], "version": s["version"],
                  "role": "bootstrap"}, 1.0)]),
        _gauge("dilonode_uptime_seconds", "Seconds since the bootstrap started.", s["uptime_s"]),
        _gauge("dilonode_swarm_nodes", "Nodes with a live peer record.", len(s["nodes"])),
        Metric("dilonode_swarm_node_step", "Inner step each node last published.", "gauge",
               per_node("step")),
        Metric("dilonode_swarm_node_tokens_per_second", "Throughput each node last published.",
               "gauge", per_node("tokens_per_s")),
        Metric("dilonode_swarm_node_eval_loss", "Eval loss each node last published.", "gauge",
               per_node("eval_loss")),
    ]
