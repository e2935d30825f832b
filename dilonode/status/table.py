"""The terminal side of the status endpoint: fetch `/status` and print it as tables.

Used by `dilonode status [URL]`; standard library only (plus `dilonode.fmt`), so the
command starts instantly and works against any node or bootstrap peer it can reach.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from dilonode.fmt import grid, human_bytes, key_values

__all__ = ["fetch_status", "format_node", "format_status", "format_swarm"]


def fetch_status(url: str, timeout: float = 5.0) -> dict[str, Any]:
    """GET `<url>/status`; ValueError with one line when it cannot be had or is not ours."""
    base = url if "://" in url else f"http://{url}"
    target = base.rstrip("/") + "/status"
    try:
        with urllib.request.urlopen(target, timeout=timeout) as resp:
            data = json.loads(resp.read().decode())
    except urllib.error.HTTPError as exc:
        raise ValueError(f"{target}: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ValueError(f"{target}: cannot connect ({reason})") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError(f"{target}: the answer is not JSON (is this a dilonode status "
                         "endpoint?)") from None
    if not isinstance(data, dict) or data.get("kind") not in ("node", "swarm"):
        raise ValueError(f"{target}: not a dilonode status document")
    return data


def _num(x: Any, fmt: str = "{:.4f}") -> str:
    return "-" if x is None else fmt.format(x)


def _result(last: dict[str, Any]) -> str:
    # A group of one that is not "skipped" formed with nobody else: nothing was averaged.
    return "skipped" if last["skipped"] else "alone" if last["group_size"] <= 1 else "averaged"


def format_node(s: dict[str, Any]) -> str:
    """A training node: identity and progress, then one row per fragment's last sync."""
    step = f"{s['step']}" + (f" / {s['total_steps']}" if s.get("total_steps") else "")
    pairs = [
        ("node", f"{s['peer_id']} (worker {s['worker_id']})"),
        ("devices", str(s.get("device_summary") or "-")),
        ("run", f"{s['run_id']}  version {s['version']}  protocol {s['protocol_version']}"),
        ("state", f"{s['state']}  up {s['uptime_s']:.0f} s"),
        ("step", step),
        ("loss", f"train {_num(s['train_loss'])}  eval {_num(s['eval_loss'])}"),
        ("throughput", f"{_num(s['tokens_per_s'], '{:,.0f}')} tokens/s  "
                       f"({s['tokens']:,} tokens)"),
        ("traffic", f"sent {human_bytes(s['bytes_sent'])}  "
                    f"received {human_bytes(s['bytes_received'])}"),
        ("compute", f"{100 * s['compute_utilization']:.1f} %"),
        ("peers seen", str(s["peers_seen"])),
        ("rounds", f"skipped {s['skipped_rounds']}  retried {s['retried_rounds']}"),
        *_alerts(s),
    ]
    if (agreement := s.get("agreement")) is not None:
        pairs.append(("end of run", agreement["line"]))
    text = key_values(pairs)
    rows = [[x["fragment"], str(x["rounds"]), str(x["last"]["round"]),
             str(x["last"]["at_step"]), str(x["last"]["group_size"]),
             str(x["last"]["attempts"]), _result(x["last"]),
             "; ".join(x["last"]["dropped"]) or "-"] for x in s["syncs"]]
    head = ["fragment", "rounds", "last round", "at step", "group", "attempts", "result",
            "dropped"]
    return text + "\n\n" + (grid(head, rows) if rows else "no sync has landed yet")


def _alerts(s: dict[str, Any]) -> list[tuple[str, str]]:
    """Lines an operator must see: rounds alone while peers are live, parts down."""
    out = []
    if (warning := (s.get("alone") or {}).get("warning")) is not None:
        out.append(("WARNING", warning))
    sup = s.get("supervision") or {}
    for name, part in sorted((sup.get("parts") or {}).items()):
        if part["state"] != "ok":
            out.append(("DOWN", f"{name} for {part['down_s']} s: {part['reason']}"))
    if sup.get("failure"):
        out.append(("GIVING UP", sup["failure"]))
    return out


def format_swarm(s: dict[str, Any]) -> str:
    """A bootstrap peer: one row per node that published a record."""
    title = (f"swarm {s['run_id']}: {len(s['nodes'])} node(s), "
             f"{_num(s['tokens_per_s'], '{:,.0f}')} tokens/s in all  "
             f"(bootstrap {s['peer_id']}, up {s['uptime_s']:.0f} s)")
    if s.get("error"):
        title += f"\nlast DHT read failed: {s['error']}"
    if s.get("agreement"):
        title += f"\nagreement: {s['agreement']['line']}"
    rows = [[n["peer_id"][:16] + "…", str(n.get("worker_id") or "-"), str(n.get("state") or "-"),
             str(n["step"]), _num(n.get("train_loss")), _num(n.get("eval_loss")),
             _num(n.get("tokens_per_s"), "{:,.0f}"),
             human_bytes(n["bytes_sent"]) if n.get("bytes_sent") is not None else "-",
             str(n.get("url") or "-")] for n in s["nodes"]]
    head = ["node", "worker", "state", "step", "train loss", "eval loss", "tokens/s", "sent",
            "dashboard"]
    return title + "\n\n" + (grid(head, rows) if rows else "no node has published a record")


def format_status(s: dict[str, Any]) -> str:
    return format_swarm(s) if s["kind"] == "swarm" else format_node(s)
