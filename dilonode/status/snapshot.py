"""`NodeStatus`: what a training node is doing, recorded from the training thread and read as
JSON-ready snapshots by the status server, the DHT heartbeat and the CLI.

The training thread calls `on_step(worker, report)` after every step (`dilonode.node.daemon`
hooks it into the train loop) and every landed sync passes through `ObservedCollective`,
which records the group that averaged it. Readers on other threads call `snapshot()`,
`history()` and `summary()`; each takes the lock only long enough to copy plain values, so
a reader never stalls training and never sees a half-updated step. Nothing here does I/O.

What the status reads of the node's other parts (peers seen, refusals, admission counters,
the newest checkpoint's age, the supervisor's view of its parts) comes from one `NodeFacts`
provider; `QuietFacts` is a node with nothing to tell. An `AloneWatch` (status/isolation.py)
sees every landed round with the number of other live peers; it and the supervisor's view
show in `snapshot()` as `alone` and `supervision`.

The history is a ring buffer of samples taken at most every `sample_every` seconds (not every
step: a fast model would fill it in seconds), columnar so the dashboard can draw it directly.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from dilonode import PROTOCOL_VERSION, __version__
from dilonode.status.isolation import AloneWatch

if TYPE_CHECKING:  # type names only: readers (the CLI, the bootstrap) need no torch
    import torch

    from dilonode.collective import (
        Collective,
        PendingReduce,
        ReduceResult,
        RoundRequest,
        SplicedEncoding,
        StateSource,
        SyncKey,
    )

__all__ = ["HISTORY_SERIES", "NodeFacts", "NodeStatus", "ObservedCollective", "QuietFacts",
           "device_summary", "finite_or_none", "mfu", "p90", "state_chain"]

# Columns of `history()["series"]`, drawn by the dashboard (same names for the swarm view).
HISTORY_SERIES = ("step", "train_loss", "eval_loss", "tokens_per_s", "sent_Bps", "recv_Bps",
                  "peers", "mfu")


def finite_or_none(x: float | None, digits: int = 6) -> float | None:
    """JSON has no NaN/Inf: missing or non-finite figures become null."""
    if x is None or not math.isfinite(x):
        return None
    return round(float(x), digits)


class NodeFacts(Protocol):
    """What a node's status reads from the node's other parts when it samples or is read,
    on the caller's thread: every call returns at once (no DHT call, no I/O)."""

    def peers_seen(self) -> int:
        """Peers with a live record in membership's last read, this node included."""
        ...

    def live_others(self) -> int:
        """Other peers with a live record (what an isolated node is alone among)."""
        ...

    def trust(self) -> dict[str, int]:
        """Counters of refused peers, records and contributions."""
        ...

    def admission(self) -> dict[str, Any]:
        """Refused and closed connections per port and reason (`net.admission`)."""
        ...

    def checkpoint_age(self) -> float | None:
        """Seconds since the newest good checkpoint, None without one."""
        ...

    def health(self) -> dict[str, Any] | None:
        """The supervisor's view of the node's parts; None: not supervised (no
        "supervision" in the snapshot)."""
        ...


class QuietFacts:
    """`NodeFacts` of a node with nothing to tell: no peers, nothing refused, no
    checkpoint, not supervised. Tests and tools override what they need."""

    def peers_seen(self) -> int:
        return 0

    def live_others(self) -> int:
        return max(self.peers_seen() - 1, 0)

    def trust(self) -> dict[str, int]:
        return {}

    def admission(self) -> dict[str, Any]:
        return {}

    def checkpoint_age(self) -> float | None:
        return None

    def health(self) -> dict[str, Any] | None:
        return None


@dataclass(frozen=True)
class _SyncRecord:
    """How one landed sync went, as the status page shows it."""

    round: int
    at_step: int
    group_size: int
    peers: tuple[str, ...]
    dropped: tuple[str, ...]
    attempts: int
    skipped: bool
    bytes_sent: int
    bytes_received: int


