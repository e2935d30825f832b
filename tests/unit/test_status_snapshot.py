"""NodeStatus records a node's progress from the training thread and gives readers copies;
the swarm view keeps only what is safe of foreign summaries. No sockets, an injected clock."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from dilonode.collective import ReduceResult, RoundReport, RoundRequest, SyncKey
from dilonode.status.snapshot import NodeStatus, ObservedCollective, QuietFacts
from dilonode.status.swarm import SwarmView, node_rows
from dilonode.swarm.records import PeerRecord

PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Peers(QuietFacts):
    """A node that sees `n` live peers (itself included)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def peers_seen(self) -> int:
        return self.n


def _worker(step: int, tokens: int, sent: int, loss: float = 2.0) -> SimpleNamespace:
    stats = SimpleNamespace(tokens=tokens, last_loss=loss, bytes_sent=sent,
                            bytes_received=sent // 2)
    return SimpleNamespace(step=step, stats=stats)


def _report(evals: list[tuple[int, float]] | None = None) -> SimpleNamespace:
    return SimpleNamespace(eval_history=evals or [], compute_utilization=0.9, sync_wait_s=0.5)


def test_samples_at_most_every_interval_with_rates_from_deltas():
    clock = Clock()
    st = NodeStatus("run", 100, sample_every=1.0, clock=clock, facts=Peers(3))
    st.on_step(_worker(1, 100, 0), _report())
    clock.t += 0.5
    st.on_step(_worker(2, 200, 0), _report())  # too soon: no new point
    clock.t += 0.5
    st.on_step(_worker(3, 300, 1000), _report([(3, 2.5)]))
    hist = st.history()
    assert hist["t"] == [1000.0, 1001.0]
    assert hist["series"]["step"] == [1, 3]
    assert hist["series"]["tokens_per_s"][1] == 200.0  # (300 - 100) tokens / 1 s
    assert hist["series"]["sent_Bps"][1] == 1000.0
    assert hist["series"]["eval_loss"] == [None, 2.5]
    assert hist["series"]["peers"] == [3, 3]
    snap = st.snapshot()
    assert snap["step"] == 3 and snap["tokens"] == 300 and snap["eval_step"] == 3
    assert snap["state"] == "training" and snap["peers_seen"] == 3
    assert snap["uptime_s"] == 1.0


def test_mfu_is_the_share_of_the_peak_the_model_flops_reach():
    """200 tokens/s of 3e9 FLOPs each on a 1.2e12 FLOP/s peak: 0.5, in the snapshot, the
    history, the metrics and the published summary; unknown without a peak."""
    from dilonode.status.metrics import node_metrics, render

    clock = Clock()
    st = NodeStatus("run", 100, sample_every=1.0, clock=clock)
    st.on_step(_worker(1, 100, 0), _report())
    clock.t += 1.0
    st.on_step(_worker(2, 300, 0), _report())
    assert st.snapshot()["mfu"] is None  # no peak known
    st.set_speed(3e9, 1.2e12)
    clock.t += 1.0
    st.on_step(_worker(3, 500, 0), _report())
    snap = st.snapshot()
    assert snap["mfu"] == 0.5 and st.history()["series"]["mfu"][-1] == 0.5
    assert st.summary()["mfu"] == 0.5
    assert "dilonode_model_flops_utilization 0.5" in render(node_metrics(snap))


def test_history_is_a_bounded_ring():
    clock = Clock()
    st = NodeStatus("run", history=10, sample_every=1.0, clock=clock)
    for i in range(1, 26):
        clock.t += 1.0
        st.on_step(_worker(i, i * 10, 0), _report())
    hist = st.history()
    assert len(hist["t"]) == 10
    assert hist["series"]["step"] == list(range(16, 26))


def test_non_finite_loss_is_null_and_snapshot_is_strict_json():
    st = NodeStatus("run", clock=Clock())
    st.on_step(_worker(1, 10, 0, loss=float("nan")), _report([(1, float("inf"))]))
    snap = st.snapshot()
    assert snap["train_loss"] is None and snap["eval_loss"] is None
    json.dumps(snap, allow_nan=False)
    json.dumps(st.history(), allow_nan=False)


def test_observed_collective_records_each_landed_sync_once():
    result = ReduceResult(mean=torch.zeros(4),
                          report=RoundReport(group_size=3, payload_bytes_sent=40,
                                             payload_bytes_received=80,
                                             dropped=("QmBad: timeout",),
                                             members=("a", "b", "c"), attempts=2))

    class Pending:
        def done(self) -> bool:
            return True

        def wait(self, timeout=None):
            return result

    class Inner:
        def begin(self, request, flat, *, encoded=None, state=None):
            return Pending()

    st = NodeStatus("run", clock=Clock())
    coll = ObservedCollective(Inner(), st, step=lambda: 31)
    handle = coll.begin(RoundRequest(SyncKey("fragment", 1, 4)), torch.zeros(4))
    assert handle.wait() is result
    handle.wait()  # a second wait must not count the round twice
    coll.begin(RoundRequest(SyncKey("grad", 0, 7)), torch.zeros(4)).wait()
    snap = st.snapshot()
    assert [x["fragment"] for x in snap["syncs"]] == ["1", "grad"]
    frag = snap["syncs"][0]
    assert frag["rounds"] == 1
    assert frag["last"] == {"round": 4, "at_step": 31, "group_size": 3,
                            "peers": ["a", "b", "c"], "dropped": ["QmBad: timeout"],
                            "attempts": 2, "skipped": False, "bytes_sent": 40,
                            "bytes_received": 80}
    assert snap["retried_rounds"] == 2 and snap["skipped_rounds"] == 0


def _record(status: dict | None, step: int = 5) -> PeerRecord:
    return PeerRecord(peer_id=PEER, run_id="run", data_addr="127.0.0.1:9000",
                      bandwidth_mbps=100.0, step=step, status=status, expires_at=1010.0)


def test_swarm_rows_keep_only_scalars_and_drop_leaving_nodes():
    hostile = {"state": "training", "url": "x" * 1000, "train_loss": float("nan"),
               "tokens_per_s": 12.5, "eval_loss": {"nested": 1}, "bytes_sent": [1, 2]}
    rows = node_rows([_record(hostile), _record({"leaving": True})], now=1000.0)
    assert len(rows) == 1
    row = rows[0]
    assert row["peer_id"] == PEER and row["step"] == 5 and row["expires_in_s"] == 10.0
    assert row["state"] == "training" and len(row["url"]) == 200
    assert row["train_loss"] is None and row["tokens_per_s"] == 12.5
    assert "eval_loss" not in row and "bytes_sent" not in row


def test_swarm_view_aggregates_into_history():
    clock = Clock()
    view = SwarmView("QmBoot", "run", fetch=list, dht_time=clock, clock=clock)
    view.update([_record({"tokens_per_s": 100.0, "train_loss": 3.0, "sent_Bps": 10.0})])
    snap = view.snapshot()
    assert snap["kind"] == "swarm" and len(snap["nodes"]) == 1
    assert snap["tokens_per_s"] == 100.0
    hist = view.history()
    assert hist["series"]["peers"] == [1] and hist["series"]["train_loss"] == [3.0]
    json.dumps(snap, allow_nan=False)


def test_swarm_view_keeps_a_missed_record_until_it_expires():
    clock = Clock()
    view = SwarmView("QmBoot", "run", fetch=list, dht_time=clock, clock=clock)
    view.update([_record({"state": "training"}, step=5)])  # expires at 1010
    clock.t += 5.0
    view.update([])  # a read that missed the record
    assert [n["step"] for n in view.snapshot()["nodes"]] == [5]
    clock.t += 6.0  # past its expiry
    view.update([])
    assert view.snapshot()["nodes"] == []


def test_swarm_view_drops_a_node_that_leaves():
    clock = Clock()
    view = SwarmView("QmBoot", "run", fetch=list, dht_time=clock, clock=clock)
    view.update([_record({"state": "training"})])
    leaving = _record({"leaving": True}).model_copy(update={"expires_at": 1011.0})
    view.update([leaving])
    assert view.snapshot()["nodes"] == []
    assert view.history()["series"]["peers"] == [1, 0]
