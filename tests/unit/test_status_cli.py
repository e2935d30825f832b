"""`dilonode status [URL]`: tables for a node and for a bootstrap's swarm view, one-line
errors, and no torch/hivemind import (it must start instantly)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dilonode.net.loop_thread import LoopThread
from dilonode.status.metrics import node_metrics, swarm_metrics
from dilonode.status.server import StatusServer
from dilonode.status.swarm import SwarmView
from dilonode.status.table import format_node
from tests.unit.test_status_server import CountingSource
from tests.unit.test_status_snapshot import Clock, _record


@pytest.fixture
def serve():
    thread = LoopThread("test-status", use_uvloop=False)
    thread.start()
    servers = []

    def start(source, metrics):
        server = StatusServer(source, metrics, port=0)
        servers.append(server)
        return thread.run(server.start(), timeout=10)

    yield start
    for server in servers:
        thread.run(server.aclose(), timeout=10)
    thread.stop()


def cli(*args: str, code: str = "") -> subprocess.CompletedProcess:
    # Runs the CLI in a fresh interpreter and then checks what it imported.
    prog = ("import sys\nfrom dilonode.cli import main as cli\nrc = cli.main(sys.argv[1:])\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "assert 'hivemind' not in sys.modules, 'hivemind imported'\n"
            "sys.exit(rc)\n")
    return subprocess.run([sys.executable, "-c", prog, *args], capture_output=True, text=True,
                          timeout=60)


def test_node_table_without_heavy_imports(serve):
    source = CountingSource()
    url = serve(source, node_metrics)
    proc = cli("status", url)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "QmPeer (worker 0)" in out
    assert "7 / 50" in out
    assert "train 2.2500  eval 2.5000" in out
    assert "4.1 KB" in out  # bytes sent
    assert "no sync has landed yet" in out


def test_swarm_table(serve):
    clock = Clock()
    view = SwarmView("QmBoot", "run", fetch=list, dht_time=clock, clock=clock)
    view.update([_record({"worker_id": "3", "state": "training", "tokens_per_s": 1234.0,
                          "eval_loss": 3.25, "url": "http://127.0.0.1:1234"}, step=42)])
    url = serve(view, swarm_metrics)
    proc = cli("status", url.removeprefix("http://"))  # scheme optional
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("swarm run: 1 node(s), 1,234 tokens/s in all")
    row = next(line for line in lines if line.startswith("QmYyQSo1c1Ym7orW"))
    assert row.split()[1:4] == ["3", "training", "42"]
    assert "3.2500" in row and "http://127.0.0.1:1234" in row


def test_sync_rows_in_node_table():
    snap = CountingSource().snapshot()
    snap["syncs"] = [{"fragment": "0", "rounds": 3, "last": {
        "round": 2, "at_step": 61, "group_size": 2, "peers": ["a", "b"],
        "dropped": ["QmX: timed out"], "attempts": 2, "skipped": False, "bytes_sent": 1,
        "bytes_received": 1}}]
    lines = format_node(snap).splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("fragment"))
    assert lines[head + 2].split()[:7] == ["0", "3", "2", "61", "2", "2", "averaged"]
    assert lines[head + 2].endswith("QmX: timed out")


def test_errors_are_one_line_exit_2(tmp_path):
    proc = cli("status", "http://127.0.0.1:9", "--timeout", "2")
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "http://127.0.0.1:9/status: cannot connect" in proc.stderr
    proc = cli("status", "--out", str(tmp_path))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "status.url does not exist" in proc.stderr


def test_url_from_out_dir_and_raw_json(serve, tmp_path):
    url = serve(CountingSource(), node_metrics)
    (tmp_path / "status.url").write_text(url + "\n")
    proc = cli("status", "--out", str(tmp_path), "--json")
    assert proc.returncode == 0, proc.stderr
    assert '"peer_id": "QmPeer"' in proc.stdout


@pytest.mark.parametrize("flag, value, message", [
    ("--status-port", "70000", "--status-port = 70000: must be 0..65535"),
    ("--status-refresh", "0", "--status-refresh = 0.0: must be > 0 seconds"),
])
def test_bootstrap_refuses_bad_status_flags_before_starting(flag, value, message):
    proc = cli("bootstrap", flag, value)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"dilonode: {message}"
