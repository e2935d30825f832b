"""Nodes of different rank counts in one swarm of real daemons (`dilonode run --nproc N`:
N processes over gloo on CPU per node, one peer to the swarm each). Hard timeouts."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytest.importorskip("hivemind")

from tests.support.config import LOOPBACK_NETWORK, merged, nano_config  # noqa: E402
from tests.support.swarm import SwarmEvents, assert_one_model, local_swarm, run_swarm  # noqa: E402

pytestmark = pytest.mark.slow

BASE = {
    "run_id": "multirank-test", "seed": 5, "eval_every": 6,
    # 6 sequences per node and step: split 6, 3+3 or 2+2+2 over its ranks.
    "data": {"batch_size": 6},
    "diloco": {"pacing": "steps"},
    "codec": {"name": "int4"},
    "network": LOOPBACK_NETWORK,
    "checkpoint": {"every_steps": 0, "on_exit": False},
}


def _cfg(tmp_path, **over):
    return nano_config(tmp_path, **merged(BASE, over))


@pytest.mark.timeout(480)
def test_nodes_of_one_two_and_three_ranks_end_with_identical_outer_weights(tmp_path):
    summaries = run_swarm(_cfg(tmp_path, total_steps=12), 3,
                          {1: ["--nproc", "2"], 2: ["--nproc", "3", "--set",
                                                    "dist.strategy=fsdp"]}).summaries
    assert sorted(summaries) == ["node-0", "node-1", "node-2"], summaries
    assert_one_model(summaries)
    for s in summaries.values():
        assert s["skipped_rounds"] == 0, s["dropped_peers"]
        assert s["rounds_with_peers"] == 8  # every round (2 + 1 end-of-run each but one)
    assert [summaries[f"node-{i}"]["devices"].split(" x ")[0] for i in range(3)] == \
        ["1", "2", "3"]


def _rank_pid(out_dir: Path, rank: int) -> int | None:
    """The pid of the rank `rank` process of the node writing to `out_dir`."""
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            cmdline = (env.parent / "cmdline").read_bytes().decode(errors="replace")
            variables = env.read_bytes().split(b"\0")
        except OSError:
            continue
        if str(out_dir) in cmdline and f"RANK={rank}".encode() in variables:
            return int(env.parent.name)
    return None


@pytest.mark.timeout(420)
def test_a_killed_rank_ends_its_node_and_the_swarm_goes_on(tmp_path):
    import os
    import signal

    # Rank 1 dies at step 8 or later; node-0 then runs its last rounds alone (each closes at
    # once once node-1 is known dead: `nobody_else` in swarm/matchmaking.py).
    cfg = _cfg(tmp_path, total_steps=20,
               network={"matchmaking_window": 4.0, "matchmaking_timeout": 10.0,
                        "allreduce_timeout": 8.0})
    with local_swarm(cfg, 2) as swarm:
        swarm.start_bootstrap()
        swarm.start_nodes({1: ["--nproc", "2"]})
        events = SwarmEvents(swarm)
        events.until(lambda: events.step("node-1") >= 8, 240, "node-1 at step 8")
        pid = _rank_pid(tmp_path / "node-1", 1)
        assert pid is not None, "no rank 1 process"
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        code = swarm.procs[1].wait(timeout=60)
        stopped_in = time.monotonic() - t0
        assert swarm.procs[0].wait(timeout=240) == 0
    assert code == 4, "the node must exit with 'a rank failed'"
    assert stopped_in < 30
    assert _rank_pid(tmp_path / "node-1", 0) is None  # no rank outlives its node
    summary = json.loads((tmp_path / "node-0" / "summary.json").read_text())
    assert summary["steps"] == 20 and not summary["stopped_early"]
