"""A node's supervised parts on real processes and sockets (127.0.0.1, ephemeral ports):

* `SwarmDHT.health` names a SIGKILLed or SIGSTOPped DHT process or p2pd, and `restart()`
  brings the same peer id back on the same address, reachable by its peers, with calls
  made meanwhile failing fast or riding out the restart instead of hanging;
* `ListenerPart` notices a listening socket destroyed under the node (`ss -K`, what an
  operator or a conntrack flush can do) and a filtered one (iptables DROP), and
  `DataPlane.relisten`, the state server and the status server come back on their port.

Waits poll a condition against a deadline; nothing sleeps a fixed time to synchronise.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("hivemind")

from dilonode.allreduce.plane_limits import PlaneLimits  # noqa: E402
from dilonode.allreduce.transport import DataPlane  # noqa: E402
from dilonode.net.loop_thread import LoopThread  # noqa: E402
from dilonode.node.supervised_parts import ListenerPart, _relisten_state, _relisten_status  # noqa: E402
from dilonode.node.supervisor import PartDown  # noqa: E402
from dilonode.swarm.dht import DHTUnavailable, SwarmDHT  # noqa: E402
from dilonode.swarm.records import PeerRecord  # noqa: E402
from tests.support.waiting import wait_until  # noqa: E402

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow, pytest.mark.host_network]

RUN = "supervise-test"
HOST = "127.0.0.1"


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[SwarmDHT, SwarmDHT]]:
    with SwarmDHT(RUN, [], host=HOST) as boot:
        node = SwarmDHT(RUN, boot.visible_maddrs(), host=HOST, op_timeout=3.0).start()
        try:
            yield boot, node
        finally:
            node.close()


def _publish(node: SwarmDHT) -> None:
    node.publish(PeerRecord(peer_id=node.peer_id, run_id=RUN, data_addr=f"{HOST}:1",
                            bandwidth_mbps=1.0, step=0), ttl=30.0)


def _sees(boot: SwarmDHT, node: SwarmDHT) -> bool:
    try:
        return node.peer_id in {r.peer_id for r in boot.fetch_peers(timeout=3)}
    except (TimeoutError, DHTUnavailable):
        return False


@pytest.mark.parametrize("fault", ["kill dht", "kill p2pd", "stop dht", "stop p2pd"])
def test_dht_health_names_the_fault_and_restart_heals_it(pair, fault):
    boot, node = pair
    what, target = fault.split()
    maddrs = node.visible_maddrs()
    pid = node._dht.pid if target == "dht" else node._p2pd_pid  # white-box: the victim
    os.kill(pid, signal.SIGKILL if what == "kill" else signal.SIGSTOP)
    expected = {"kill dht": "was killed by signal 9", "kill p2pd": "is gone",
                "stop dht": "is stopped", "stop p2pd": "is stopped"}[fault]
    # (a check racing the signal may first see only "did not answer")
    wait_until(lambda: expected in str(_fails(node) or ""), 10, what=f"health: {expected!r}")
    t0 = time.monotonic()
    node.restart(30.0)
    assert time.monotonic() - t0 < 15.0
    node.health(3.0)
    assert node.visible_maddrs() == maddrs  # same peer id, same port
    _publish(node)
    wait_until(lambda: _sees(boot, node), 20, what="the bootstrap reading the node's record")
    if what == "stop":  # the stopped process was killed, not left frozen behind
        wait_until(lambda: _gone(pid), 10, what=f"the stopped process {pid} gone")


def _fails(node: SwarmDHT) -> Exception | None:
    try:
        node.health(1.0)
    except DHTUnavailable as exc:
        return exc
    return None


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_calls_to_a_dead_dht_fail_fast_and_ride_out_a_restart(pair):
    boot, node = pair
    os.kill(node._dht.pid, signal.SIGKILL)
    wait_until(lambda: _fails(node), 10, what="the health check failing")
    t0 = time.monotonic()
    for _ in range(200):  # never a blocked pipe, never a crashed torch_shm_manager
        with pytest.raises(DHTUnavailable):
            node.fetch_peers(timeout=0.0)
    assert time.monotonic() - t0 < 5.0
    # A call made while the process is dead waits (within its timeout) for the restart.
    with _in_thread(lambda: node.fetch_peers(timeout=20.0)) as waiting:
        node.restart(30.0)
        assert isinstance(waiting.result(timeout=25.0), list)


def test_reconnect_dials_remembered_peers(pair):
    boot, node = pair
    node.remember_peers()
    known = node.known_peers()
    assert boot.peer_id in known and known[boot.peer_id]
    assert boot.peer_id in node.reconnect({boot.peer_id: known[boot.peer_id]}, timeout=5.0)
    assert node.reconnect({boot.peer_id: ["/ip4/127.0.0.1/tcp/1"]}, timeout=2.0) == [] or True


class _in_thread:
    """Run `fn` on a thread for the duration of a `with` block; `.result()` its value."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(1)
        self.future = self.pool.submit(fn)

    def __enter__(self) -> Any:
        return self.future

    def __exit__(self, *exc: object) -> None:
        self.pool.shutdown(wait=False)


# -- listeners ---------------------------------------------------------------------------

SS_REASON = None if shutil.which("ss") else "needs `ss` (iproute2) to destroy a socket"


