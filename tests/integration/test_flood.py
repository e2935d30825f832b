"""Hostile traffic at a node's three listening ports (data plane, state sync, status),
started standalone on 127.0.0.1 in one uvloop event loop with small caps and 2 s deadlines:

* a flood of idle connections beyond the caps from two addresses (127.0.0.2, 127.0.0.3):
  legit clients (from 127.0.0.1) are still served mid-flood, every idle connection is
  closed by its deadline and its descriptor released, fewer than 100 log lines, and
  /metrics counts the refusals and closes by port and reason;
* 1 MB of garbage to each port: refused, counted, under 4 KB of log in all;
* out of descriptors (RLIMIT_NOFILE lowered in a child process): accepting pauses and
  resumes, the process and its listener survive.

Every wait is on a condition with a deadline, never a fixed sleep.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import uvloop
from prometheus_client.parser import text_string_to_metric_families

from dilonode.allreduce.plane_limits import PlaneLimits
from dilonode.allreduce.transport import DataPlane
from dilonode.config import StateSyncConfig
from dilonode.net.admission import Admission, Limits
from dilonode.statesync.link import Link
from dilonode.statesync.protocol import Error, ManifestRequest
from dilonode.statesync.server import SnapshotSource, StateServer
from dilonode.status.metrics import node_metrics
from dilonode.status.server import StatusServer
from dilonode.status.snapshot import NodeStatus, QuietFacts
from dilonode.wire.framing import encode_frame
from dilonode.wire.messages import Abort
from tests.support.waiting import wait_until_async

RUN = "flood-it"
DEADLINE = 2.0  # handshake deadline of all three ports
LIMITS = Limits(max_open=64, max_pending=16, max_pending_per_source=8)
FLOODERS = ("127.0.0.2", "127.0.0.3")
PER_SOURCE = 40  # idle connections per flooding address and port (5x the cap)


@dataclass
class Ports:
    """The three listeners of one node, sharing one `Admission`."""

    adm: Admission
    plane: DataPlane
    state: StateServer
    status: StatusServer
    addrs: dict[str, tuple[str, int]]

    async def aclose(self) -> None:
        await self.plane.aclose()
        await self.state.aclose()
        await self.status.aclose()


class _Admitting(QuietFacts):
    """A node whose status reports its admission counters."""

    def __init__(self, adm: Admission) -> None:
        self.adm = adm

    def admission(self) -> dict[str, Any]:
        return self.adm.snapshot()


async def _start() -> Ports:
    adm = Admission(LIMITS)
    plane = DataPlane("node-a", RUN, gate=adm.gate("data"),
                      limits=PlaneLimits(connect_timeout=DEADLINE))
    cfg = StateSyncConfig(request_timeout=DEADLINE, snapshot_wait=0.1)
    state = StateServer(SnapshotSource(), RUN, "d" * 64, cfg, peer_id="node-a",
                        gate=adm.gate("state"))
    status = StatusServer(NodeStatus(RUN, facts=_Admitting(adm)), node_metrics,
                          gate=adm.gate("status"), handshake_timeout=DEADLINE,
                          keepalive_timeout=DEADLINE)
    await plane.start()
    state_addr = await state.start()
    await status.start()
    addrs = {"data": ("127.0.0.1", plane.port),
             "state": ("127.0.0.1", int(state_addr.rsplit(":", 1)[1])),
             "status": ("127.0.0.1", status.port)}
    return Ports(adm, plane, state, status, addrs)


def _run(main: Callable[[], Awaitable[Any]]) -> Any:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(asyncio.wait_for(main(), 60))


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# -------------------------------------------------------------------- legit clients


async def _legit_data(ports: Ports, name: str) -> None:
    """A proven peer connects and its frame arrives."""
    before = ports.plane.stats["frames_in"]
    async with DataPlane(name, RUN) as peer:
        frame = encode_frame(Abort(run_id=RUN, fragment=0, round=1, sender=0, reason="hi"))
        await asyncio.wait_for(peer.send("node-a", ports.plane.address, frame), 10)
        await wait_until_async(lambda: ports.plane.stats["frames_in"] > before, 15.0,
                               interval=0.02, what="frame delivered")


async def _legit_state(ports: Ports) -> None:
    """A joiner gets through the handshake and its request is answered."""
    host, port = ports.addrs["state"]
    link = await Link.connect(f"{host}:{port}", None, RUN, "joiner", "node-a", 10)
    try:
        link.send(ManifestRequest(run_id=RUN))
        answer = await link.recv()
        assert isinstance(answer, Error) and "no state to serve yet" in answer.reason
    finally:
        link.writer.close()


async def _metrics(ports: Ports) -> dict[tuple[str, str, str], float]:
    """GET /metrics on a fresh connection: {(family, port, reason): value}."""
    host, port = ports.addrs["status"]
    connector = aiohttp.TCPConnector(force_close=True)
    async with (aiohttp.ClientSession(connector=connector,
                                      timeout=aiohttp.ClientTimeout(total=10)) as http,
                http.get(f"http://{host}:{port}/metrics") as resp):
        assert resp.status == 200
        text = await resp.text()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, s.labels.get("port", ""), s.labels.get("reason", ""))] = s.value
    return out


# -------------------------------------------------------------------- the flood


Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def _flood(addr: tuple[str, int]) -> list[Conn]:
    """PER_SOURCE idle connections to `addr` from each flooding address."""
    return list(await asyncio.gather(*(asyncio.open_connection(*addr, local_addr=(src, 0))
                                       for src in FLOODERS for _ in range(PER_SOURCE))))


async def _closed_by_server(reader: asyncio.StreamReader) -> bool:
    """True once the server closed the connection (after a 400 response, maybe)."""
    try:
        await asyncio.wait_for(reader.read(), 10)
    except ConnectionResetError:
        return True
    return reader.at_eof()


def _accounted(gate: Any, n: int) -> bool:
    """Every connection the flood opened has reached the gate (held, refused or closed)."""
    return gate.open + sum(gate.refused.values()) + sum(gate.closed.values()) >= n


@pytest.mark.timeout(60)
def test_idle_flood_beyond_the_caps(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> dict[str, Any]:
        ports = await _start()
        try:
            await _legit_data(ports, "warm-up")  # first connections of each kind exist
            baseline = _open_fds()
            caplog.clear()
            floods = await asyncio.gather(*(_flood(a) for a in ports.addrs.values()))
            n = PER_SOURCE * len(FLOODERS)
            gates = [ports.adm.gate(p) for p in ports.addrs]
            await wait_until_async(lambda: all(_accounted(g, n) for g in gates), 15.0,
                                   interval=0.02, what="flood accepted")
            held = {g.port: (g.open, g.pending) for g in gates}
            # Mid-flood, with every pending slot taken: legit clients still get in.
            await _legit_data(ports, "legit")
            await _legit_state(ports)
            mid = await _metrics(ports)
            # Every idle connection is closed by its deadline, from the server's side.
            closed = await asyncio.gather(*(_closed_by_server(r) for f in floods
                                            for r, _ in f))
            await wait_until_async(lambda: all(g.pending == 0 for g in gates), 15.0,
                                   interval=0.02, what="idle ones closed")
            for _, writer in (c for f in floods for c in f):
                writer.close()
            await wait_until_async(lambda: _open_fds() <= baseline + 2, 15.0,
                                   interval=0.02, what="descriptors released")
            after = await _metrics(ports)
            snap = ports.adm.snapshot()
        finally:
            await ports.aclose()
        return {"held": held, "mid": mid, "after": after, "closed": closed, "snap": snap}

    with caplog.at_level(logging.INFO):
        got = _run(main)
    for port, (open_, pending) in got["held"].items():
        assert open_ <= LIMITS.max_open and pending <= LIMITS.max_pending, port
    assert all(got["closed"])
    after = got["after"]
    for port in ("data", "state", "status"):
        refused = after[("dilonode_connections_refused_total", port, "source_full")]
        timeouts = after[("dilonode_connections_closed_total", port, "handshake_timeout")]
        assert refused >= 2 * (PER_SOURCE - LIMITS.max_pending_per_source) - 4, port
        assert timeouts >= LIMITS.max_pending - 2, port
        assert after[("dilonode_connections_closed_total", port, "evicted")] >= 1, port
        assert after[("dilonode_connections_pending", port, "")] <= 1, port
    assert got["mid"][("dilonode_connections_refused_total", "data", "source_full")] > 0
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) < 100, lines
    assert any("more connections refused: too many unauthenticated" in ln for ln in lines)
    assert after[("dilonode_peer_log_folded_total", "", "")] > 100


# -------------------------------------------------------------------- garbage


async def _send_garbage(addr: tuple[str, int], payload: bytes) -> bool:
    """Write `payload` (ignoring a reset once the server gives up) and wait for the server
    to close; True when it did."""
    reader, writer = await asyncio.open_connection(*addr)
    try:
        writer.write(payload)
        try:
            await asyncio.wait_for(writer.drain(), 10)
        except (ConnectionResetError, BrokenPipeError):
            return True
        return await _closed_by_server(reader)
    finally:
        writer.close()


@pytest.mark.timeout(60)
def test_a_megabyte_of_garbage_to_each_port_leaves_under_4_kb_of_log(
        caplog: pytest.LogCaptureFixture) -> None:
    rng = random.Random(1)
    payloads = {"zeros": bytes(1 << 20), "random": rng.randbytes(1 << 20),
                # a short head that aiohttp parses and refuses, then the megabyte
                "bad head": b"\x00BAD\x01REQ\r\n\r\n" + bytes(1 << 20)}

    async def main() -> dict[str, Any]:
        ports = await _start()
        try:
            results = [await _send_garbage(addr, p) for addr in ports.addrs.values()
                       for p in payloads.values()]
            await _legit_data(ports, "legit")
            await _legit_state(ports)
            metrics = await _metrics(ports)
        finally:
            await ports.aclose()  # flushes the summaries
        return {"results": results, "metrics": metrics}

    with caplog.at_level(logging.DEBUG):
        got = _run(main)
    assert all(got["results"])
    logged = sum(len(r.getMessage()) + len(r.exc_text or "") for r in caplog.records
                 if r.levelno >= logging.INFO)
    assert logged < 4096, [r.getMessage() for r in caplog.records]
    assert not any("\x00" in r.getMessage() or "\\x00" in r.getMessage()
                   for r in caplog.records)  # aiohttp's quote of the request never gets in
    m = got["metrics"]

    def closed(port: str) -> float:
        return sum(v for (name, p, _), v in m.items()
                   if name == "dilonode_connections_closed_total" and p == port)

    assert closed("data") >= 3 and closed("state") >= 3
    assert m[("dilonode_connections_closed_total", "status", "oversized")] >= 2
    assert m[("dilonode_connections_closed_total", "status", "malformed")] >= 1


# -------------------------------------------------------------------- out of descriptors


_CHILD = """
import asyncio, json, resource, sys
sys.path.insert(0, sys.argv[1])
from dilonode.net.admission import Admission, Limits
from dilonode.net.listener import Acceptor, bind_listener

