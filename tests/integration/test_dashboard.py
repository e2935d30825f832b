"""A small live swarm (bootstrap + 2 nodes on 127.0.0.1): the dashboard draws real data in
headless Chromium, /metrics moves as training goes on, and the bootstrap shows every node.

Needs Debian's `chromium` (`make test` installs it when run as root: .ci/system-deps). To
keep the screenshot it takes:
    DILONODE_DASHBOARD_PNG=/tmp/dash.png .venv/bin/pytest -q tests/integration/test_dashboard.py
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("hivemind")

from dilonode.cli.local_swarm import LocalSwarm  # noqa: E402
from tests.support.config import nano_config  # noqa: E402
from tests.support.swarm import SwarmEvents  # noqa: E402

pytestmark = pytest.mark.slow

CONFIG = {
    "run_id": "dash-test", "seed": 1, "eval_every": 5, "total_steps": 100000,
    "data": {"eval_batches": 1},
    # Paced by steps: the test reads the dashboard while rounds land every few steps of a
    # tiny model (the swarm clock would make a reference step as short as one of them).
    "diloco": {"pacing": "steps"},
    "codec": {"name": "int8"},
    # A CPU has no entry in the peak table: a stated peak gives the MFU chart its data.
    "status": {"peak_tflops": 0.01},
    "network": {"matchmaking_window": 4.0, "matchmaking_timeout": 20.0,
                "allreduce_timeout": 20.0, "max_attempts": 2},
}
POINTS = 5  # history points the charts must show


def chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        if path := shutil.which(name):
            return path
    pytest.fail("chromium is not installed: the dashboard test needs Debian's package "
                "(`sudo apt-get install -y chromium`; `make test` installs it as root)")


def browse(url: str, tmp: Path, *args: str) -> str:
    """Load `url` in headless Chromium, let its scripts run 8 s of virtual time."""
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu",
           "--disable-background-networking", "--no-first-run", "--hide-scrollbars",
           f"--user-data-dir={tmp / 'chromium-profile'}", "--virtual-time-budget=8000",
           "--window-size=1280,900", *args, url]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def scrape(url: str) -> dict[str, float]:
    families = text_string_to_metric_families(get(url + "/metrics"))
    return {s.name: s.value for f in families for s in f.samples if not s.labels}


# The first series of each dashboard chart (dashboard.html's CHARTS): what it counts as
# drawn points. Rates have no value at the first sample, so counting samples is not enough.
CHART_FIRST_SERIES = ("train_loss", "tokens_per_s", "mfu", "sent_Bps", "peers")


def charted(history: dict) -> int:
    """The fewest finite values among the charts' first series: the points the page draws."""
    return min(sum(v is not None for v in history["series"][key])
               for key in CHART_FIRST_SERIES)


def line_pixels(png: Path) -> int:
    """Pixels of the charts' first-series colour (#5aa9e6) in a screenshot."""
    import matplotlib.image

    img = matplotlib.image.imread(png)[..., :3]  # [H, W, 3] floats in 0..1
    target = [0x5A / 255, 0xA9 / 255, 0xE6 / 255]
    return int((abs(img - target).max(axis=-1) < 0.03).sum())


@pytest.mark.timeout(420)
def test_live_swarm_dashboard_metrics_and_swarm_view(tmp_path):
    chromium()  # fail fast, before starting a swarm, when it is missing
    cfg = nano_config(tmp_path, **CONFIG)
    swarm = LocalSwarm(cfg, 2, forever=True)
    events = SwarmEvents(swarm)
    try:
        swarm.start()
        assert swarm.status_url and swarm.status_url.startswith("http://127.0.0.1:")
        urls = {}
        while len(urls) < 2:
            name, ev = events.next(lambda n, e: e.get("event") == "started", 240, "started")
            urls[name] = ev["status_url"]
        node0 = urls["node-0"]
        assert (tmp_path / "node-0" / "status.url").read_text().strip() == node0

        # /metrics moves as training goes on
        first = scrape(node0)
        events.progress("node-0")
        events.progress("node-0")
        second = scrape(node0)
        for name in ("dilonode_step", "dilonode_tokens_total", "dilonode_sent_bytes_total",
                     "dilonode_uptime_seconds"):
            assert second[name] > first[name], (name, first, second)
        tokens_per_step = cfg.data.seq_len * cfg.data.batch_size
        assert second["dilonode_tokens_total"] == second["dilonode_step"] * tokens_per_step

        # the dashboard draws the history in a real browser
        events.until_progress(lambda: charted(json.loads(get(node0 + "/history"))) >= POINTS,
                     "node-0", 120, f"{POINTS} history points in every chart")
        dom = browse(node0 + "/", tmp_path, "--dump-dom")
        body = re.search(r"<body[^>]*>", dom)
        assert body, dom[:500]
        drawn = int(re.search(r'data-points="(\d+)"', body.group(0)).group(1))
        assert drawn >= POINTS, body.group(0)
        assert json.loads(get(node0 + "/status"))["peer_id"] in dom
        shot = tmp_path / "dashboard.png"
        browse(node0 + "/", tmp_path, f"--screenshot={shot}")
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert line_pixels(shot) > 500, "no chart lines in the screenshot"
        if target := os.environ.get("DILONODE_DASHBOARD_PNG"):
            shutil.copyfile(shot, target)

        # the bootstrap shows both nodes, in JSON, in the terminal and in the browser
        seen: list[dict] = []

        def both_training():
            seen.append(json.loads(get(swarm.status_url + "/status")))
            nodes = seen[-1]["nodes"]
            return len(nodes) == 2 and all(n["step"] > 0 for n in nodes) and nodes
        try:
            nodes = events.until_progress(both_training, "node-0", 90,
                                          "both nodes in the swarm view")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last views: {seen[-3:]}") from None
        assert {n["url"] for n in nodes} == set(urls.values())
        proc = subprocess.run([sys.executable, "-m", "dilonode.cli", "status",
                               swarm.status_url], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert "swarm dash-test: 2 node(s)" in proc.stdout
        assert all(u in proc.stdout for u in urls.values())
        swarm_dom = browse(swarm.status_url + "/", tmp_path, "--dump-dom")
        assert all(n["peer_id"][:16] in swarm_dom for n in nodes)
    finally:
        swarm.stop()
