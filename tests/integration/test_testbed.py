"""The WAN test bed (testbed/hosts.py): tbf limits hold, teardown leaves nothing behind (also
when its owner is SIGTERMed or SIGKILLed), and 3 nodes train across namespaces.

Needs root, `ip` and `tc`; skipped with the reason otherwise.
"""

from __future__ import annotations

import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.hosts import (
    SwarmHosts,
    Testbed,
    leftovers,
    measure_mbit,
    pid_alive,
    swarm_on_testbed,
    sweep,
    unavailable_reason,
)

REASON = unavailable_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or "")]
ROOT = Path(__file__).parents[2]

# A child that builds a test bed, starts a long-lived process inside host h0, prints the
# tag and that process's pid, then waits to be signalled.
OWNER = """
import subprocess, sys, threading
from testbed.hosts import Testbed
bed = Testbed(2, rate_mbit=10).start()
inner = bed.popen("h0", [sys.executable, "-c", "import threading; threading.Event().wait()"])
print(bed.tag, inner.pid, flush=True)
threading.Event().wait()
"""


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise AssertionError(f"no output within {timeout} s")
    return proc.stdout.readline()


def _start_owner() -> tuple[subprocess.Popen, str, int]:
    proc = subprocess.Popen([sys.executable, "-c", OWNER], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True)
    tag, inner = _readline(proc, 30).split()
    assert leftovers([tag]), "the test bed was not built"
    return proc, tag, int(inner)


@pytest.mark.timeout(120)
def test_tbf_caps_a_tcp_stream_at_the_host_rate():
    with Testbed(["a", "b", "c"], rate_mbit=20, rates={"c": 80}) as bed:
        a_to_b = measure_mbit(bed, "a", "b", 4_000_000)
        b_to_a = measure_mbit(bed, "b", "a", 4_000_000)
        # c's own link is faster: a stream into c is held by a's 20 Mbit/s upload
        a_to_c = measure_mbit(bed, "a", "c", 4_000_000)
        c_to_b = measure_mbit(bed, "c", "b", 4_000_000)
        bed.set_rate("b", 60)
        c_to_b_faster = measure_mbit(bed, "c", "b", 12_000_000)
    for got in (a_to_b, b_to_a, a_to_c, c_to_b):
        assert 0.8 * 20 <= got <= 1.05 * 20, (a_to_b, b_to_a, a_to_c, c_to_b)
    assert 0.8 * 60 <= c_to_b_faster <= 1.05 * 60, c_to_b_faster


@pytest.mark.timeout(60)
def test_close_removes_namespaces_links_and_their_processes():
    bed = Testbed(3, rate_mbit=50).start()
    tag = bed.tag
    inner = bed.popen("h1", [sys.executable, "-c", "import threading; threading.Event().wait()"])
    found = leftovers([tag])
    assert len(found) == 3 + 3 + 1, found  # 3 namespaces, 3 outer veth ends, the bridge
    bed.close()
    assert inner.wait(timeout=10) == -signal.SIGKILL
    assert leftovers([tag]) == []
    bed.close()  # idempotent


@pytest.mark.timeout(60)
def test_sigterm_to_the_owner_tears_the_bed_down():
    proc, tag, inner = _start_owner()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM  # the default disposition still acts
    assert leftovers([tag]) == []
    assert not pid_alive(inner)


@pytest.mark.timeout(60)
def test_sweep_removes_what_a_sigkilled_owner_left():
    proc, tag, inner = _start_owner()
    proc.kill()
    proc.wait(timeout=10)
    assert leftovers([tag]), "a SIGKILLed owner cannot clean up; sweep must"
    removed = sweep()
    assert any(tag in name for name in removed), removed
    assert leftovers([tag]) == []
    assert not pid_alive(inner)


