"""SwarmDHT and matchmaking on a real hivemind swarm: a bootstrap node and three peers
(and, in one test, an attacker running plain hivemind that tries to displace a peer's entry).

Everything listens on 127.0.0.1 with ephemeral ports. Waits poll a condition against a
deadline; nothing sleeps a fixed time to synchronise.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import msgpack
import pytest

pytest.importorskip("hivemind")

from dilonode.net.auth import Identity, seal_record  # noqa: E402
from dilonode.swarm.dht import SwarmDHT, _owner_validator, owner_subkey  # noqa: E402
from dilonode.swarm.matchmaking import Group, MatchmakingError, form_group  # noqa: E402
from dilonode.swarm.records import (  # noqa: E402
    GroupEntry,
    PeerRecord,
    peers_key,
)
from tests.support.waiting import wait_until  # noqa: E402

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

RUN = "dht-test"
HOST = "127.0.0.1"


def _records_if(node: SwarmDHT, ok: Callable[[set[str]], bool]) -> dict[str, PeerRecord] | None:
    """The node's current valid peer records by id, or None while `ok(ids)` is false."""
    by_id = {r.peer_id: r for r in node.fetch_peers(timeout=5)}
    return by_id if ok(set(by_id)) else None


def _ids(node: SwarmDHT) -> set[str]:
    return {r.peer_id for r in node.fetch_peers(timeout=5)}


def _peer_record(dht: SwarmDHT, port: int) -> PeerRecord:
    return PeerRecord(peer_id=dht.peer_id, run_id=RUN, data_addr=f"{HOST}:{port}",
                      bandwidth_mbps=float(port % 97 + 1), step=0)


@pytest.fixture(scope="module")
def boot() -> Iterator[SwarmDHT]:
    with SwarmDHT(RUN, [], host=HOST) as node:
        yield node


@pytest.fixture(scope="module")
def peers(boot: SwarmDHT) -> Iterator[list[SwarmDHT]]:
    maddrs = boot.visible_maddrs()
    assert maddrs and all(m.startswith(f"/ip4/{HOST}/tcp/") for m in maddrs)
    nodes = [SwarmDHT(RUN, maddrs, host=HOST) for _ in range(3)]
    try:
        for node in nodes:
            node.start()
        yield nodes
    finally:
        for node in nodes:
            node.close()


@pytest.mark.timeout(120)
def test_peers_see_each_other(peers: list[SwarmDHT]) -> None:
    for i, node in enumerate(peers):
        assert node.publish(_peer_record(node, 5000 + i), ttl=60.0)
    want = {node.peer_id for node in peers}
    for node in peers:
        by_id = wait_until(lambda n=node: _records_if(n, lambda ids: want <= ids), 20.0,
                           interval=0.2, what="every peer's record")
        for i, other in enumerate(peers):
            assert by_id[other.peer_id].data_addr == f"{HOST}:{5000 + i}"
            assert by_id[other.peer_id].expires_at > time.time()


@pytest.mark.timeout(120)
def test_foreign_records_are_ignored_and_counted(
        peers: list[SwarmDHT], caplog: pytest.LogCaptureFixture) -> None:
    writer, reader, garbler = peers
    alien = PeerRecord(peer_id="QmForeign", run_id="another-run", data_addr=f"{HOST}:1",
                       bandwidth_mbps=1.0, step=0)
    key = peers_key(RUN)
    with pytest.raises(ValueError, match="only under its own peer id"):
        writer.store_raw(key, "QmForeign", b"", ttl=60.0)
    # Validly signed by `writer`, so what the reader refuses is the record's run id. (These
    # replace the writers' own peer records, which later tests do not need.)
    sealed = seal_record(writer.credentials, msgpack.packb(alien.model_dump(), use_bin_type=True))
    assert writer.store_raw(key, writer.peer_id, sealed, ttl=60.0)
    assert garbler.store_raw(key, garbler.peer_id, b"\xc1 not msgpack", ttl=60.0)
    before = reader.rejected_records

    def valid_ids_once_both_rejected() -> tuple[set[str]] | None:
        ids = _ids(reader)
        return (ids,) if reader.rejected_records >= before + 2 else None

    with caplog.at_level(logging.WARNING, logger="dilonode.swarm.dht"):
        (ids,) = wait_until(valid_ids_once_both_rejected, 20.0, interval=0.2,
                            what="both foreign records rejected")
    assert writer.peer_id not in ids and garbler.peer_id not in ids
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "run id 'another-run' != 'dht-test'" in warned and "not msgpack" in warned


