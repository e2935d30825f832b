"""Reachability (swarm/reach.py) and what it changes: who counts as behind a NAT, the DHT and
p2pd options a private node runs with, and the data plane going straight to the libp2p
stream for a peer that cannot be dialled (or could not be, recently)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from dilonode.algo.butterfly import butterfly_average
from dilonode.algo.codecs import get_codec
from dilonode.allreduce.driver import run_round
from dilonode.allreduce.plane_limits import PlaneLimits
from dilonode.allreduce.round import GroupSpec, RoundState, group_digest
from dilonode.allreduce.transport import DataPlane
from dilonode.config import NetworkConfig
from dilonode.swarm import reachability as reach
from dilonode.swarm.records import PeerRecord

BOOT_PUBLIC = ("/ip4/11.77.0.1/tcp/31337/p2p/QmBoot",)
BOOT_LAN = ("/ip4/10.77.0.1/tcp/31337/p2p/QmBoot",)


@pytest.mark.parametrize(("setting", "host", "announce", "peers", "want"), [
    # behind a home router: a LAN address, a bootstrap on the internet
    ("auto", "192.168.1.2", None, BOOT_PUBLIC, "private"),
    ("auto", "100.64.3.4", None, BOOT_PUBLIC, "private"),  # carrier-grade NAT
    ("auto", "fd00::2", None, ("/ip6/2001:4860::1/tcp/1/p2p/QmB",), "private"),
    # a forwarded port: the operator says where peers reach us
    ("auto", "192.168.1.2", "203.0.114.7", BOOT_PUBLIC, "public"),
    # one private network (a LAN, a VPN, the test bed without NAT), a local swarm
    ("auto", "10.77.0.2", None, BOOT_LAN, "public"),
    ("auto", "127.0.0.1", None, ("/ip4/127.0.0.1/tcp/4/p2p/QmB",), "public"),
    # a public address, a host name, the first node of a swarm, DNS bootstraps
    ("auto", "11.77.0.2", None, BOOT_PUBLIC, "public"),
    ("auto", "node.example.org", None, BOOT_PUBLIC, "public"),
    ("auto", "192.168.1.2", None, (), "public"),
    ("auto", "192.168.1.2", None, ("/dns4/boot.example.org/tcp/1/p2p/QmB",), "public"),
    # what the operator says, whatever the addresses
    ("private", "11.77.0.2", None, BOOT_PUBLIC, "private"),
    ("public", "192.168.1.2", None, BOOT_PUBLIC, "public"),
])
def test_resolve(setting, host, announce, peers, want):
    assert reach.resolve(setting, host, announce, peers) == want


def test_config_takes_the_three_settings_only():
    assert NetworkConfig().reachable == "auto"
    assert NetworkConfig(reachable="private").reachable == "private"
    with pytest.raises(ValueError):
        NetworkConfig(reachable="nat")


def test_a_private_node_reserves_relay_slots_at_its_initial_peers():
    assert reach.dht_options("public", BOOT_PUBLIC) == ({}, {})
    kwargs, flags = reach.dht_options("private", BOOT_PUBLIC)
    assert kwargs == {"client_mode": True, "use_auto_relay": True,
                      "force_reachability": "private", "trusted_relays": list(BOOT_PUBLIC)}
    assert flags == {"relayDiscovery": False}
    # no initial peer to reserve at: a DHT client, nothing p2pd would refuse to start with
    assert reach.dht_options("private", ()) == ({"client_mode": True}, {})


def test_p2pd_flags_go_only_to_daemons_with_static_relays(monkeypatch):
    pytest.importorskip("hivemind")
    from dilonode.swarm.hivemind_process import import_hivemind

    import_hivemind()  # as the node does: undoes hivemind's renaming of WARNING
    from hivemind import p2p
    monkeypatch.setattr(p2p.P2P, "_make_process_args", p2p.P2P._make_process_args)
    reach.add_p2pd_flags({"relayDiscovery": False})
    reach.add_p2pd_flags({"relayDiscovery": False})  # once is enough: not wrapped twice
    with_relays = p2p.P2P._make_process_args("p2pd", autoRelay=True, trustedRelays="/ip4/x")
    assert with_relays == ["p2pd", "-autoRelay=1", "-trustedRelays=/ip4/x",
                           "-relayDiscovery=0"]
    # hivemind's identity check starts a daemon with autorelay but no relays: unchanged
    assert p2p.P2P._make_process_args("p2pd", autoRelay=True) == ["p2pd", "-autoRelay=1"]


def test_peer_records_say_whether_the_peer_can_be_dialled():
    rec = PeerRecord(peer_id="QmA", run_id="r", data_addr="192.168.1.2:4000",
                     bandwidth_mbps=1.0, step=0)
    assert rec.reachable is True  # records of nodes that predate the field
    assert rec.model_copy(update={"reachable": False}).reachable is False


# -- the data plane's path ------------------------------------------------------------

RUN, NUMEL = "reach-unit", 4096
BLACKHOLE = "192.0.2.1:9"  # TEST-NET-1: nothing answers (a SYN is dropped or refused)


def _inputs(seed: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))


async def _round(planes: list[DataPlane], addrs: dict[str, str], round_no: int) -> None:
    members = tuple(sorted(p.peer_id for p in planes))
    by_id = {p.peer_id: p for p in planes}
    spec = GroupSpec(run_id=RUN, fragment=0, round=round_no, members=members,
                     weights=(1.0, 1.0), numel=NUMEL, codec="float32", block_size=64,
                     chunk_numel=1024, group_digest=group_digest(members))
    outs = await asyncio.wait_for(asyncio.gather(*(
        run_round(by_id[m], spec, i, _inputs(i), {1 - i: addrs[members[1 - i]]}, timeout=20.0)
        for i, m in enumerate(members))), 40.0)
    want = butterfly_average([_inputs(0), _inputs(1)], (1.0, 1.0),
                             get_codec("float32", 64))[0]
    for out in outs:
        assert out.state is RoundState.DONE, out.failure
        assert torch.equal(out.result, want)


def test_the_plane_streams_at_once_to_a_natted_peer_and_after_a_failed_dial():
    """`b` sits behind a NAT: its advertised data address is a black hole. The "libp2p
    stream" is a loopback connection handed to b's `accept_stream`, as the tunnel does."""

    async def main() -> tuple[dict[str, int], dict[str, int]]:
        b = DataPlane("node-b", RUN, limits=PlaneLimits(connect_timeout=1.0))
        servers = []

        async def handle(reader, writer):
            await b.accept_stream(reader, writer, "libp2p:test")

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        servers.append(server)
        port = server.sockets[0].getsockname()[1]

        async def fallback(peer_id: str):
            assert peer_id == "node-b"
            return await asyncio.open_connection("127.0.0.1", port)

        a = DataPlane("node-a", RUN, limits=PlaneLimits(connect_timeout=1.0),
                      fallback=fallback)
        await a.start()
        await b.start()
        addrs = {"node-a": a.address, "node-b": BLACKHOLE}
        try:
            a.stream_only = frozenset({"node-b"})  # its record said so
            await _round([a, b], addrs, 1)
            told = dict(a.stats)
            # unflagged: one dial fails, later connections go straight to the stream
            a.stream_only = frozenset()
            await a._outbound.pop("node-b").aclose(0.0)
            await _round([a, b], addrs, 2)
            await a._outbound.pop("node-b").aclose(0.0)
            await _round([a, b], addrs, 3)
            return told, dict(a.stats)
        finally:
            for s in servers:
                s.close()
            await a.aclose()
            await b.aclose()

    told, learned = asyncio.run(main())
    # flagged: no dial at all
    assert told["direct_failures"] == 0 and told["fallback_connections"] == 1, told
    assert learned["direct_failures"] == 1 and learned["fallback_connections"] == 3, learned
    assert learned["connections_out"] == 3