@pytest.mark.timeout(420)
def test_three_nodes_train_across_namespaces_and_agree(tmp_path):
    pytest.importorskip("hivemind")
    from tests.support.config import LOOPBACK_NETWORK, nano_config
    from tests.support.swarm import assert_one_model, run_to_end

    cfg = nano_config(tmp_path, run_id="testbed-3", seed=3, total_steps=12, eval_every=6,
                      codec={"name": "int4"},
                      network={**LOOPBACK_NETWORK, "bandwidth_mbps": 50.0})
    names = ["bootstrap", "node-0", "node-1", "node-2"]
    started: dict[str, str] = {}
    with swarm_on_testbed(cfg, 3, rate_mbit=50) as (bed, swarm):
        assert isinstance(swarm.placement, SwarmHosts) and bed.hosts["bootstrap"].rate_mbit is None
        end = run_to_end(swarm, on_event=lambda name, ev: started.update(
            {name: ev["data_addr"]}) if ev.get("event") == "started" else None)
        addrs = {n: bed.addr(n) for n in names}
    summaries = end.summaries
    assert all(code == 0 for code in end.codes)
    # each node's data plane listened on its own namespace's address, not loopback
    assert {n: a.rsplit(":", 1)[0] for n, a in started.items()} == \
        {n: addrs[n] for n in names[1:]}
    assert sorted(summaries) == names[1:]
    assert_one_model(summaries)
    for s in summaries.values():
        assert s["skipped_rounds"] == 0, s["dropped_peers"]
        # 2 rounds each, plus the end-of-run round of fragments 0 and 1
        assert s["rounds_per_fragment"] == {"0": 3, "1": 3, "2": 2}
        assert s["bytes_sent"] > 0


# A TCP listener that prints the address of the first client, and a client that connects
# (3 s) and prints "ok" or why not; both run inside test bed hosts.
_WHO = """
import socket, sys
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
s.settimeout(float(sys.argv[3]))
print(s.accept()[1][0], flush=True)
"""
_DIAL = """
import socket, sys, time
deadline = time.monotonic() + 10
while True:
    try:
        socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close()
        print("ok")
        break
    except ConnectionRefusedError:  # the listener is still starting: retry
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
    except OSError as exc:
        print(type(exc).__name__)
        break
"""


def _dial(bed: Testbed, src: str, addr: str, port: int = 7100) -> str:
    return _dials(bed, [(src, addr)], port)[0]


def _dials(bed: Testbed, pairs: list[tuple[str, str]], port: int = 7100) -> list[str]:
    """Each (host, address) dial's outcome, the dials made at once: one that times out
    waits its whole connect timeout, and the next need not wait for it."""
    procs = [bed.popen(src, [sys.executable, "-c", _DIAL, addr, str(port)],
                       stdout=subprocess.PIPE, text=True) for src, addr in pairs]
    try:
        outs = [p.communicate(timeout=20)[0].strip() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=5)
    assert [p.returncode for p in procs] == [0] * len(procs), outs
    return outs


@pytest.mark.timeout(120)
def test_nat_hosts_dial_out_from_their_router_and_cannot_be_dialled():
    if (why := unavailable_reason(nat=True)) is not None:
        pytest.skip(why)
    with Testbed(["pub", "home", "away"], rate_mbit=20, nat=["home", "away"]) as bed:
        tag = bed.tag
        home, away = bed.hosts["home"], bed.hosts["away"]
        assert home.router and home.addr.startswith("192.168.") and not bed.hosts["pub"].router
        assert bed.public_addr("home") == home.wan_addr != home.addr
        assert bed.natted() == ["home", "away"]
        # out through the router: the public host sees the router's address
        who = bed.popen("pub", [sys.executable, "-c", _WHO, bed.addr("pub"), "7100", "20"],
                        stdout=subprocess.PIPE, text=True)
        assert _dial(bed, "home", bed.addr("pub")) == "ok"
        assert who.communicate(timeout=20)[0].strip() == bed.public_addr("home")
        # in: nothing reaches a NATed host, neither at its private address nor at its
        # router's; the bed drops the SYNs, as the internet does (a timeout, not a refusal)
        listener = bed.popen("home", [sys.executable, "-c", _WHO, "0.0.0.0", "7100", "30"],
                             stdout=subprocess.PIPE, text=True)
        try:
            unreachable = [("pub", home.addr), ("pub", bed.public_addr("home")),
                           ("away", home.addr), ("away", bed.public_addr("home"))]
            assert _dials(bed, unreachable) == ["TimeoutError"] * 4, unreachable
            assert _dial(bed, "home", bed.addr("home")) == "ok"  # it was listening
            assert listener.communicate(timeout=10)[0].strip() == home.addr
        finally:
            listener.kill()
            listener.wait(timeout=5)
        # the host's cap sits on its LAN link
        assert 0.8 * 20 <= measure_mbit(bed, "away", "pub", 4_000_000) <= 1.05 * 20
        routers = [home.router, away.router]
        assert all(r in leftovers([tag]) for r in routers)
    assert leftovers([tag]) == []