class NodeStatus:
    """Thread-safe record of one node's progress; see the module docstring."""

    def __init__(self, run_id: str, total_steps: int | None = None, *, history: int = 600,
                 sample_every: float = 1.0, facts: NodeFacts | None = None,
                 clock: Callable[[], float] = time.time,
                 alone: AloneWatch | None = None) -> None:
        self.run_id = run_id
        self.total_steps = total_steps
        self.peer_id = ""
        self.worker_id = ""
        self.url = ""
        self.state = "starting"
        # The node's devices, one per rank (dilonode/train/ranks/node_ranks.py: kind, name, memory).
        self.devices: list[dict[str, Any]] = []
        self.sample_every = sample_every
        self._facts: NodeFacts = facts if facts is not None else QuietFacts()
        self._clock = clock
        self.alone = alone  # rounds alone while peers are live (None: not watched)
        self._lock = threading.Lock()
        self._started = clock()
        self._cur: dict[str, Any] = {"step": 0, "tokens": 0, "train_loss": None,
                                     "eval_loss": None, "eval_step": None, "bytes_sent": 0,
                                     "bytes_received": 0, "compute_utilization": 0.0,
                                     "sync_wait_s": 0.0, "swarm_step": 0, "state_chain": "",
                                     "agreement": None, "round_p90_s": None,
                                     "pace_s": None}
        # Rates need two samples; None (null) until then rather than a misleading 0.
        self._rates: dict[str, float | None] = {"tokens_per_s": None, "sent_Bps": None,
                                                "recv_Bps": None, "mfu": None}
        # Model FLOPs of one trained token and the node's peak FLOP/s, for MFU (`set_speed`).
        self.flops_per_token = 0.0
        self.peak_flops: float | None = None
        self._last_sample: tuple[float, int, int, int] | None = None  # t, tokens, sent, recv
        self._hist_t: deque[float] = deque(maxlen=history)
        self._hist: dict[str, deque[float | None]] = {
            name: deque(maxlen=history) for name in HISTORY_SERIES}
        self._syncs: dict[str, _SyncRecord] = {}
        self._rounds: dict[str, int] = {}
        self._skipped = self._retried = 0

    # -- writers (training thread) ---------------------------------------------------------
    def on_step(self, worker: Any, report: Any) -> None:
        """Record the step `worker` just finished; `report` is the loop's `LoopReport`."""
        st = worker.stats
        evals = report.eval_history
        with self._lock:
            self.state = "training"
            self._cur.update(
                step=worker.step, tokens=st.tokens, train_loss=finite_or_none(st.last_loss),
                bytes_sent=st.bytes_sent, bytes_received=st.bytes_received,
                compute_utilization=round(report.compute_utilization, 4),
                sync_wait_s=round(report.sync_wait_s, 3))
            if evals:
                self._cur.update(eval_step=evals[-1][0], eval_loss=finite_or_none(evals[-1][1]))
            if getattr(worker, "plan", None) is not None:
                pace = getattr(worker.pacer, "pace_s", None)  # TimePacer: s per own step
                self._cur.update(swarm_step=worker.swarm_step, state_chain=state_chain(worker),
                                 round_p90_s=p90(list(st.recent_latency)),
                                 pace_s=round(pace, 5) if pace else None)
            self._maybe_sample()

    def set_agreement(self, verdict: dict[str, Any]) -> None:
        """The end-of-run check's outcome (`swarm.agreement.Verdict.as_dict`)."""
        with self._lock:
            self._cur["agreement"] = {"agrees": verdict.get("agrees"),
                                      "digest": str(verdict.get("digest", ""))[:16],
                                      "line": str(verdict.get("line", ""))[:300]}

    def on_sync(self, key: SyncKey, result: ReduceResult, step: int) -> None:
        """Record a landed sync (called by `ObservedCollective`)."""
        label = str(key.fragment) if key.kind == "fragment" else "grad"
        rep = result.report
        rec = _SyncRecord(round=key.round, at_step=step, group_size=rep.group_size,
                          peers=rep.members, dropped=rep.dropped, attempts=rep.attempts,
                          skipped=rep.skipped, bytes_sent=rep.payload_bytes_sent,
                          bytes_received=rep.payload_bytes_received)
        with self._lock:
            self._syncs[label] = rec
            self._rounds[label] = self._rounds.get(label, 0) + 1
            self._skipped += int(rep.skipped)
            self._retried += int(rep.attempts > 1)
        if self.alone is not None:
            self.alone.on_round(rep.group_size, self._facts.live_others())

    def set_speed(self, flops_per_token: float, peak_flops: float | None) -> None:
        """What MFU is computed from: the model's FLOPs per trained token and the node's
        peak FLOP/s (all its devices; None: unknown, no MFU)."""
        with self._lock:
            self.flops_per_token, self.peak_flops = flops_per_token, peak_flops

    def set_state(self, state: str) -> None:
        with self._lock:
            self.state = state

    def _maybe_sample(self) -> None:
        """Append a history point if `sample_every` has passed (lock held)."""
        now, cur = self._clock(), self._cur
        last = self._last_sample
        if last is not None and now - last[0] < self.sample_every:
            return
        if last is not None:
            dt = max(now - last[0], 1e-9)
            tokens_per_s = (cur["tokens"] - last[1]) / dt
            share = mfu(tokens_per_s, self.flops_per_token, self.peak_flops)
            self._rates = {"tokens_per_s": round(tokens_per_s, 1),
                           "sent_Bps": round((cur["bytes_sent"] - last[2]) / dt, 1),
                           "recv_Bps": round((cur["bytes_received"] - last[3]) / dt, 1),
                           "mfu": None if share is None else round(share, 4)}
        self._last_sample = (now, cur["tokens"], cur["bytes_sent"], cur["bytes_received"])
        row = {**cur, **self._rates, "peers": self._facts.peers_seen()}
        self._hist_t.append(round(now, 3))
        for name, col in self._hist.items():
            col.append(row[name])

    # -- readers (any thread) --------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Everything the status page shows, as plain JSON-ready values."""
        facts = self._facts
        peers, trust, admission = facts.peers_seen(), facts.trust(), facts.admission()
        ckpt_age = finite_or_none(facts.checkpoint_age(), 1)
        health = facts.health()
        with self._lock:
            syncs = dict(self._syncs)
            rounds = dict(self._rounds)
            out = {
                "kind": "node", "peer_id": self.peer_id, "worker_id": self.worker_id,
                "run_id": self.run_id, "version": __version__,
                "protocol_version": PROTOCOL_VERSION, "state": self.state, "url": self.url,
                "started_at": round(self._started, 3),
                "uptime_s": round(self._clock() - self._started, 1),
                "total_steps": self.total_steps, **self._cur, **self._rates,
                "peers_seen": peers, "skipped_rounds": self._skipped,
                "retried_rounds": self._retried, "trust": trust,
                "admission": admission, "checkpoint_age_s": ckpt_age,
                "devices": [dict(d) for d in self.devices],
                "device_summary": device_summary(self.devices),
            }
        out["syncs"] = [{"fragment": label, "rounds": rounds[label],
                         "last": {"round": r.round, "at_step": r.at_step,
                                  "group_size": r.group_size, "peers": list(r.peers),
                                  "dropped": list(r.dropped), "attempts": r.attempts,
                                  "skipped": r.skipped, "bytes_sent": r.bytes_sent,
                                  "bytes_received": r.bytes_received}}
                        for label, r in sorted(syncs.items(), key=lambda kv: _label_order(kv[0]))]
        if self.alone is not None:
            out["alone"] = self.alone.snapshot()
        if health is not None:
            out["supervision"] = health
        return out

    def history(self) -> dict[str, Any]:
        """The ring buffer: sample times (unix seconds) and one column per series."""
        with self._lock:
            return {"t": list(self._hist_t),
                    "series": {name: list(col) for name, col in self._hist.items()}}

    def summary(self) -> dict[str, Any]:
        """The small summary a node publishes with its peer record (the bootstrap's view)."""
        s = self.snapshot()
        keys = ("worker_id", "state", "url", "step", "total_steps", "tokens", "train_loss",
                "eval_loss", "tokens_per_s", "sent_Bps", "recv_Bps", "bytes_sent",
                "bytes_received", "compute_utilization", "peers_seen", "skipped_rounds",
                "uptime_s", "version", "swarm_step", "state_chain", "round_p90_s",
                "pace_s", "device_summary", "mfu")
        agreement = s.get("agreement") or {}
        return {**{k: s[k] for k in keys}, "agrees": agreement.get("agrees"),
                "final_digest": agreement.get("digest")}


