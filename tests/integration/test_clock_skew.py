"""Hosts whose clocks are wrong train as if they agreed: a bootstrap and four nodes, three
of them under libfaketime +30 s, -30 s and +10 min, end with one model after averaging in
every round; a host 2 hours off (past `network.max_clock_offset`) stops at once with one
line naming the offset it measured, exit status 2, no traceback.

libfaketime shifts the wall clock only (FAKETIME_DONT_FAKE_MONOTONIC=1), as a host without
NTP has it. Its 0.9.10 (Debian's) then fails clock_nanosleep(CLOCK_MONOTONIC,
TIMER_ABSTIME) with EINVAL, which is Python's `time.sleep`: the skewed processes run the
CLI with `time.sleep` routed through `select` (the same wait), nothing else changed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from dilonode.cli.local_swarm import LocalSwarm
from dilonode.config import load_config

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("faketime") is None,
                                 reason="needs libfaketime (apt-get install faketime)")]

SKEW = {"node-1": "+30s", "node-2": "-30s", "node-3": "+600s"}
_SHIM = ("import select, sys, time; "
         "time.sleep = lambda s: select.select([], [], [], max(s, 0.0)); "
         "sys.argv[0] = 'dilonode'; from dilonode.cli.main import entry; entry()")


def skewed(offset: str, cli_args: list[str]) -> list[str]:
    """`dilonode <cli_args>` on a host whose wall clock is `offset` off."""
    return ["env", "FAKETIME_DONT_FAKE_MONOTONIC=1", "faketime", "-f", offset,
            sys.executable, "-c", _SHIM, *cli_args]


class _SkewedHosts:
    def wrap(self, name: str, argv: list[str]) -> list[str]:
        if name not in SKEW:
            return argv
        assert argv[1:3] == ["-m", "dilonode.cli"], argv
        return skewed(SKEW[name], argv[3:])

    def addr(self, name: str) -> str:
        return "127.0.0.1"


@pytest.mark.timeout(600)
def test_nodes_minutes_apart_train_one_model_and_an_hours_off_one_stops(tmp_path):
    cfg = load_config(overrides={
        "run_id": "clock-skew", "total_steps": 24, "eval_every": 12, "device": "cpu",
        "model": {"preset": "nano"}, "data": {"seq_len": 32, "batch_size": 4,
                                              "eval_batches": 2},
        "diloco": {"mode": "streaming", "sync_every": 6, "num_fragments": 3,
                   "step_seconds": 0.5},
        "network": {"matchmaking_window": 3.0, "matchmaking_timeout": 30.0},
        "paths": {"out_dir": str(tmp_path)}})
    swarm = LocalSwarm(cfg, 4, placement=_SkewedHosts())
    try:
        swarm.start()
        refused = subprocess.run(
            skewed("+7200s", ["run", "--config", str(swarm.cfg_path), "--initial-peers",
                              *swarm.maddrs, "--out", str(tmp_path / "far"), "--steps", "1"]),
            capture_output=True, text=True, timeout=120)
        summaries = swarm.follow()
    finally:
        swarm.stop()
    assert refused.returncode == 2, refused.stderr[-2000:]
    last = refused.stderr.strip().splitlines()[-1]
    # Read off hivemind's refusal of our first ping: the time its answer took is in it.
    far = re.match(r"dilonode: this host's clock is ([+-]\d+\.\d) s off", last)
    assert far and abs(float(far.group(1)) - 7200) < 1.0 and "max_clock_offset" in last, last
    assert "Traceback" not in refused.stderr
    assert len(summaries) == 4, swarm.postmortem({f"node-{i}" for i in range(4)} - set(summaries))
    digests = {s["outer_digest"] for s in summaries.values()}
    assert len(digests) == 1 and all(s["agreement"]["agrees"] for s in summaries.values())
    # Every node averaged with others in every round (3 fragments x 4 rounds and the
    # end-of-run round of each), none alone.
    assert all(s["rounds_with_peers"] >= 12 for s in summaries.values()), \
        {n: s["rounds_with_peers"] for n, s in summaries.items()}
    # The measured offset is exact to within half the shortest ping's round trip, which
    # the suite's own load stretches to tens of milliseconds.
    for name, offset in SKEW.items():
        log = (tmp_path / name / "stderr.log").read_text()
        found = re.findall(r"this host's clock is ([+-]\d+\.\d+) s off", log)
        assert len(found) == 1, (name, [line for line in log.splitlines() if "clock" in line])
        assert abs(float(found[0]) - int(offset.rstrip("s"))) < 0.25, (name, found[0])
