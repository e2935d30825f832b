"""Two of three nodes behind home routers (NAT, masquerading, no port forwards) on the WAN test
bed: they find out they are private, join, average with the others every round (through
libp2p streams: to each other through the bootstrap's relay) and a NATed joiner recovers
the run's state from the public node and, through the relay, from the other NATed node.

Topology (testbed/hosts.py): `bootstrap` and `node-0` on the bed's public subnet; `node-1`
and `node-2` each behind a router of their own. Every node runs with the defaults
(`network.reachable = "auto"`), so this is what a volunteer gets without configuring
anything. Needs root, `ip`, `tc`, `iptables-restore` and NAT in network namespaces; skipped
with the reason otherwise.
"""

from __future__ import annotations

import pytest

from testbed.hosts import unavailable_reason

REASON = unavailable_reason(nat=True)
pytestmark = [pytest.mark.slow, pytest.mark.host_network,
              pytest.mark.skipif(REASON is not None, reason=REASON or "")]

NAT = ["node-1", "node-2"]
BASE = {
    "run_id": "nat-test", "seed": 11, "eval_every": 40, "total_steps": 240,
    # Paced by the clock: a round of each fragment every 4 s, whatever the load on the box.
    "diloco": {"sync_every": 16, "num_fragments": 2, "pacing": "time", "step_seconds": 0.25},
    "codec": {"name": "int4"},
    "network": {"matchmaking_window": 4.0, "matchmaking_timeout": 12.0,
                "allreduce_timeout": 20.0, "max_attempts": 2, "bandwidth_mbps": 50.0},
}


@pytest.mark.timeout(300)
def test_natted_nodes_average_with_peers_and_a_natted_joiner_recovers(tmp_path):
    pytest.importorskip("hivemind")
    from testbed.hosts import swarm_on_testbed
    from tests.support.config import nano_config
    from tests.support.swarm import SwarmEvents, assert_one_model

    cfg = nano_config(tmp_path, **BASE)
    names = ["node-0", "node-1", "node-2"]
    with swarm_on_testbed(cfg, 2, rate_mbit=50, hosts=3, nat=NAT) as (bed, swarm):
        assert bed.natted() == NAT and bed.addr("node-1") != bed.public_addr("node-1")
        seen = SwarmEvents(swarm)
        swarm.start()  # bootstrap, node-0 (public) and node-1 (NATed)
        # Rounds of both fragments without the joiner, then node-2 joins from behind its
        # own router: node-0 serves it the state by TCP, NATed node-1 through the relay.
        seen.until(lambda: seen.step("node-1") >= 24, 150, "node-1 at step 24")
        swarm.start_node(2)
        seen.until(lambda: all(seen.first(n, "eof") for n in names), 200, "the run's end")
        codes = [p.wait(timeout=60) for p in swarm.procs]
        lan = {n: bed.addr(n) for n in names}
    started = {n: seen.first(n, "started") for n in names}
    recovered = seen.first("node-2", "recovered")
    summaries = {n: seen.first(n, "summary") for n in names}
    assert codes == [0, 0, 0], codes
    assert all(summaries.values()), summaries
    print({n: (s["reachability"], s["rounds_with_peers"], s["rounds_per_fragment"],
               s["data_paths"]) for n, s in summaries.items()})
    # every node listened on its own address, the NATed ones on their private LAN address,
    # and those knew they were private without being told; node-0 did not
    assert {n: e["data_addr"].rsplit(":", 1)[0] for n, e in started.items()} == lan
    assert {n: s["reachability"] for n, s in summaries.items()} == \
        {"node-0": "public", "node-1": "private", "node-2": "private"}
    # the NATed joiner fetched the state from both (which one sent the chunks is up to the
    # fetch plan): node-0 by TCP, NATed node-1 by a libp2p stream through the bootstrap's
    # relay (its second relayed stream, below)
    assert recovered is not None and recovered["bytes"] > 0, recovered
    assert set(recovered["peers"]) == {summaries[n]["peer_id"] for n in ("node-0", "node-1")}
    for n, s in summaries.items():
        assert s["skipped_rounds"] == 0, (n, s["dropped_peers"])
        # nobody waited on a dial that could not work
        assert s["data_paths"]["direct_failures"] == 0, (n, s["data_paths"])
    assert_one_model(summaries)
    s0, s1, s2 = (summaries[n] for n in names)
    # both NATed nodes averaged with peers, the joiner in rounds after joining
    assert s1["rounds_with_peers"] >= 8, s1
    assert s2["rounds_with_peers"] >= 2, s2
    # node-0 reached both NATed nodes by libp2p streams over the connections they opened
    # to it, never through the relay; they reached it by plain TCP
    p0, p1, p2 = (s["data_paths"] for s in (s0, s1, s2))
    assert p0["stream_out"] >= 2 and p0["direct_out"] == p0["relayed_out"] == 0, p0
    for p in (p1, p2):
        assert p["direct_out"] >= 1 and p["stream_in"] >= 2, p
        # the two NATed nodes reached each other through the bootstrap's relay
        assert p["relayed_out"] >= 1, p
    assert p2["relayed_out"] >= 2, p2  # its data plane and its state sync to node-1
