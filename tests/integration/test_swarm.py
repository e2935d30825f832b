"""Real nodes on loopback, each in its own process: DHT + data plane + trainer.

Slow by nature (a DHT per node); each test has a hard timeout.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("hivemind")

from dilonode.cli.local_swarm import GRACE_S  # noqa: E402
from dilonode.sim.training import simulate  # noqa: E402
from tests.support.config import LOOPBACK_NETWORK, merged, nano_config  # noqa: E402
from tests.support.swarm import assert_one_model, nodes_by_hand, run_swarm  # noqa: E402
from tests.support.waiting import wait_until  # noqa: E402

pytestmark = pytest.mark.slow

BASE = {
    "run_id": "swarm-test", "seed": 5, "eval_every": 6,
    # Paced by steps: every node syncs after exactly H own steps, the schedule the
    # lockstep simulator runs (test_hetero covers the swarm clock at unequal speeds).
    "diloco": {"pacing": "steps"},
    "codec": {"name": "float32"},
    "network": LOOPBACK_NETWORK,
}


def _cfg(tmp_path, **over):
    return nano_config(tmp_path, **merged(BASE, over))


@pytest.mark.timeout(420)
def test_three_nodes_match_the_simulator(tmp_path):
    cfg = _cfg(tmp_path, total_steps=12)
    summaries = run_swarm(cfg, 3).summaries
    assert sorted(summaries) == ["node-0", "node-1", "node-2"], summaries
    assert_one_model(summaries)
    for s in summaries.values():
        assert s["skipped_rounds"] == 0, s["dropped_peers"]
        # 2 rounds each in 12 steps, plus the end-of-run round of fragments 0 and 1 (whose
        # last rounds started at steps 8 and 10; fragment 2's started at 12).
        assert s["rounds_per_fragment"] == {"0": 3, "1": 3, "2": 2}
    # every node holds the same outer weights, equal to the simulator's run of this config
    states = [torch.load(tmp_path / f"node-{i}" / "outer.pt") for i in range(3)]
    captured = {}
    simulate(cfg.model_copy(update={"sim": cfg.sim.model_copy(update={"workers": 3})}),
             on_step=lambda step, ws: captured.update(state=ws[0].outer_model().state_dict())
             if step == cfg.total_steps else None)
    for state in states:
        for name, ref in captured["state"].items():
            torch.testing.assert_close(state[name], ref, atol=1e-5, rtol=0, msg=name)


def _processes_with(text: str) -> list[str]:
    """The pids of the processes with `text` in their command line."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().decode(errors="replace"):
                found.append(cmdline.parent.name)
        except OSError:
            continue
    return found


def _wait_no_process_with(text: str, timeout: float) -> None:
    """Wait until no process has `text` in its command line (its DHT child included)."""
    wait_until(lambda: not _processes_with(text), timeout,
               what=f"every process with {text!r} in its command line to exit")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("sig", "when"), [(signal.SIGTERM, "training"),
                                           (signal.SIGINT, "waiting for peers")])
def test_signal_stops_a_node_cleanly_within_seconds(tmp_path, sig, when):
    # A lone node: a short window keeps its rounds (each waits the whole window) quick.
    # "waiting for peers": it waits for a second peer that never comes (min_peers = 2);
    # a stop must be heard there, not only once network.start_timeout runs out.
    network = {"matchmaking_window": 1.0}
    if when == "waiting for peers":
        network["min_peers"] = 2
    cfg = _cfg(tmp_path, total_steps=100000, network=network)
    with nodes_by_hand(cfg) as swarm:
        node = swarm.start(0)
        if when == "training":
            node.wait_for("progress", 180)
        else:
            waiting = "waiting for network.min_peers = 2"
            wait_until(lambda: waiting in node.log.read_text(errors="replace"), 180,
                       what=f"{waiting!r} in {node.log}")
        t0 = time.monotonic()
        node.proc.send_signal(sig)
        summary = node.wait_for("summary", 30)
        assert node.proc.wait(timeout=30) == 0
        assert time.monotonic() - t0 < 15, "node took too long to stop"
        assert summary["stopped_early"] is True


@pytest.mark.timeout(420)
def test_sigkilled_node_costs_the_others_at_most_a_timeout(tmp_path):
    cfg = _cfg(tmp_path, total_steps=30, network={"min_peers": 3, "allreduce_timeout": 8.0,
                                                  "matchmaking_window": 4.0,
                                                  "matchmaking_timeout": 10.0})
    with nodes_by_hand(cfg) as swarm:
        nodes = [swarm.start(i) for i in range(3)]
        nodes[2].wait_for("progress", 240)  # all three are training
        nodes[2].proc.kill()
        t0 = time.monotonic()
        _wait_no_process_with(str(tmp_path / "node-2"), 15)
        summaries = [n.wait_for("summary", 240) for n in nodes[:2]]
        elapsed = time.monotonic() - t0
        for n in nodes[:2]:
            assert n.proc.wait(timeout=30) == 0
    for s in summaries:
        assert s["steps"] == 30
    # survivors agree: after the kill they average among themselves, same outer weights
    assert_one_model(summaries)
    assert elapsed < 200


@pytest.mark.timeout(300)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_local_swarm_stops_every_child(tmp_path, signum):
    cfg_path = tmp_path / "cfg.json"
    run_id = f"swarm-signal-{signum}-{time.time_ns()}"
    cfg_path.write_text(_cfg(tmp_path, total_steps=100_000, run_id=run_id).model_dump_json())
    # start_new_session: like a background job, and the signal reaches the parent alone
    proc = subprocess.Popen(
        [sys.executable, "-m", "dilonode.cli", "swarm", "--nodes", "2", "--config",
         str(cfg_path), "--out", str(tmp_path / "swarm")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "the swarm ended before its nodes started"
            if "node-1: peer" in line or "node-0: peer" in line:
                break
        proc.send_signal(signum)
        t0 = time.monotonic()
        # Every node stops cleanly (exit 0, a summary each), none has to be SIGKILLed after
        # the grace: the other node is at most waiting for its peers (a node announces it
        # started only once it sees them), which a stop ends at once.
        assert proc.wait(timeout=60) == 0
        assert time.monotonic() - t0 < GRACE_S, "a node needed the SIGKILL after the grace"
        # bootstrap, nodes and their DHT children: all gone
        _wait_no_process_with(str(tmp_path / "swarm"), 20)
        _wait_no_process_with(run_id, 20)  # the bootstrap
    finally:
        if proc.poll() is None:
            proc.kill()