def mfu(tokens_per_s: float, flops_per_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilization: the share of `peak` FLOP/s that `tokens_per_s` tokens of
    `flops_per_token` each reach (None without a peak or a rate)."""
    if peak is None or peak <= 0 or tokens_per_s <= 0:
        return None
    return tokens_per_s * flops_per_token / peak


def p90(values: list[float]) -> float | None:
    """The 90th percentile (nearest rank) of `values`, None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 3)


def device_summary(devices: list[dict[str, Any]]) -> str:
    """'4 x cuda NVIDIA H100 80GB HBM3 (79.1 GiB each)': the node's devices in one line
    (mixed kinds or sizes are listed one group each, ' + '-joined; '' when unknown)."""
    groups: dict[tuple[str, str, int], int] = {}
    for d in devices:
        key = (str(d.get("kind", "?")), str(d.get("name", "")), int(d.get("memory_bytes", 0)))
        groups[key] = groups.get(key, 0) + 1
    return " + ".join(f"{n} x {kind}{' ' + name if name else ''} ({mem / 2**30:.1f} GiB each)"
                      for (kind, name, mem), n in groups.items())


def state_chain(worker: Any) -> str:
    """Per fragment, '<rounds landed>:<first 12 hex of its chain>', ';'-joined: what the
    swarm view compares (nodes that landed the same rounds must hold the same chains).
    Empty in a grouped swarm, whose replicas differ between groups by design (algo/
    groups.py): the view then compares the final weights only."""
    if getattr(worker, "grouped", False):
        return ""
    return ";".join(f"{f.landed()}:{f.chain[:12]}" for f in worker.frags)