@pytest.mark.timeout(120)
def test_expired_record_disappears(boot: SwarmDHT, peers: list[SwarmDHT]) -> None:
    with SwarmDHT(RUN, boot.visible_maddrs(), host=HOST) as brief:
        assert brief.publish(_peer_record(brief, 6000), ttl=6.0)
    # Its DHT process is gone; the other nodes still hold the record until it expires.
    seen = wait_until(lambda: _records_if(peers[0], lambda ids: brief.peer_id in ids), 5.0,
                      interval=0.1, what="the brief peer's record")
    expires_at = seen[brief.peer_id].expires_at
    wait_until(lambda: all(brief.peer_id not in _ids(n) for n in peers), 15.0, interval=0.2,
               what="the brief peer's record to expire everywhere")
    assert time.time() >= expires_at - 0.5  # dropped at expiry, not lost early


@pytest.mark.timeout(120)
def test_identity_persists_across_restart(boot: SwarmDHT, tmp_path: Path) -> None:
    identity = tmp_path / "keys" / "node.key"
    first = SwarmDHT(RUN, boot.visible_maddrs(), identity_path=identity, host=HOST)
    with first:
        peer_id = first.peer_id
    assert identity.is_file()
    with SwarmDHT(RUN, boot.visible_maddrs(), identity_path=identity, host=HOST) as again:
        assert again.peer_id == peer_id
    with SwarmDHT(RUN, boot.visible_maddrs(), host=HOST) as anonymous:
        assert anonymous.peer_id != peer_id


def _entry(node: SwarmDHT, port: int, fragment: int, attempt: int) -> GroupEntry:
    return GroupEntry(peer_id=node.peer_id, run_id=RUN, data_addr=f"{HOST}:{port}",
                      bandwidth_mbps=float(10 + port % 7), fragment=fragment, round=4,
                      attempt=attempt)


@pytest.mark.timeout(120)
def test_form_group_agrees(peers: list[SwarmDHT]) -> None:
    def join(i: int) -> Group:
        node = peers[i]
        return form_group(node, RUN, 1, 4, 0, _entry(node, 7000 + i, 1, 0),
                          window=2.0, timeout=10.0, poll_interval=0.25)

    with ThreadPoolExecutor(len(peers)) as pool:
        groups = list(pool.map(join, range(len(peers))))
    expected = tuple(sorted(node.peer_id for node in peers))
    assert all(g.members == expected for g in groups)
    assert len({g.digest() for g in groups}) == 1
    assert len({(g.data_addrs, g.weights) for g in groups}) == 1
    assert sorted(g.my_index for g in groups) == [0, 1, 2]
    for node, g in zip(peers, groups, strict=True):
        assert g.members[g.my_index] == node.peer_id
        assert g.data_addrs[g.my_index] == f"{HOST}:{7000 + peers.index(node)}"


@pytest.mark.timeout(120)
def test_group_of_one(peers: list[SwarmDHT]) -> None:
    node = peers[2]
    t0 = time.monotonic()
    group = form_group(node, RUN, 3, 4, 5, _entry(node, 7100, 3, 5), window=0.5, timeout=5.0)
    assert time.monotonic() - t0 < 5.0
    assert group.members == (node.peer_id,) and group.my_index == 0
    other = form_group(node, RUN, 3, 4, 6, _entry(node, 7100, 3, 6), window=0.0, timeout=5.0)
    assert other.digest() != group.digest()  # the attempt is part of the digest


@pytest.mark.timeout(120)
def test_close_is_fast_and_idempotent(boot: SwarmDHT) -> None:
    node = SwarmDHT(RUN, boot.visible_maddrs(), host=HOST)
    node.close()  # never started: a no-op
    node.start()
    t0 = time.monotonic()
    node.close()
    assert time.monotonic() - t0 < 5.0
    node.close()
    with pytest.raises(RuntimeError):
        node.fetch_peers(timeout=1)


@pytest.mark.timeout(120)
def test_calls_time_out_when_the_dht_process_is_stuck(boot: SwarmDHT) -> None:
    node = SwarmDHT(RUN, boot.visible_maddrs(), host=HOST, shutdown_timeout=1.0).start()
    pid = node._dht.pid  # white-box: freeze the DHT process to simulate a hang
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            node.fetch_peers(timeout=1.0)
        with pytest.raises(MatchmakingError):
            form_group(node, RUN, 9, 4, 0, _entry(node, 7200, 9, 0), window=0.5, timeout=1.5)
        assert time.monotonic() - t0 < 5.0
        with ThreadPoolExecutor(1) as pool:
            # A call in flight when the node closes (e.g. a matchmaking poll at shutdown)
            # must fail then, not wait out its timeout: it would hold up the process exit.
            waiting = pool.submit(node.get_raw, peers_key(RUN), 60.0)
            wait_until(lambda: node._in_flight, 5.0, interval=0.05, what="a call in flight")
            t0 = time.monotonic()
            node.close()  # SIGTERM stays pending on a stopped process: close() must SIGKILL
            assert time.monotonic() - t0 < 6.0
            with pytest.raises(RuntimeError, match="closed"):
                waiting.result(timeout=1.0)
    finally:
        if node.started:
            os.kill(pid, signal.SIGKILL)


