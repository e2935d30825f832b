"""The WAN test bed (testbed/hosts.py): tbf limits hold, teardown leaves nothing behind (also
when its owner is SIGTERMed or SIGKILLed), and 3 nodes train across namespaces; with the
link emulator, round trips, a bulk transfer's rate and losses are the ones asked.

Needs root, `ip` and `tc`, the emulator also a C compiler and /dev/net/tun; skipped with
the reason otherwise.
"""

from __future__ import annotations

import json
import math
import select
import signal
import statistics
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
pytestmark = [pytest.mark.slow, pytest.mark.host_network,
              pytest.mark.skipif(REASON is not None, reason=REASON or "")]
DELAY_REASON = unavailable_reason(delay=True)
needs_emulator = pytest.mark.skipif(DELAY_REASON is not None, reason=DELAY_REASON or "")
ROOT = Path(__file__).parents[2]

# A child that builds a test bed (its keyword arguments: argv[1], JSON), starts a long-lived
# process inside host h0, prints the tag, that process's pid and the emulator's (0: none),
# then waits to be signalled.
OWNER = """
import json, subprocess, sys, threading
from testbed.hosts import Testbed
bed = Testbed(2, rate_mbit=10, **json.loads(sys.argv[1])).start()
inner = bed.popen("h0", [sys.executable, "-c", "import threading; threading.Event().wait()"])
print(bed.tag, inner.pid, bed.linkem.proc.pid if bed.linkem else 0, flush=True)
threading.Event().wait()
"""


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise AssertionError(f"no output within {timeout} s")
    return proc.stdout.readline()