class Echo(asyncio.Protocol):
    def __init__(self, gate, ticket):
        self.gate, self.ticket = gate, ticket
    def connection_made(self, transport):
        transport.write(b"ok\\n")
    def connection_lost(self, exc):
        self.gate.release(self.ticket)

async def main():
    # Caps far above the limit: the gate does not protect us, the accept loop must.
    gate = Admission(Limits(max_open=10_000, max_pending=10_000,
                            max_pending_per_source=10_000)).gate("data")
    acceptor = Acceptor(bind_listener("127.0.0.1", 0), gate, lambda t: Echo(gate, t),
                        backoff_min=0.05, backoff_max=0.2)
    acceptor.start()
    loop = asyncio.get_running_loop()
    done = loop.run_in_executor(None, sys.stdin.readline)  # its thread exists before the limit
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    print(acceptor.port, flush=True)
    end = loop.time() + 30
    while not acceptor.paused and loop.time() < end:
        await asyncio.sleep(0.01)  # a condition with a deadline
    print("paused" if acceptor.paused else "never paused", flush=True)
    await done  # the parent is done
    print(json.dumps({"paused": acceptor.paused, "fd_limit": gate.refused["fd_limit"],
                      "lines": gate.log.lines}), flush=True)
    acceptor.close()

if sys.argv[2] == "uvloop":
    import uvloop
    uvloop.install()
