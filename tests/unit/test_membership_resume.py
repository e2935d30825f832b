"""A node resuming after a crash waits for peers that published while it waited: a killed
peer's record outlives it, whatever ttl that peer used."""

from __future__ import annotations

import threading
import time

import pytest

from dilonode.config import NetworkConfig
from dilonode.swarm.membership import Membership
from dilonode.swarm.records import PeerRecord

RUN = "resume-test"


class _Peers:
    """The DHT as membership reads it: the records held now, newest per peer."""

    def __init__(self) -> None:
        self.peer_id = "me"
        self.records: dict[str, PeerRecord] = {}
        self.reads = 0
        self.on_read: list = []

    def put(self, peer_id: str, expires_at: float) -> None:
        self.records[peer_id] = PeerRecord(peer_id=peer_id, run_id=RUN, data_addr="127.0.0.1:1",
                                           bandwidth_mbps=1.0, step=0,
                                           expires_at=expires_at)

    def fetch_peers(self, timeout: float | None = None) -> list[PeerRecord]:
        self.reads += 1
        for hook in self.on_read:
            hook(self.reads)
        return [self.records[k] for k in sorted(self.records)]


def _membership(dht: _Peers) -> Membership:
    return Membership(dht, RUN, NetworkConfig(peer_ttl=15.0))  # type: ignore[arg-type]


@pytest.mark.parametrize("their_ttl", [5.0, 15.0, 600.0])
def test_a_resumed_node_counts_only_peers_that_published_while_it_waited(their_ttl):
    dht, now = _Peers(), time.time()  # DHT time: the wall clock, as hivemind's
    dht.put("me", now + 15.0)
    # Two peers killed with the node: records from before the crash, each with the ttl
    # it published with (longer or shorter than ours).
    dht.put("Dead", now - 10.0 + their_ttl)
    dht.put("Awake", now - 5.0 + their_ttl)
    # The live one publishes again from the third read on; the dead one never does.
    dht.on_read.append(lambda n: n >= 3 and dht.put("Awake", now + n + their_ttl))
    members = _membership(dht)
    with pytest.raises(TimeoutError, match="network.min_peers = 3: only 2 peer"):
        members.wait_for_peers(3, timeout=1.0, refreshed=True)
    dht.reads = 0
    got = members.wait_for_peers(2, timeout=5.0, refreshed=True)
    assert [r.peer_id for r in got] == ["Awake", "me"]
    assert dht.reads >= 3


def test_a_fresh_start_counts_every_live_record_at_once():
    dht = _Peers()
    for peer in ("me", "a", "b"):
        dht.put(peer, 1010.0)
    got = _membership(dht).wait_for_peers(3, timeout=5.0)
    assert len(got) == 3 and dht.reads == 1


def test_a_waiting_node_asked_to_stop_returns_what_it_has():
    dht, stop = _Peers(), threading.Event()
    dht.put("me", 1010.0)
    dht.on_read.append(lambda n: n == 2 and stop.set())
    got = _membership(dht).wait_for_peers(3, timeout=30.0, stop=stop, refreshed=True)
    assert [r.peer_id for r in got] == ["me"]
