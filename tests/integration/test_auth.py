"""Authorization on loopback: intruders cannot join a group or change a weight, while the
authorized nodes complete their round.

The run has a swarm secret and an allowlist {A, B, W}. Intruders: W is on the allowlist but
holds a wrong secret, X holds the secret but is not on the allowlist, F holds the secret and
tries to pass as A. Real TCP data planes with credentials on 127.0.0.1 and the real
matchmaking code (`form_group`) run over an in-memory board with the DHT's semantics (per
subkey, the value that expires last). The last test checks, on a real hivemind DHT, that
the key we load is the identity p2pd runs with and that records signed under another
secret are ignored and counted.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

from dilonode.algo.butterfly import butterfly_average
from dilonode.algo.codecs import get_codec
from dilonode.allreduce.inbox import PeerUnreachable
from dilonode.allreduce.retry import RoundPolicy, SwarmOutcome, SwarmRounds
from dilonode.allreduce.round import RoundState
from dilonode.allreduce.transport import DataPlane
from dilonode.collective import FormedGroup, GroupRequest, RoundRequest, SyncKey
from dilonode.net.auth import Credentials, Identity, seal_record, swarm_key
from dilonode.net.channel import _proof, _transcript
from dilonode.swarm.dht import decode_entries
from dilonode.swarm.matchmaking import Group, form_group
from dilonode.swarm.records import GroupEntry, encode_record, group_key
from dilonode.wire.framing import HEADER_BYTES, encode_frame
from dilonode.wire.messages import Contribution, HelloAuth
from tests.boards import Board, View
from tests.support.waiting import wait_until, wait_until_async

pytestmark = [pytest.mark.slow]

RUN = "auth-it"
HOST = "127.0.0.1"
SECRET = b"0123456789abcdef-shared-swarm-secret"
NUMEL = 20_000
ROUND = RoundRequest(SyncKey("fragment", 0, 1))
A, B, W, X, F = (Identity.generate() for _ in range(5))
ALLOWED = frozenset({A.peer_id, B.peer_id, W.peer_id})


class Member:
    """A data plane with credentials, its board view and its retrying rounds."""

    def __init__(self, board: Board, identity: Identity, *, secret: bytes = SECRET,
                 allowed: frozenset[str] | None = ALLOWED, expected: frozenset[str]) -> None:
        self.creds = Credentials(identity, RUN, secret, allowed)
        self.view = View(board, self.creds)
        self.plane = DataPlane(identity.peer_id, RUN, HOST, auth=self.creds)
        self.expected = expected
        policy = RoundPolicy(codec="float32", chunk_numel=4096, timeout=5.0, max_attempts=2)
        self.rounds = SwarmRounds(self.plane, self.form, policy)

    async def form(self, req: GroupRequest) -> FormedGroup:
        fragment, round_no, attempt, exclude = req.fragment, req.round, req.attempt, req.exclude
        me = GroupEntry(peer_id=self.creds.peer_id, run_id=RUN, data_addr=self.plane.address,
                        fragment=fragment, round=round_no, attempt=attempt, bandwidth_mbps=1.0)
        group = await asyncio.to_thread(form_group, self.view, RUN, fragment, round_no,
                                        attempt, me, 2.0, 6.0, poll_interval=0.05,
                                        expected=self.expected - exclude, exclude=set(exclude))
        return FormedGroup(group.members, group.data_addrs, group.weights, group.my_index,
                           group.digest())


class Intruder(Member):
    """Does not wait for anyone's roster: reads the entries it can decode (its own policy
    admits everyone) and dials every peer it saw, as an attacker would."""

    async def form(self, req: GroupRequest) -> FormedGroup:
        fragment, round_no, attempt = req.fragment, req.round, req.attempt
        if attempt:
            raise RuntimeError("the intruder tries once")
        me = GroupEntry(peer_id=self.creds.peer_id, run_id=RUN, data_addr=self.plane.address,
                        fragment=fragment, round=round_no, attempt=attempt, bandwidth_mbps=1.0)
        key = group_key(RUN, fragment, round_no, attempt)
        self.view.store_raw(key, me.peer_id, encode_record(me, self.creds), ttl=30.0)

        def registered() -> dict[str, GroupEntry] | None:
            entries = decode_entries(self.view, key, self.view.get_raw(key), GroupEntry,
                                     self.creds)
            return entries if self.expected <= entries.keys() else None

        entries = await wait_until_async(registered, 10.0, interval=0.02,
                                         what="the honest peers' entries")
        group = Group(members=tuple(sorted(entries)),
                      data_addrs=tuple(entries[p].data_addr for p in sorted(entries)),
                      weights=tuple(1.0 for _ in entries), my_index=sorted(entries).index(
                          me.peer_id), run_id=RUN, fragment=fragment, round=round_no,
                      attempt=attempt)
        return FormedGroup(group.members, group.data_addrs, group.weights, group.my_index,
                           group.digest())


def _inputs(seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed)) * scale


async def _connect(plane: DataPlane) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = plane.address.rsplit(":", 1)
    return await asyncio.wait_for(asyncio.open_connection(host, int(port)), 5.0)


async def _read_all(reader: asyncio.StreamReader) -> bytes:
    """Whatever the peer still sends before hanging up (b"" if it just closes or resets)."""
    try:
        return await asyncio.wait_for(reader.read(), 5.0)
    except ConnectionResetError:
        return b""


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    head = await asyncio.wait_for(reader.readexactly(HEADER_BYTES), 5.0)
    return await asyncio.wait_for(reader.readexactly(int.from_bytes(head, "big")), 5.0)


async def _forge_as_a(victim: Member, *, with_a_key: bool) -> bytes:
    """F dials `victim` claiming A's peer id (with A's public key, or its own) and proves
    what it can: the secret, and a signature by its own key. Returns what it reads back."""
    from dilonode.net.channel import OutboundHandshake

    shake = OutboundHandshake(Credentials(F, RUN, SECRET), RUN, F.peer_id, victim.creds.peer_id)
    hello = shake.hello.model_copy(update={
        "peer_id": A.peer_id, "public_key": A.public_key if with_a_key else F.public_key})
    reader, writer = await _connect(victim.plane)
    try:
        writer.write(encode_frame(hello))
        if not with_a_key:
            return await _read_all(reader)  # refused at the hello
        ack = msgpack.unpackb(await _read_frame(reader))
        transcript = _transcript(hello, ack["peer_id"], ack["public_key"], ack["nonce"])
        sig, mac = _proof(Credentials(F, RUN, SECRET), swarm_key(RUN, SECRET),
                          b"dilonode/v3/handshake/connector\0", transcript)
        poison = Contribution(run_id=RUN, fragment=0, round=1, sender=0, owner=1, chunk=0,
                              n_chunks=1, offset=0, numel=4, codec="float32", block_size=64,
                              weight=1.0, payload=b"\x00\x00\x80\x7f" * 4)
        writer.write(encode_frame(HelloAuth(run_id=RUN, signature=sig, mac=mac))
                     + encode_frame(poison))
        return await _read_all(reader)  # b"": the victim hung up
    finally:
        writer.close()


async def _scenario() -> dict[str, Any]:
    board = Board()
    honest = frozenset({A.peer_id, B.peer_id})
    everyone = frozenset(i.peer_id for i in (A, B, W, X))
    a = Member(board, A, expected=honest)
    b = Member(board, B, expected=honest)
    w = Member(board, W, secret=b"a-wrong-secret-of-16+bytes", expected=everyone)
    x = Intruder(board, X, allowed=None, expected=honest)  # its own policy admits anyone
    members = [a, b, w, x]
    for m in members:
        await m.plane.start()
    try:
        # F's forged group entry: names A, points at F, signed by F (it has the secret).
        forged = GroupEntry(peer_id=A.peer_id, run_id=RUN, data_addr="127.0.0.1:9",
                            fragment=0, round=1, attempt=0, bandwidth_mbps=1000.0)
        a.view.store_raw(group_key(RUN, 0, 1, 0), F.peer_id,
                         seal_record(Credentials(F, RUN, SECRET),
                                     msgpack.packb(forged.model_dump(), use_bin_type=True)),
                         ttl=30.0)
        forged_replies = [await _forge_as_a(b, with_a_key=False),
                          await _forge_as_a(b, with_a_key=True)]
        # W skips matchmaking and pushes a poisoned frame straight at A's data plane.
        poison = encode_frame(Contribution(
            run_id=RUN, fragment=0, round=1, sender=0, owner=0, chunk=0, n_chunks=1, offset=0,
            numel=4, codec="float32", block_size=64, weight=1.0,
            payload=b"\x00\x00\x80\x7f" * 4))
        with pytest.raises(PeerUnreachable, match="handshake refused"):
            await asyncio.wait_for(w.plane.send(A.peer_id, a.plane.address, poison), 10.0)
        xs = {m.creds.peer_id: _inputs(i, 1.0 if i < 2 else 1e6) for i, m in enumerate(members)}
        # The intruders register first, so A and B's final reads surely see their entries.
        intruders = [asyncio.create_task(m.rounds.reduce(ROUND, xs[m.creds.peer_id]))
                     for m in (w, x)]
        key = group_key(RUN, 0, 1, 0)
        await wait_until_async(lambda: {W.peer_id, X.peer_id} <= a.view.get_raw(key).keys(),
                               10.0, interval=0.02, what="the intruders' entries")
        outs = await asyncio.wait_for(asyncio.gather(
            *(m.rounds.reduce(ROUND, xs[m.creds.peer_id]) for m in (a, b)), *intruders), 60.0)
        return {"members": members, "outs": dict(zip("abwx", outs, strict=True)), "xs": xs,
                "forged_replies": forged_replies}
    finally:
        for m in members:
            await m.plane.aclose()


@pytest.mark.timeout(120)
def test_intruders_cannot_join_or_change_weights(caplog: pytest.LogCaptureFixture) -> None:
    torch.set_num_threads(1)
    with caplog.at_level(logging.WARNING):
        got = asyncio.run(_scenario())
    outs: dict[str, SwarmOutcome] = got["outs"]
    a, b, w, x = got["members"]
    # A and B completed one round together, and only together.
    pair = tuple(sorted((A.peer_id, B.peer_id)))
    for name in "ab":
        out = outs[name].outcome
        assert out.state is RoundState.DONE and not out.skipped, outs[name].failures
        assert out.members == pair
    expected = butterfly_average([got["xs"][p] for p in pair], (1.0, 1.0),
                                 get_codec("float32", 64))[0]
    assert torch.equal(outs["a"].outcome.result, expected)
    assert torch.equal(outs["b"].outcome.result, expected)
    # The intruders never averaged with anyone.
    assert outs["w"].outcome.members == (W.peer_id,)
    tried = outs["x"].attempts[0]  # X read A and B's entries, and was refused by both
    assert set(tried.members) == {A.peer_id, B.peer_id, X.peer_id}
    assert tried.state is RoundState.FAILED
    assert outs["x"].outcome.members == (X.peer_id,)
    # Every refusal was counted: data-plane handshakes and matchmaking entries.
    assert a.plane.unauthorized_attempts >= 2  # W's direct push (abandoned), X's round
    assert b.plane.unauthorized_attempts >= 3  # both forgeries and X's round
    assert got["forged_replies"][0] == b"" and got["forged_replies"][1] == b""
    for view in (a.view, b.view):
        refused = {subkey: reason for subkey, reason, unauthorized in view.rejected
                   if unauthorized}
        assert "not in the allowlist" in refused[X.peer_id]
        assert "wrong swarm secret" in refused[W.peer_id]
    # F's entry naming A (F is not on the allowlist; forging an admitted author fails on
    # the signature instead: tests/unit/test_auth.py).
    assert any(s == F.peer_id and unauthorized for s, _, unauthorized in a.view.rejected)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("dilonode")]
    assert any(f"does not belong to peer {A.peer_id}" in ln and "unproven" in ln
               for ln in lines)
    # F's second forgery (same address, same claimed id: "cannot prove its peer id") is
    # folded into a summary line (dilonode.net.peer_log.PeerLog), counted all the same.
    assert any("more connections refused in the handshake" in ln for ln in lines)
    assert all("\n" not in ln for ln in lines)
    assert not any(SECRET.decode() in ln for ln in lines)


@pytest.mark.timeout(120)
def test_dht_identity_is_our_key_and_foreign_secret_records_are_ignored(tmp_path: Path) -> None:
    pytest.importorskip("hivemind")
    from dilonode.swarm.dht import SwarmDHT
    from dilonode.swarm.records import PeerRecord

    path = tmp_path / "a.key"
    identity = Identity.load_or_create(path)

    def record(dht: SwarmDHT) -> PeerRecord:
        return PeerRecord(peer_id=dht.peer_id, run_id=RUN, data_addr=f"{HOST}:1",
                          bandwidth_mbps=1.0, step=0)

    with SwarmDHT(RUN, [], identity_path=path, host=HOST, secret=SECRET) as first:
        assert first.peer_id == identity.peer_id == first.credentials.peer_id
        maddrs = first.visible_maddrs()
        with SwarmDHT(RUN, maddrs, host=HOST, secret=SECRET) as second, \
                SwarmDHT(RUN, maddrs, host=HOST, secret=b"not-the-swarm-secret!") as other:
            for dht in (first, second, other):
                assert dht.publish(record(dht), ttl=60.0)
            def valid_ids_once_other_refused() -> set[str] | None:
                ids = {r.peer_id for r in second.fetch_peers(timeout=5)}
                return ids if second.unauthorized_records and len(ids) >= 2 else None

            ids = wait_until(valid_ids_once_other_refused, 30.0, interval=0.2,
                             what="the foreign-secret records refused")
            assert ids == {first.peer_id, second.peer_id}
            assert {r.peer_id for r in other.fetch_peers(timeout=5)} == {other.peer_id}
            assert other.unauthorized_records >= 2


@pytest.mark.timeout(120)
def test_unreachable_peer_is_reached_through_a_libp2p_stream() -> None:
    """B advertises a data address nobody can connect to; A's frames to B go through the
    DHT's p2pd instead, authenticated as on TCP, and the round completes on both."""
    pytest.importorskip("hivemind")
    from dilonode.allreduce.driver import run_round
    from dilonode.allreduce.round import GroupSpec, group_digest
    from dilonode.swarm.dht import SwarmDHT
    from dilonode.swarm.tunnel import Tunnel

    with SwarmDHT(RUN, [], host=HOST, secret=SECRET) as da, \
            SwarmDHT(RUN, da.visible_maddrs(), host=HOST, secret=SECRET) as db:

        async def main() -> tuple[list[Any], dict[str, int]]:
            tunnels = [Tunnel(d.p2p_daemon_maddr(), RUN) for d in (da, db)]
            planes = [DataPlane(d.peer_id, RUN, HOST, auth=d.credentials, fallback=t.open)
                      for d, t in zip((da, db), tunnels, strict=True)]
            for plane, tunnel in zip(planes, tunnels, strict=True):
                await plane.start()
                await tunnel.start(plane.accept_stream)
            try:
                members = tuple(sorted(p.peer_id for p in planes))
                by_id = {p.peer_id: p for p in planes}
                closed = socket.socket()  # bound, never listening: connections are refused
                closed.bind((HOST, 0))
                unreachable = f"{HOST}:{closed.getsockname()[1]}"
                addrs = {da.peer_id: planes[0].address, db.peer_id: unreachable}
                spec = GroupSpec(run_id=RUN, fragment=0, round=1, members=members,
                                 weights=(1.0, 1.0), numel=NUMEL, codec="float32",
                                 block_size=64, chunk_numel=4096,
                                 group_digest=group_digest(members))
                outs = await asyncio.wait_for(asyncio.gather(*(
                    run_round(by_id[m], spec, i, _inputs(i), {1 - i: addrs[members[1 - i]]},
                              timeout=20.0)
                    for i, m in enumerate(members))), 60.0)
                closed.close()
                stats = {k: planes[0].stats[k] + planes[1].stats[k]
                         for k in ("fallback_connections", "fallback_accepts", "unauthorized")}
                return list(outs), stats
            finally:
                for plane, tunnel in zip(planes, tunnels, strict=True):
                    await tunnel.aclose()
                    await plane.aclose()

        outs, stats = asyncio.run(main())
    expected = butterfly_average([_inputs(0), _inputs(1)], (1.0, 1.0),
                                 get_codec("float32", 64))[0]
    for out in outs:
        assert out.state is RoundState.DONE, out.failure
        assert torch.equal(out.result, expected)
    assert stats == {"fallback_connections": 1, "fallback_accepts": 1, "unauthorized": 0}
