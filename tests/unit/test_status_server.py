"""The status endpoint over real HTTP on 127.0.0.1: read-only routes, 405/404, JSON that is
strict, metrics that a Prometheus parser accepts, and a dashboard with no external resources."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dilonode.status.metrics import Metric, node_metrics, render, swarm_metrics
from dilonode.status.server import StatusServer
from dilonode.status.snapshot import NodeStatus, QuietFacts
from tests.unit.test_status_snapshot import Clock, Peers, _record, _report, _worker

TIMEOUT = aiohttp.ClientTimeout(total=10)


class CountingSource:
    """A NodeStatus that counts reads, to show which requests reached it."""

    def __init__(self) -> None:
        self.status = NodeStatus("run-1", 50, clock=Clock(), facts=Peers(2))
        self.status.peer_id, self.status.worker_id = "QmPeer", "0"
        self.status.on_step(_worker(7, 700, 4096, loss=2.25), _report([(5, 2.5)]))
        self.reads = 0

    def snapshot(self):
        self.reads += 1
        return self.status.snapshot()

    def history(self):
        self.reads += 1
        return self.status.history()


async def _with_server(source, fn, metrics=node_metrics):
    server = StatusServer(source, metrics, host="127.0.0.1", port=0)
    url = await asyncio.wait_for(server.start(), 10)
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            return await fn(http, url)
    finally:
        await asyncio.wait_for(server.aclose(), 10)


def run(source, fn, metrics=node_metrics):
    return asyncio.run(_with_server(source, fn, metrics))


def test_get_status_and_history_return_strict_json():
    async def fn(http, url):
        async with http.get(url + "/status") as r:
            assert r.status == 200 and r.content_type == "application/json"
            assert r.headers["Cache-Control"] == "no-store"
            status = json.loads(await r.text())  # json.loads accepts NaN; check below
        async with http.get(url + "/history") as r:
            history = await r.json()
        return status, history

    status, history = run(CountingSource(), fn)
    assert status["kind"] == "node" and status["peer_id"] == "QmPeer"
    assert status["step"] == 7 and status["eval_loss"] == 2.5 and status["peers_seen"] == 2
    assert history["series"]["step"] == [7]
    assert "NaN" not in json.dumps(status) and "Infinity" not in json.dumps(history)


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
def test_other_methods_get_405_and_touch_nothing(method):
    source = CountingSource()

    async def fn(http, url):
        codes = []
        for path in ("/", "/status", "/history", "/metrics"):
            async with http.request(method, url + path, data=b'{"step": 0}') as r:
                codes.append((r.status, r.headers.get("Allow")))
        return codes

    codes = run(source, fn)
    assert all(code == 405 for code, _ in codes), codes
    assert all(set(allow.replace(" ", "").split(",")) == {"GET", "HEAD"} for _, allow in codes)
    assert source.reads == 0  # no handler ran
    assert source.status.snapshot()["step"] == 7


def test_head_is_allowed_without_body_and_unknown_paths_are_404():
    async def fn(http, url):
        async with http.head(url + "/status") as r:
            head = (r.status, await r.read())
        async with http.get(url + "/nope") as r:
            missing = r.status
        async with http.get(url + "/status/../etc/passwd") as r:
            traversal = r.status
        return head, missing, traversal

    (code, body), missing, traversal = run(CountingSource(), fn)
    assert code == 200 and body == b""
    assert missing == 404 and traversal == 404


def test_metrics_parse_as_prometheus_text():
    async def fn(http, url):
        async with http.get(url + "/metrics") as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            return await r.text()

    text = run(CountingSource(), fn)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    # the parser strips _total from counter family names
    assert families["dilonode_tokens"].type == "counter"
    assert families["dilonode_tokens"].samples[0].value == 700
    assert families["dilonode_step"].samples[0].value == 7
    assert families["dilonode_sent_bytes"].samples[0].value == 4096
    assert families["dilonode_eval_loss"].samples[0].value == 2.5
    assert families["dilonode_info"].samples[0].labels["run_id"] == "run-1"
    for name in families:
        assert f"# HELP {name}" in text and f"# TYPE {name}" in text


def test_render_escapes_labels_and_skips_empty_families():
    text = render([Metric("m", "help with \\ and\nnewline", "gauge",
                          [({"l": 'a"b\\c\nd'}, 1.5)]),
                   Metric("empty", "no samples", "gauge", [])])
    families = list(text_string_to_metric_families(text))
    assert [f.name for f in families] == ["m"]
    assert families[0].samples[0].labels["l"] == 'a"b\\c\nd'
    assert families[0].documentation == "help with \\ and\nnewline"


def test_swarm_metrics_label_each_node():
    clock = Clock()
    from dilonode.status.swarm import SwarmView

    view = SwarmView("QmBoot", "run", fetch=list, dht_time=clock, clock=clock)
    view.update([_record({"tokens_per_s": 50.0, "eval_loss": 3.5}, step=9)])
    families = {f.name: f for f in text_string_to_metric_families(
        render(swarm_metrics(view.snapshot())))}
    assert families["dilonode_swarm_nodes"].samples[0].value == 1
    sample = families["dilonode_swarm_node_step"].samples[0]
    assert sample.value == 9 and sample.labels["peer_id"].startswith("Qm")


def test_dashboard_is_self_contained():
    async def fn(http, url):
        async with http.get(url + "/") as r:
            assert r.status == 200 and r.content_type == "text/html"
            return r.headers["Content-Security-Policy"], await r.text()

    csp, html = run(CountingSource(), fn)
    assert "default-src 'self'" in csp
    assert "<canvas" in html or "createElement(\"canvas\"" in html
    # no external scripts, styles, fonts or fetches: every URL in the page is relative
    assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//", html)
    assert not re.search(r"fetch\(\s*[\"']https?://", html)
    assert "fetch(" in html and '"status"' in html and '"history"' in html


def test_a_taken_port_is_a_one_line_error():
    async def main():
        first = StatusServer(CountingSource(), node_metrics, port=0)
        await first.start()
        try:
            second = StatusServer(CountingSource(), node_metrics, port=first.port)
            with pytest.raises(ValueError, match=rf"cannot listen on 127.0.0.1:{first.port} "):
                await second.start()
        finally:
            await first.aclose()

    asyncio.run(asyncio.wait_for(main(), 20))


def test_trust_counters_are_exported():
    class Trust(QuietFacts):
        def trust(self) -> dict[str, int]:
            return {"unauthorized_connections": 3, "unauthorized_records": 2,
                    "rejected_contributions": 5, "peer_bans": 1}

    status = NodeStatus("run-1", facts=Trust())
    text = render(node_metrics(status.snapshot()))
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["dilonode_unauthorized_connections"].samples[0].value == 3
    assert families["dilonode_unauthorized_records"].samples[0].value == 2
    assert families["dilonode_rejected_contributions"].samples[0].value == 5
    assert families["dilonode_peer_bans"].samples[0].value == 1
    # a node without those counters (no trust provider) exports none of them
    plain = render(node_metrics(NodeStatus("run-1").snapshot()))
    assert "unauthorized" not in plain