def _start_owner(**bed_args: object) -> tuple[subprocess.Popen, str, int, int]:
    proc = subprocess.Popen([sys.executable, "-c", OWNER, json.dumps(bed_args)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    tag, inner, emulator = _readline(proc, 30).split()
    assert leftovers([tag]), "the test bed was not built"
    return proc, tag, int(inner), int(emulator)


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
def test_idle_restart_is_set_per_host_namespace():
    def idle(bed: Testbed, name: str) -> str:
        got = bed.run(name, ["sysctl", "-n", "net.ipv4.tcp_slow_start_after_idle"],
                      timeout=10, check=True, capture_output=True, text=True)
        return got.stdout.strip()

    with Testbed(["a", "b"], rate_mbit=20) as bed:
        assert (idle(bed, "a"), idle(bed, "b")) == ("1", "1")  # a fresh namespace: Linux's
        bed.set_idle_restart("a", False)
        assert (idle(bed, "a"), idle(bed, "b")) == ("0", "1")
        bed.set_idle_restart("a", True)
        assert idle(bed, "a") == "1"


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
    proc, tag, inner, _ = _start_owner()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM  # the default disposition still acts
    assert leftovers([tag]) == []
    assert not pid_alive(inner)


@pytest.mark.timeout(60)
def test_sweep_removes_what_a_sigkilled_owner_left():
    proc, tag, inner, _ = _start_owner()
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


# The link emulator. Ping: argv[2] + 1 ICMP echoes to argv[1], one at a time, each timed
# from just before its send to the kernel's receive timestamp of its reply (SO_TIMESTAMPNS,
# 35), so neither end's wakeup latency on a busy machine counts (the kernel answers
# echoes); the first, which also resolves the neighbour, is left out. Round trips in ms.
_PING = """
import json, os, socket, struct, sys, time
def checksum(b):
    total = sum(struct.unpack(f"!{len(b) // 2}H", b))
    total = (total >> 16) + (total & 0xFFFF)
    return ~(total + (total >> 16)) & 0xFFFF
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
s.setsockopt(socket.SOL_SOCKET, 35, 1)
s.settimeout(5)
ident, body, rtts = os.getpid() & 0xFFFF, b"dilonode" * 4, []
for seq in range(int(sys.argv[2]) + 1):
    head = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
    msg = struct.pack("!BBHHH", 8, 0, checksum(head + body), ident, seq) + body
    sent = time.time_ns()
    s.sendto(msg, (sys.argv[1], 0))
    while True:  # a raw socket sees every ICMP message to this host
        data, anc, _, _ = s.recvmsg(2048, 256)
        ihl = (data[0] & 15) * 4
        kind, _, _, rid, rseq = struct.unpack("!BBHHH", data[ihl:ihl + 8])
        if (kind, rid, rseq) == (0, ident, seq):
            break
    [(sec, nsec)] = [struct.unpack("qq", d[:16]) for _, t, d in anc if t == 35]
    if seq:
        rtts.append((sec * 10**9 + nsec - sent) / 1e6)
print(json.dumps(rtts))
"""


def _round_trips(bed: Testbed, src: str, dst: str, n: int = 20) -> list[float]:
    """`n` ping round trips in ms from host `src` to `dst` (at its public address)."""
    out = bed.run(src, [sys.executable, "-c", _PING, bed.public_addr(dst), str(n)],
                  timeout=30, check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


# Datagrams to a port nobody listens on (argv[1], argv[2] of them).
_BLAST = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(int(sys.argv[2])):
    s.sendto(b"x" * 64, (sys.argv[1], 9))
"""


# One TCP connection to argv[1]:argv[2]; prints its handshake's round trip (s) and what
# network.tcp_congestion = "auto" asks for on it.
_HANDSHAKE = """
import json, socket, sys
from dilonode.net import congestion
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
rtt = congestion.handshake_rtt(s)
print(json.dumps([rtt, congestion.pick(rtt)]))
"""
_LISTEN = """
import socket
with socket.create_server(("0.0.0.0", 7300)) as server:
    print("ready", flush=True)
    server.settimeout(20)
    server.accept()[0].close()
"""


def _handshake(bed: Testbed, src: str, dst: str) -> tuple[float, str]:
    """The round trip a TCP handshake from host `src` to `dst` measured, and the pick."""
    listener = bed.popen(dst, [sys.executable, "-c", _LISTEN], stdout=subprocess.PIPE,
                         text=True)
    try:
        assert _readline(listener, 20).strip() == "ready"
        out = bed.run(src, [sys.executable, "-c", _HANDSHAKE, bed.addr(dst), "7300"],
                      timeout=30, check=True, capture_output=True, text=True, cwd=ROOT)
        listener.wait(timeout=20)
    finally:
        listener.kill()
    rtt, pick = json.loads(out.stdout)
    return rtt, pick


@needs_emulator
@pytest.mark.timeout(60)
def test_round_trips_are_twice_the_one_way_delays_of_both_ends():
    with Testbed(["a", "b", "c"], delays={"a": 10.0, "b": 80.0}) as bed:
        tag, emulator = bed.tag, bed.linkem.proc.pid
        assert bed.emulator_ns in leftovers([tag])
        near = _round_trips(bed, "a", "c")  # 2 (10 + 0) ms
        far = _round_trips(bed, "b", "c")  # 2 (80 + 0) ms
        # network.tcp_congestion = "auto" reads the same round trip off a TCP handshake
        handshake, pick = _handshake(bed, "b", "c")
        assert abs(handshake - 0.160) <= 0.016 and pick == "bbr", (handshake, pick)
        bed.set_link("c", delay_ms=5.0)
        changed = _round_trips(bed, "a", "c")  # 2 (10 + 5) ms
        stats = bed.link_stats()
    for rtts, want in ((near, 20.0), (far, 160.0), (changed, 30.0)):
        assert abs(statistics.median(rtts) - want) <= 0.1 * want, (want, rtts)
        assert min(rtts) >= want  # the emulator never releases early
    assert stats["drops"] == 0 and stats["sent"] >= 3 * 2 * 20
    assert leftovers([tag]) == [] and not pid_alive(emulator)
    assert bed.link_stats()["event"] == "exit"  # the last counters outlive the bed


@needs_emulator
@pytest.mark.timeout(60)
def test_a_bulk_transfer_through_rate_and_delay_gets_the_rate():
    rate, one_way = 20.0, 40.0  # Mbit/s; ms, half on each end
    bdp = int(rate * 1e6 / 8 * 2 * one_way / 1e3)  # bytes in flight over the round trip
    with Testbed(["a", "b"], rate_mbit=rate, delays={"a": one_way / 2, "b": one_way / 2}) as bed:
        # 9 s at the rate; counted after 2 s, well past slow start at an 80 ms round trip
        got = measure_mbit(bed, "a", "b", int(rate * 1e6 / 8 * 9), timeout=40,
                           sockbuf=4 * bdp, skip_s=2.0)
        stats = bed.link_stats()
    assert 0.9 * rate <= got <= 1.1 * rate, got
    # one way's worth of the stream sat in the emulator at once: the delay was applied
    assert stats["queue_peak_bytes"] >= 0.5 * bdp / 2, stats


@needs_emulator
@pytest.mark.timeout(60)
def test_loss_on_one_link_drops_its_share_of_the_packets():
    loss = 0.01
    with Testbed(["a", "b"], loss={"a": loss}, seed=5) as bed:
        # every packet crosses a's link (b's answers too), lost there or not
        bed.run("a", [sys.executable, "-c", _BLAST, bed.addr("b"), "20000"], timeout=30,
                check=True)
        stats = bed.link_stats()
    n = stats["packets"] - stats["other"]
    sigma = math.sqrt(n * loss * (1 - loss))
    # 5 sigma: a correct emulator fails this about once in 1.7 million runs
    assert n >= 20_000 and abs(stats["drops"] - n * loss) <= 5 * sigma, (stats, n * loss)
    assert stats["overflow"] == 0


@needs_emulator
@pytest.mark.timeout(90)
def test_nat_hosts_work_behind_the_emulator():
    if (why := unavailable_reason(nat=True)) is not None:
        pytest.skip(why)
    with Testbed(["pub", "home"], nat=["home"], delays={"pub": 15.0, "home": 25.0}) as bed:
        rtts = _round_trips(bed, "home", "pub")  # out through its router: 2 (15 + 25) ms
        listener = bed.popen("home", [sys.executable, "-c", _WHO, "0.0.0.0", "7100", "30"],
                             stdout=subprocess.PIPE, text=True)
        try:  # and in, still nothing gets through
            assert _dials(bed, [("pub", bed.public_addr("home"))]) == ["TimeoutError"]
        finally:
            listener.kill()
            listener.wait(timeout=5)
    assert abs(statistics.median(rtts) - 80.0) <= 8.0, rtts


@needs_emulator
@pytest.mark.timeout(60)
def test_sweep_removes_the_emulator_a_sigkilled_owner_left():
    proc, tag, inner, emulator = _start_owner(delays={"h0": 5.0})
    assert emulator and pid_alive(emulator)
    proc.kill()
    proc.wait(timeout=10)
    removed = sweep()
    assert any(name.endswith("-linkem") for name in removed), removed
    assert leftovers([tag]) == []
    assert not pid_alive(inner) and not pid_alive(emulator)
