"""Real nodes on loopback, each in its own process: DHT + data plane + trainer.

Slow by nature (a DHT per node); each test has a hard timeout.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("hivemind")

from dilonode.cli.local_swarm import GRACE_S, LocalSwarm  # noqa: E402
from dilonode.config import load_config  # noqa: E402
from dilonode.sim.training import simulate  # noqa: E402

pytestmark = pytest.mark.slow

BASE = {
    "run_id": "swarm-test", "seed": 5, "eval_every": 6, "device": "cpu",
    "model": {"preset": "nano"},
    "data": {"seq_len": 32, "batch_size": 4, "eval_batches": 2},
    "inner": {"lr": 3e-3, "warmup_steps": 0},
    # Paced by steps: every node syncs after exactly H own steps, the schedule the
    # lockstep simulator runs (test_hetero covers the swarm clock at unequal speeds).
    "diloco": {"mode": "streaming", "sync_every": 6, "num_fragments": 3,
               "fragment_sync_delay": 1, "fragment_update_alpha": 0.5, "pacing": "steps"},
    "codec": {"name": "float32"},
    "network": {"matchmaking_window": 20.0, "matchmaking_timeout": 40.0,
                "allreduce_timeout": 20.0, "max_attempts": 2},
}


def _cfg(tmp_path, **over):
    merged = {**BASE, **over, "paths": {"out_dir": str(tmp_path)}}
    return load_config(overrides=merged)


@pytest.mark.timeout(420)
def test_three_nodes_match_the_simulator(tmp_path):
    cfg = _cfg(tmp_path, total_steps=12)
    swarm = LocalSwarm(cfg, 3)
    try:
        swarm.start()
        summaries = swarm.follow()
    finally:
        swarm.stop()
    assert sorted(summaries) == ["node-0", "node-1", "node-2"], summaries
    assert len({s["outer_digest"] for s in summaries.values()}) == 1, "nodes disagree"
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


def _start_node(tmp_path, cfg_path, maddrs, i, *extra):
    log = (tmp_path / f"n{i}.log").open("w")
    return subprocess.Popen(
        [sys.executable, "-m", "dilonode.cli", "run", "--config", str(cfg_path),
         "--worker-id", str(i), "--out", str(tmp_path / f"node-{i}"), "--log-format", "json",
         "--initial-peers", *maddrs, *extra],
        stdout=subprocess.PIPE, stderr=log, text=True)


def _wait_for(proc, event, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        ev = json.loads(line)
        if ev.get("event") == event:
            return ev
    raise AssertionError(f"no {event!r} event within {timeout} s")


def _wait_no_process_with(text: str, deadline: float) -> None:
    """Wait until no process has `text` in its command line (its DHT child included)."""
    from pathlib import Path

    while True:
        left = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                if text in cmdline.read_bytes().decode(errors="replace"):
                    left.append(cmdline.parent.name)
            except OSError:
                continue
        if not left:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"processes {left} outlived a SIGKILLed node")
        time.sleep(0.1)


def _wait_for_log(path, text, timeout):
    """Wait until the log file at `path` holds `text` (a node's stderr)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.1)
    raise AssertionError(f"no {text!r} in {path} within {timeout} s")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("sig", "when"), [(signal.SIGTERM, "training"),
                                           (signal.SIGINT, "waiting for peers")])
def test_signal_stops_a_node_cleanly_within_seconds(tmp_path, sig, when):
    # A lone node: a short window keeps its rounds (each waits the whole window) quick.
    # "waiting for peers": it waits for a second peer that never comes (min_peers = 2);
    # a stop used to go unheard there until network.start_timeout ran out.
    network = {**BASE["network"], "matchmaking_window": 1.0}
    if when == "waiting for peers":
        network["min_peers"] = 2
    cfg = _cfg(tmp_path, total_steps=100000, network=network)
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(cfg.model_dump_json())
    swarm = LocalSwarm(cfg, 0)
    try:
        swarm.start_bootstrap()
        node = _start_node(tmp_path, cfg_path, swarm.maddrs, 0)
        if when == "training":
            _wait_for(node, "progress", 180)
        else:
            _wait_for_log(tmp_path / "n0.log", "waiting for network.min_peers = 2", 180)
        t0 = time.monotonic()
        node.send_signal(sig)
        summary = _wait_for(node, "summary", 30)
        assert node.wait(timeout=30) == 0
        assert time.monotonic() - t0 < 15, "node took too long to stop"
        assert summary["stopped_early"] is True
    finally:
        swarm.stop()


@pytest.mark.timeout(420)
def test_sigkilled_node_costs_the_others_at_most_a_timeout(tmp_path):
    cfg = _cfg(tmp_path, total_steps=30, network={**BASE["network"], "min_peers": 3,
                                                  "allreduce_timeout": 8.0,
                                                  "matchmaking_window": 4.0,
                                                  "matchmaking_timeout": 10.0})
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(cfg.model_dump_json())
    swarm = LocalSwarm(cfg, 0)
    try:
        swarm.start_bootstrap()
        nodes = [_start_node(tmp_path, cfg_path, swarm.maddrs, i) for i in range(3)]
        _wait_for(nodes[2], "progress", 240)  # all three are training
        nodes[2].kill()
        t0 = time.monotonic()
        _wait_no_process_with(str(tmp_path / "node-2"), deadline=time.monotonic() + 15)
        summaries = [_wait_for(n, "summary", 240) for n in nodes[:2]]
        elapsed = time.monotonic() - t0
        for n in nodes[:2]:
            assert n.wait(timeout=30) == 0
    finally:
        swarm.stop()
        for n in nodes:
            if n.poll() is None:
                n.kill()
    for s in summaries:
        assert s["steps"] == 30
    # survivors agree: after the kill they average among themselves, same outer weights
    assert summaries[0]["outer_digest"] == summaries[1]["outer_digest"]
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
        _wait_no_process_with(str(tmp_path / "swarm"), deadline=time.monotonic() + 20)
        _wait_no_process_with(run_id, deadline=time.monotonic() + 20)  # the bootstrap
    finally:
        if proc.poll() is None:
            proc.kill()