def test_relays_are_the_initial_peers_in_order():
    from dilonode.swarm.tunnel import relay_peers

    maddrs = ["/ip4/11.0.0.1/tcp/1/p2p/QmA", "/ip4/11.0.0.2/tcp/1/p2p/QmB",
              "/ip6/::1/tcp/1/p2p/QmA", "/dns4/x/tcp/1"]
    assert relay_peers(maddrs) == ["QmA", "QmB"]


class _Writer:
    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None:
        pass


def test_the_relay_refuses_targets_without_a_live_record_and_bad_requests():
    from dilonode.swarm.tunnel import LivePeers, Relay

    class _Rec:
        def __init__(self, peer_id: str, leaving: bool = False) -> None:
            self.peer_id, self.status = peer_id, {"leaving": leaving}

    reads = []

    def fetch():
        reads.append(1)
        if len(reads) > 1:
            raise TimeoutError("the DHT is unwell")  # the last read is kept
        return [_Rec("QmLive"), _Rec("QmGone", leaving=True)]

    async def main():
        live = LivePeers(fetch)
        relay = Relay(p2p=None, run_id="r", admitted=live)
        answers = []
        for service, target in ((0, b"QmGone"), (1, b"QmNobody"), (7, b"QmLive"),
                                (0, b"QmAsker")):
            reader = asyncio.StreamReader()
            reader.feed_data(bytes([service, len(target)]) + target)
            writer = _Writer()
            await relay._relay("QmAsker", reader, writer)
            answers.append(writer.data)
        once = len(reads)  # unknown targets re-read the records at most once a second
        await live.refresh()  # fails: the last read is kept
        return answers, relay.stats, once, live.ids

    answers, stats, once, ids = asyncio.run(main())
    assert answers == [b"\x01"] * 4 and stats["refused"] == 4 and stats["relayed"] == 0
    assert once == 1 and ids == {"QmLive"} and len(reads) == 2


def test_a_relayed_stream_is_counted_as_the_requester_it_names():
    from dilonode.swarm.tunnel import _accept_relayed

    class _Transport:
        aborted = False

        def abort(self) -> None:
            self.aborted = True

    async def one(head: bytes, eof: bool = True):
        reader, writer = asyncio.StreamReader(), _Writer()
        writer.transport = _Transport()
        reader.feed_data(head + b"rest")
        if eof:
            reader.feed_eof()
        seen = []

        async def accept(r, w, remote):
            seen.append((remote, await r.read()))

        await _accept_relayed(accept, "QmRelay", reader, writer)
        return seen, writer.transport.aborted

    name = b"QmAsker"
    assert asyncio.run(one(bytes([len(name)]) + name)) == (
        [("libp2p:QmAsker via QmRelay", b"rest")], False)
    assert asyncio.run(one(bytes([4]) + b"0O/l")) == ([], True)  # not base58
    assert asyncio.run(one(bytes([40]) + name)) == ([], True)  # cut short