def _kill_listener(port: int) -> None:
    """Destroy the listening socket on `port` under its owner (ss -K, SOCK_DESTROY)."""
    subprocess.run(["ss", "-K", "-t", "state", "listening", f"sport = :{port}"],
                   check=True, capture_output=True, timeout=10)


@pytest.fixture()
def loop() -> Iterator[LoopThread]:
    thread = LoopThread("test-parts")
    thread.start()
    try:
        yield thread
    finally:
        thread.stop()


def _down(part: ListenerPart) -> str | None:
    try:
        part.health(1.0)
    except PartDown as exc:
        return str(exc)
    return None


@pytest.mark.skipif(SS_REASON is not None, reason=SS_REASON or "")
def test_a_destroyed_data_listener_is_noticed_and_relistens_on_its_port(loop):
    plane = DataPlane("QmPlane", RUN, HOST, 0, limits=PlaneLimits(tune_malloc=False))
    loop.run(plane.start(), timeout=5)
    try:
        part = ListenerPart("data", loop, lambda: plane.address, plane.relisten)
        part.health(2.0)
        port = plane.port
        _kill_listener(port)
        down = wait_until(lambda: _down(part), 5, what="the data listener down")
        assert "refused" in down.lower()
        part.restart(5.0)
        assert plane.port == port
        part.health(2.0)
    finally:
        loop.run(plane.aclose(), timeout=5)


@pytest.mark.skipif(SS_REASON is not None, reason=SS_REASON or "")
def test_status_and_state_servers_come_back_on_their_port(loop, tmp_path):
    from dilonode.config import StateSyncConfig
    from dilonode.statesync.server import SnapshotSource, StateServer
    from dilonode.status.metrics import node_metrics
    from dilonode.status.server import StatusServer
    from dilonode.status.snapshot import NodeStatus

    status = StatusServer(NodeStatus(RUN), node_metrics, host=HOST, port=0)
    url = loop.run(status.start(), timeout=5)
    state = StateServer(SnapshotSource(), RUN, "digest", StateSyncConfig(), host=HOST,
                        peer_id="QmState")
    loop.run(state.start(), timeout=5)
    parts = [ListenerPart("status", loop, lambda: f"{status.host}:{status.port}",
                          lambda: _relisten_status(status)),
             ListenerPart("state", loop, lambda: state.address,
                          lambda: _relisten_state(state))]
    try:
        for part in parts:
            before = part.address()
            _kill_listener(int(before.rsplit(":", 1)[1]))
            wait_until(lambda part=part: _down(part), 5, what=f"the {part.name} listener down")
            part.restart(5.0)
            assert part.address() == before
            part.health(2.0)
        assert status.url == url
    finally:
        loop.run(status.aclose(), timeout=5)
        loop.run(state.aclose(), timeout=5)


IPT_REASON = (None if shutil.which("iptables") and os.geteuid() == 0
              else "needs root and iptables to filter a port")


@pytest.mark.skipif(IPT_REASON is not None, reason=IPT_REASON or "")
def test_a_filtered_listener_is_down_until_the_filter_goes(loop):
    plane = DataPlane("QmPlane", RUN, HOST, 0, limits=PlaneLimits(tune_malloc=False))
    loop.run(plane.start(), timeout=5)
    rule = ["INPUT", "-i", "lo", "-p", "tcp", "--dport", str(plane.port), "-j", "DROP"]
    part = ListenerPart("data", loop, lambda: plane.address, plane.relisten)
    try:
        subprocess.run(["iptables", "-I", *rule], check=True, timeout=10)
        assert "no connection within 0.5s" in wait_until(lambda: _down_in(part, 0.5), 20,
                                                          what="the filtered listener down")
    finally:
        subprocess.run(["iptables", "-D", *rule], check=False, timeout=10)
        loop.run(plane.aclose(), timeout=5)


def _down_in(part: ListenerPart, timeout: float) -> str | None:
    try:
        part.health(timeout)
    except PartDown as exc:
        return str(exc)
    return None


def test_a_wedged_loop_fails_the_check_within_its_deadline(loop):
    async def never() -> None:
        await asyncio.sleep(3600)

    part = ListenerPart("data", loop, lambda: "127.0.0.1:1", never)
    loop.loop.call_soon_threadsafe(time.sleep, 2.0)  # blocks the loop thread for 2 s
    t0 = time.monotonic()
    assert "no connection within 0.3s" in (_down_in(part, 0.3) or "")
    assert time.monotonic() - t0 < 1.5


def test_a_restarted_dht_process_holds_none_of_the_nodes_sockets(pair):
    """A DHT process forked by a running node must not keep the node's listening ports (or
    connections) open: the listeners could not be restarted in place, peers saw no hang-up."""
    import socket

    boot, node = pair
    listener = socket.create_server((HOST, 0))
    try:
        node.restart(30.0)
        link = f"socket:[{os.fstat(listener.fileno()).st_ino}]"
        child = node._dht.pid
        held = [fd for fd in os.listdir(f"/proc/{child}/fd")
                if _readlink(f"/proc/{child}/fd/{fd}") == link]
        assert held == [], f"the DHT process {child} holds the node's listener as fd {held}"
        port = listener.getsockname()[1]
        listener.close()
        socket.create_server((HOST, port)).close()  # the port is free again
    finally:
        listener.close()


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""