def test_owner_validator_accepts_only_the_owner_named_by_the_subkey() -> None:
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.validation import DHTRecord

    victim, other = Identity.generate(), Identity.generate()
    mine, theirs = _owner_validator(victim), _owner_validator(other)

    def record(subkey: object, signer: Any = None, expiration: float = 1e10) -> DHTRecord:
        rec = DHTRecord(b"k" * 20, msgpack.packb(subkey), msgpack.packb(b"v"), expiration)
        return rec if signer is None else dataclasses.replace(rec, value=signer.sign_value(rec))

    signed = record(owner_subkey(victim), mine)
    assert theirs.validate(signed) and mine.validate(signed)
    assert not theirs.validate(record(owner_subkey(victim)))  # unsigned
    # The signature covers the expiration: no replay with a later one.
    assert not theirs.validate(dataclasses.replace(signed, expiration_time=2e10))
    # Validly signed by `other`, under a subkey naming the victim: hivemind's own rule
    # accepts it; ours refuses it, as it refuses unprotected subkeys and plain values.
    forged = record(f"{victim.peer_id}[owner:{other.ssh_public_key.decode()}]", theirs)
    assert RSASignatureValidator.validate(mine, forged)
    assert not mine.validate(forged)
    assert not mine.validate(record(victim.peer_id))
    assert not mine.validate(record(None))
    assert not mine.validate(DHTRecord(b"k" * 20, b"\xc1", b"", 1e10))


async def _held_expirations(_dht: Any, node: Any, key: str) -> dict[Any, float]:
    """White-box, in a DHT process: what the node holds for `key` (storage and cache)."""
    from hivemind.dht.routing import DHTID

    key_id = DHTID.generate(source=key)
    held: dict[Any, float] = {}
    for store in (node.protocol.storage, node.protocol.cache):
        found = store.get(key_id)
        if found is not None:
            held.update((sub, item.expiration_time) for sub, item in found.value.items())
    return held


@pytest.mark.timeout(120)
def test_attacker_cannot_hide_a_peers_record(boot: SwarmDHT, peers: list[SwarmDHT]) -> None:
    import hivemind
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.utils import get_dht_time
    from hivemind.utils.crypto import RSAPrivateKey

    victim, reader = peers[1], peers[2]
    # Generous timeouts: the node the stuck-process test froze and killed may still be in
    # the routing tables, and a store waits out hivemind's RPC timeout for it.
    assert victim.publish(_peer_record(victim, 5100), ttl=60.0, timeout=40.0)
    key = peers_key(RUN)
    # A DHT peer with no credentials of the run, signing (hivemind's scheme) with its own key.
    signer = RSASignatureValidator(RSAPrivateKey())
    attacker = hivemind.DHT(boot.visible_maddrs(), start=True, record_validators=[signer],
                            host_maddrs=[f"/ip4/{HOST}/tcp/0"], shutdown_timeout=1.0)
    try:
        later = get_dht_time() + 600  # outlives the victim's record
        subkeys = [victim.peer_id,  # a plain subkey, with no owner
                   victim.peer_id + signer.local_public_key.decode(),  # signed, wrong owner
                   owner_subkey(victim.credentials.identity)]  # the victim's, unsigned
        for subkey in subkeys:
            attacker.store(key, b"\xc1 junk", later, subkey=subkey,
                           return_future=True).result(timeout=40.0)
        for node in [boot, *peers]:
            held = node._dht.run_coroutine(partial(_held_expirations, key=key),
                                           return_future=True).result(timeout=10.0)
            assert not set(subkeys[:2]) & held.keys(), node.peer_id
            assert held.get(subkeys[2], 0.0) < later, node.peer_id  # still the victim's
        record = {r.peer_id: r for r in reader.fetch_peers(timeout=20)}.get(victim.peer_id)
        assert record is not None and record.data_addr == f"{HOST}:5100"
        assert reader.get_raw(key, timeout=20)[victim.peer_id].expiration < later
    finally:
        attacker.shutdown()
