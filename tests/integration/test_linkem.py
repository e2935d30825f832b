"""The link emulator (testbed/linkem.c) over a datagram socket pair instead of a TUN device:
holds for the delays of both ends, never reorders a flow under jitter, loses within binomial
bounds, prints its counters on SIGUSR1 and at exit, and is rebuilt only when its source
changes. Needs no root, only a C compiler; skipped with the reason otherwise.

Timing bounds: a packet can never leave early, so lower bounds are tight; upper bounds
allow for a 2-core machine shared with other work (the process here is not realtime).
"""

from __future__ import annotations

import json
import math
import signal
import socket
import statistics
import struct
import subprocess
import time
from collections.abc import Iterator

import pytest

from testbed import linkem
from testbed.linkem import LinkEmulator, LinkSpec

REASON = linkem.unavailable_reason(tun=False)
pytestmark = [pytest.mark.host_network,
              pytest.mark.skipif(REASON is not None, reason=REASON or "")]
A, B, OTHER = "10.9.0.1", "10.9.0.2", "10.9.0.77"
LATE_MS = 30.0  # how late a packet may come back on a loaded machine


def packet(src: str, dst: str, seq: int) -> bytes:
    """An IPv4 header (all the emulator reads) and a body holding `seq` and the send time."""
    body = struct.pack("!Id", seq, time.perf_counter())
    return struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(body), seq & 0xFFFF, 0, 64, 17, 0,
                       socket.inet_aton(src), socket.inet_aton(dst)) + body


def receive(sock: socket.socket, n: int) -> list[tuple[str, int, float]]:
    """`n` packets back: (source, seq, milliseconds held)."""
    got = []
    for _ in range(n):
        data = sock.recv(2048)
        seq, sent = struct.unpack("!Id", data[20:32])
        got.append((socket.inet_ntoa(data[12:16]), seq, (time.perf_counter() - sent) * 1e3))
    return got


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    ours.settimeout(5)
    yield ours, theirs
    ours.close()
    theirs.close()


def emulator(theirs: socket.socket, links: dict[str, LinkSpec], seed: int = 1) -> LinkEmulator:
    emu = LinkEmulator(fd=theirs.fileno(), links=links, seed=seed, slots=1 << 15,
                       realtime=False).start()
    theirs.close()  # the emulator holds its own copy
    return emu


@pytest.mark.timeout(30)
def test_a_packet_is_held_the_delays_of_both_ends(pair):
    ours, theirs = pair
    emu = emulator(theirs, {A: LinkSpec(delay_ms=30), B: LinkSpec(delay_ms=20)})
    try:
        for src, dst in [(A, B)] * 10 + [(B, A)] * 10 + [(OTHER, A)] * 10:
            ours.send(packet(src, dst, 0))
        got = receive(ours, 30)
    finally:
        final = emu.close()
    held = {src: [ms for s, _, ms in got if s == src] for src in (A, B, OTHER)}
    for src, want in ((A, 50.0), (B, 50.0), (OTHER, 30.0)):  # an unknown address adds 0
        assert min(held[src]) >= want, (src, held[src])
        assert statistics.median(held[src]) <= want + LATE_MS, (src, held[src])
    assert final is not None and final["sent"] == final["packets"] == 30
    assert final["queue_peak"] >= 10 and final["drops"] == 0


@pytest.mark.timeout(30)
def test_jitter_spreads_holds_but_never_reorders_a_flow(pair):
    ours, theirs = pair
    emu = emulator(theirs, {A: LinkSpec(delay_ms=10), B: LinkSpec(delay_ms=20, jitter_ms=15)})
    try:
        for seq in range(200):  # one flow, A to B
            ours.send(packet(A, B, seq))
        flow = receive(ours, 200)
        # 100 flows of one packet each: no earlier packet of theirs holds them back
        for i in range(100):
            ours.send(packet(f"10.8.0.{i + 1}", B, i))
        spread = receive(ours, 100)
    finally:
        emu.close()
    assert [seq for _, seq, _ in flow] == list(range(200))
    assert min(ms for *_, ms in flow) >= 30 - 15
    holds = [ms for *_, ms in spread]
    assert min(holds) >= 20 - 15 and max(holds) <= 20 + 15 + LATE_MS
    assert max(holds) - min(holds) >= 15, holds  # uniform in 5..35 ms: it does spread


@pytest.mark.timeout(30)
def test_losses_fall_within_binomial_bounds(pair):
    ours, theirs = pair
    loss_a, loss_b = 0.05, 0.02
    emu = emulator(theirs, {A: LinkSpec(loss=loss_a), B: LinkSpec(loss=loss_b)}, seed=11)
    try:
        for seq in range(10_000):
            ours.send(packet(A, B, seq))  # blocks while the emulator is behind
        stats = emu.stats()
    finally:
        emu.close()
    n = stats["packets"]
    p = 1 - (1 - loss_a) * (1 - loss_b)  # either access link loses it
    sigma = math.sqrt(n * p * (1 - p))
    assert n == 10_000
    assert abs(stats["drops"] - n * p) <= 5 * sigma, (stats["drops"], n * p, sigma)


@pytest.mark.timeout(30)
def test_set_changes_a_host_while_it_runs(pair):
    ours, theirs = pair
    emu = emulator(theirs, {A: LinkSpec(delay_ms=5)})
    try:
        emu.set(B, LinkSpec(delay_ms=40))
        ours.send(packet(A, B, 0))
        [(_, _, held)] = receive(ours, 1)
        with pytest.raises(linkem.LinkemError):
            emu.set("not-an-address", LinkSpec())
        assert emu.stats(reset=True)["packets"] == 1
        assert emu.stats()["packets"] == 0 and emu.stats()["hosts"] == 2
    finally:
        emu.close()
    assert held >= 45


@pytest.mark.timeout(30)
def test_counters_on_sigusr1_and_at_exit(pair):
    ours, theirs = pair
    argv = [str(linkem.binary()), "--fd", str(theirs.fileno()), "--slots", "64",
            "--host", f"{A},0,0,0"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, pass_fds=[theirs.fileno()])
    try:
        assert json.loads(proc.stdout.readline())["event"] == "ready"
        for seq in range(5):
            ours.send(packet(A, B, seq))
        receive(ours, 5)
        proc.send_signal(signal.SIGUSR1)
        stats = json.loads(proc.stdout.readline())
        proc.send_signal(signal.SIGTERM)
        final = json.loads(proc.stdout.readline())
        assert proc.wait(timeout=5) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
    assert stats["event"] == "stats" and stats["packets"] == stats["sent"] == 5
    assert stats["bytes"] == 5 * len(packet(A, B, 0))
    assert final["event"] == "exit" and final["packets"] == 5


@pytest.mark.timeout(30)
def test_the_binary_is_built_once_per_source(tmp_path, monkeypatch):
    first = linkem.binary(tmp_path)
    mtime = first.stat().st_mtime_ns
    assert linkem.binary(tmp_path) == first and first.stat().st_mtime_ns == mtime
    changed = tmp_path / "linkem.c"
    changed.write_text(linkem.SOURCE.read_text() + "\n/* another build */\n")
    monkeypatch.setattr(linkem, "SOURCE", changed)
    second = linkem.binary(tmp_path)
    assert second != first and second.exists() and first.exists()
