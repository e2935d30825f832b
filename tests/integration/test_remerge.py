"""After a 2|2 network partition heals, the two halves of the swarm's DHT find each other
again (`swarm/remerge.py`): on the WAN test bed, a bootstrap and four DHT-only nodes; hosts
node-2 and node-3 are cut off from the bootstrap and node-0/node-1 until each side sees only
its own half, then the cut is removed and every node must see all four records within a
bound. Needs root (network namespaces, iptables); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy.testbed import Testbed, unavailable_reason

REASON = unavailable_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or "")]
ROOT = Path(__file__).parents[2]
RUN = "remerge-test"
TTL_S = 4.0
HEAL_BOUND_S = 45.0


class Proc:
    """A child on a test bed host whose JSON stdout lines are read as they come."""

    def __init__(self, bed: Testbed, host: str, argv: list[str], log: Path) -> None:
        self.log = log
        self.proc = bed.popen(host, argv, cwd=ROOT, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
        self.peers: set[str] = set()

    def next_event(self, timeout: float) -> dict | None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"child exited: {self.log.read_text()[-2000:]}")
        ev = json.loads(line)
        if ev.get("event") == "peers":
            self.peers = set(ev["peers"])
        return ev

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def until(nodes: list[Proc], done, timeout: float) -> float:
    """Read events until `done()` holds; returns the seconds it took; fails at `timeout`."""
    t0 = time.monotonic()
    while not done():
        left = timeout - (time.monotonic() - t0)
        if left <= 0:
            pytest.fail(f"not within {timeout:.0f}s: {[sorted(n.peers) for n in nodes]}")
        for n in nodes:
            n.next_event(min(0.2, left))
    return time.monotonic() - t0


def start_swarm(bed: Testbed, remerge: bool, logs: Path) -> tuple[Proc, list[Proc]]:
    boot = Proc(bed, "bootstrap", [sys.executable, "-m", "dilonode.cli", "bootstrap",
                                   "--host", bed.addr("bootstrap"), "--run-id", RUN,
                                   "--log-format", "json", "--no-status"],
                logs / "bootstrap.log")
    ev = boot.next_event(60)
    assert ev and ev["event"] == "bootstrap", ev
    nodes = [Proc(bed, f"node-{i}", [sys.executable, "-m", "tests.integration.remerge_node",
                                     RUN, bed.addr(f"node-{i}"), str(TTL_S), str(int(remerge)),
                                     *ev["maddrs"]], logs / f"node-{i}.log")
             for i in range(4)]
    ids = [n.next_event(90)["peer_id"] for n in nodes]
    until(nodes, lambda: all(n.peers == set(ids) for n in nodes), 60)
    return boot, nodes


@pytest.mark.timeout(300)
def test_two_halves_find_each_other_again_after_a_partition_heals(tmp_path):
    names = ["bootstrap", *(f"node-{i}" for i in range(4))]
    with Testbed(names, rate_mbit=100, rates={"bootstrap": None}) as bed:
        boot, nodes = start_swarm(bed, remerge=True, logs=tmp_path)
        try:
            everyone = set(nodes[0].peers)
            bed.partition(["bootstrap", "node-0", "node-1"], ["node-2", "node-3"])
            t_cut = time.monotonic()
            a, b = {p for p in everyone if p in nodes[0].peers}, set()
            halves = lambda: (nodes[0].peers == nodes[1].peers and  # noqa: E731
                              nodes[2].peers == nodes[3].peers and
                              len(nodes[0].peers) == 2 and len(nodes[2].peers) == 2)
            until(nodes, halves, 60)
            a, b = nodes[0].peers, nodes[2].peers
            assert not a & b
            # keep the cut for 20 s in all, as a WAN outage would, then heal it
            until(nodes, lambda: time.monotonic() - t_cut > 20, 30)
            assert nodes[0].peers == a and nodes[2].peers == b, "the halves met through the cut"
            bed.heal()
            took = until(nodes, lambda: all(n.peers == everyone for n in nodes), HEAL_BOUND_S)
            print(f"re-merged {took:.1f}s after the heal")
        finally:
            for p in [*nodes, boot]:
                p.stop()