def _label_order(label: str) -> tuple[int, int]:
    return (1, 0) if not label.isdigit() else (0, int(label))


class _ObservedPending:
    """A `PendingReduce` that reports its result to a `NodeStatus` once, when it lands."""

    def __init__(self, inner: PendingReduce, key: SyncKey, status: NodeStatus,
                 step: Callable[[], int]) -> None:
        self._inner, self._key, self._status, self._step = inner, key, status, step
        self._seen = False

    def done(self) -> bool:
        return self._inner.done()

    def wait(self, timeout: float | None = None) -> ReduceResult:
        result = self._inner.wait(timeout)
        if not self._seen:
            self._seen = True
            self._status.on_sync(self._key, result, self._step())
        return result


class ObservedCollective:
    """Wraps a `Collective` so every landed sync is recorded in a `NodeStatus`.

    `step` returns the trainer's current step (the step a result landed at).
    """

    def __init__(self, inner: Collective, status: NodeStatus, step: Callable[[], int]) -> None:
        self.inner, self.status, self.step = inner, status, step

    def begin(self, request: RoundRequest, flat: torch.Tensor, *,
              encoded: SplicedEncoding | None = None,
              state: StateSource | None = None) -> PendingReduce:
        """The inner collective's `begin`, everything passed on as given."""
        pending = self.inner.begin(request, flat, encoded=encoded, state=state)
        return _ObservedPending(pending, request.key, self.status, self.step)