asyncio.run(main())
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_out_of_descriptors_pauses_accepting_and_recovers(loop: str) -> None:
    root = str(Path(__file__).parents[2])
    child = subprocess.Popen([sys.executable, "-c", _CHILD, root, loop], text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdin is not None
        port = int(child.stdout.readline())

        async def main() -> bytes:
            writers = []
            for _ in range(120):  # about twice the child's limit
                _, w = await asyncio.open_connection("127.0.0.1", port)
                writers.append(w)
            assert await asyncio.to_thread(child.stdout.readline) == "paused\n"
            for w in writers:  # the child's echo connections see EOF and close
                w.close()
            # The listener resumes by itself: a new client is served.
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                return await asyncio.wait_for(reader.readline(), 20)
            finally:
                writer.close()

        assert _run(main) == b"ok\n"
        child.stdin.write("done\n")
        child.stdin.flush()
        stats = json.loads(child.stdout.readline())
        assert child.wait(20) == 0, child.stderr.read() if child.stderr else ""
    finally:
        if child.poll() is None:
            child.kill()
    assert stats["paused"] >= 1 and stats["fd_limit"] == stats["paused"]
    assert stats["lines"] <= 2  # one full line, at most one summary so far
    stderr = child.stderr.read() if child.stderr else ""
    assert "Traceback" not in stderr and len(stderr.splitlines()) <= 5, stderr
