"""State sync is authenticated like the data plane (127.0.0.1): a joiner the run's credentials
do not admit gets nothing and is counted; a joiner refuses a server that is not the peer id it
looked up; a tampered frame drops that peer and its chunks come from the others."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import pytest

from dilonode.config import load_config
from dilonode.net.auth import Credentials, Identity
from dilonode.statesync.client import Recovery, recover
from dilonode.statesync.protocol import ManifestRequest, encode_frame
from dilonode.statesync.server import SnapshotSource, StateServer
from dilonode.train.state import WorkerState, config_digest
from tests.integration.test_join import _assert_same, _FixedWorker, _state
from tests.support.waiting import wait_until_async

SECRET = b"state-sync-test-secret"
CFG = load_config(overrides={"statesync": {"chunk_bytes": 4096, "request_timeout": 5.0,
                                           "snapshot_wait": 1.0}})
DIGEST = config_digest(CFG)
TRUTH = _state(1, numel=20_000)


@pytest.fixture(scope="module")
def ids() -> list[Identity]:
    return [Identity.generate() for _ in range(4)]


def _creds(identity: Identity, secret: bytes = SECRET,
           allowed: frozenset[str] | None = None) -> Credentials:
    return Credentials(identity, CFG.run_id, secret, allowed)


def _server(auth: Credentials | None, state: WorkerState = TRUTH,
            peer_id: str | None = None) -> StateServer:
    return StateServer(SnapshotSource(_FixedWorker(state)), CFG.run_id, DIGEST, CFG.statesync,
                       auth=auth, peer_id=peer_id)


Scenario = Callable[[list[str]], Awaitable[Recovery | None]]


def _with_servers(servers: list[StateServer], scenario: Scenario) -> Recovery | None:
    async def main() -> Recovery | None:
        addrs = [await s.start() for s in servers]
        try:
            return await asyncio.wait_for(scenario(addrs), 30)
        finally:
            for s in servers:
                await s.aclose()

    return asyncio.run(main())


def _recover(peers: dict[str, str], auth: Credentials) -> Awaitable[Recovery | None]:
    return recover(peers, None, CFG.run_id, DIGEST, CFG.statesync, auth=auth)


# ----------------------------------------------------------------- the server refuses


@pytest.mark.timeout(60)
@pytest.mark.parametrize("why", ["wrong secret", "not on the allowlist"])
def test_server_refuses_and_counts_a_joiner_it_does_not_admit(ids, why):
    joiner_id, server_id = ids[0], ids[1]
    if why == "wrong secret":
        server = _server(_creds(server_id))
        joiner = _creds(joiner_id, secret=b"another-secret-entirely")
    else:
        server = _server(_creds(server_id, allowed=frozenset({server_id.peer_id})))
        joiner = _creds(joiner_id, allowed=frozenset({joiner_id.peer_id, server_id.peer_id}))
    rec = _with_servers([server], lambda a: _recover({server_id.peer_id: a[0]}, joiner))
    assert rec is None  # nothing served
    assert server.unauthorized_attempts == 1
    assert server.manifests_served == 0 and server.bytes_served == 0


@pytest.mark.timeout(60)
def test_plain_tcp_request_gets_no_state_and_is_counted(ids, caplog):
    """A client of the unauthenticated protocol (or anyone skipping the handshake)."""
    server = _server(_creds(ids[1]))

    async def scenario(addrs: list[str]) -> None:
        host, port = addrs[0].rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(encode_frame(ManifestRequest(run_id=CFG.run_id)))
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, nothing sent back
        writer.close()

    with caplog.at_level(logging.WARNING, "dilonode.statesync"):
        _with_servers([server], scenario)
    assert server.unauthorized_attempts == 1 and server.manifests_served == 0
    assert any("handshake: unknown message type 'manifest?'" in r.getMessage()
               for r in caplog.records)


# ----------------------------------------------------------------- the joiner refuses


@pytest.mark.timeout(60)
@pytest.mark.parametrize("impostor", ["its own identity", "claims the id, no key"])
def test_joiner_refuses_an_impostor_at_a_peers_address(ids, impostor, caplog):
    """The record of peer A points (stale or spoofed) at a server that is not A: its
    (poisoned) state is not used; the state comes from B alone."""
    joiner, a, b, other = ids
    poisoned = _state(2, numel=20_000)
    fake = (_server(_creds(other), poisoned) if impostor == "its own identity"
            else _server(None, poisoned, peer_id=a.peer_id))
    servers = [fake, _server(_creds(b))]

    def scenario(addrs: list[str]) -> Awaitable[Recovery | None]:
        return _recover({a.peer_id: addrs[0], b.peer_id: addrs[1]}, _creds(joiner))

    with caplog.at_level(logging.WARNING, "dilonode.statesync"):
        rec = _with_servers(servers, scenario)
    assert rec is not None
    _assert_same(rec.state, TRUTH, "recovered vs the real peers' state")
    assert set(rec.sources) == {b.peer_id} and rec.refused == 1
    assert fake.bytes_served == 0
    reason = "answered" if impostor == "its own identity" else "sent no public key"
    assert any(f"dropping peer {a.peer_id}" in r.getMessage() and reason in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


# ----------------------------------------------------------------- tampering in transit


async def _flipping_proxy(target: str, flip_at: int, replies: bool) -> tuple[asyncio.Server,
                                                                             str]:
    """A TCP proxy to `target` that flips one bit of byte `flip_at` of the replies (or of the
    requests) and forwards everything else unchanged."""
    host, port = target.rsplit(":", 1)

    async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, flip: bool) -> None:
        seen = 0
        try:
            while data := await src.read(1 << 16):
                if flip and seen <= flip_at < seen + len(data):
                    i = flip_at - seen
                    data = data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:]
                seen += len(data)
                dst.write(data)
                await dst.drain()
        finally:  # also on a reset: pass the hang-up on
            dst.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection(host, int(port))
        await asyncio.gather(pump(reader, up_w, not replies), pump(up_r, writer, replies),
                             return_exceptions=True)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("direction", ["reply", "request"])
def test_tampered_frame_drops_the_peer_and_chunks_come_from_others(ids, direction, caplog):
    joiner, a, b, c = ids
    servers = [_server(_creds(p)) for p in (a, b, c)]
    # Past the handshake (~1.5 KB each way) and the first frames: inside a chunk reply, or
    # inside a later chunk request (requests are ~60 bytes with their tag).
    flip_at = TRUTH.nbytes // 8 if direction == "reply" else 2000

    async def scenario(addrs: list[str]) -> Recovery | None:
        proxy, bad_addr = await _flipping_proxy(addrs[0], flip_at, direction == "reply")
        try:
            peers = {a.peer_id: bad_addr, b.peer_id: addrs[1], c.peer_id: addrs[2]}
            return await _recover(peers, _creds(joiner))
        finally:
            proxy.close()

    with caplog.at_level(logging.WARNING, "dilonode.statesync"):
        rec = _with_servers(servers, scenario)
    assert rec is not None
    _assert_same(rec.state, TRUTH, "recovered vs served")
    assert rec.sources[b.peer_id] > 0 and rec.sources[c.peer_id] > 0
    assert rec.fetched_bytes == TRUTH.nbytes  # every chunk exactly once, none from the tamper
    lines = [r.getMessage() for r in caplog.records]
    if direction == "reply":
        assert 0 < rec.sources[a.peer_id] < flip_at and rec.refused == 1, rec.sources
        assert any(f"dropping peer {a.peer_id}" in m and "MAC does not verify" in m
                   for m in lines), lines
    else:
        assert servers[0].unauthorized_attempts == 1
        assert any("MAC does not verify" in m for m in lines), lines
    assert all("\n" not in m for m in lines)


@pytest.mark.timeout(60)
def test_node_counts_refused_state_sync_connections_with_the_data_planes(ids):
    """What `Node._trust_counters` adds to dilonode_unauthorized_connections_total."""
    from dilonode.net.loop_thread import LoopThread
    from dilonode.statesync.keeper import StateKeeper

    thread, keeper = LoopThread(), StateKeeper(CFG)
    thread.start()
    try:
        addr = keeper.start_server(thread, _creds(ids[1]))
        assert addr is not None and keeper.unauthorized_attempts == 0
        stranger = _creds(ids[0], secret=b"not-the-run-secret")
        assert thread.run(_recover({ids[1].peer_id: addr}, stranger), timeout=30) is None
        assert keeper.unauthorized_attempts == 1
    finally:
        keeper.close(thread)
        thread.stop()


def test_a_server_closing_while_an_answer_is_made_ends_the_connection_quietly(ids, caplog):
    """A node stopping while a joiner waits on a snapshot (the trainer has not come by):
    `aclose` closes the connection first, the answer then finds it closed (uvloop refuses
    the write), and the handler ends without asyncio logging an ERROR for it."""
    uvloop = pytest.importorskip("uvloop")
    from dilonode.statesync.link import Link

    server_id, joiner = ids[0], ids[1]
    source = SnapshotSource(_FixedWorker(TRUTH))
    source.training(True)  # a snapshot waits for the trainer's next pass: snapshot_wait
    server = StateServer(source, CFG.run_id, DIGEST, CFG.statesync, auth=_creds(server_id))
    caplog.set_level(logging.ERROR, logger="asyncio")

    async def main() -> None:
        addr = await server.start()
        conn = await Link.connect(addr, _creds(joiner), CFG.run_id, joiner.peer_id,
                                  server_id.peer_id, 5.0)
        conn.send(ManifestRequest(run_id=CFG.run_id))
        await wait_until_async(lambda: source._wanted, 5.0,
                               what="the server waiting on the trainer")
        await server.aclose()  # its answer comes after snapshot_wait, on a closed socket
        conn.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors
