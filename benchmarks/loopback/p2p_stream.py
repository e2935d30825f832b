"""Bulk transfer: a libp2p stream through hivemind's p2pd against a direct asyncio TCP
connection (with and without dilonode's per-frame MAC), on 127.0.0.1, in the same run.

    .venv/bin/python -m benchmarks.loopback.p2p_stream                   # 256 MiB x 3 per method
    .venv/bin/python -m benchmarks.loopback.p2p_stream --mib 64 --repeats 5 --json out.json

Each transfer is --mib MiB of random bytes cut into --frame-kib KiB frames (4-byte length
prefix + body), written by one asyncio task and read back frame by frame by another, which
answers one byte when it has everything; the time is from the first write to that answer.
Both ends live in this process on one event loop for every method, so the Python-side cost
is the same and only the path differs:

* `p2pd stream`: two `hivemind.p2p.P2P` daemons (go-libp2p, TCP + noise/yamux) connected on
  loopback; the bytes go Python -> unix socket -> p2pd -> TCP -> p2pd -> unix socket ->
  Python (`call_binary_stream_handler` / `add_binary_stream_handler`).
* `direct TCP`: `asyncio.open_connection` to an `asyncio.start_server` socket.
* `direct TCP + MAC`: the same, plus the 16-byte tag the data plane writes after every frame
  (`FrameSealer`) and its check on the receiving side.

Besides wall time, each transfer's CPU time is taken from /proc: this process plus, for the
p2pd path, both daemons, because on a shared machine the all-reduce competes for cores.

The table also shows the keyed MAC's raw speed on one core and the cost of one
authenticated handshake (RSA-2048 signatures both ways, X25519), measured in memory.
Methods take turns within each of the --repeats rounds (one unmeasured warm-up transfer
each first); the table shows the median MB/s per method and the median over repeats of its
throughput relative to the direct TCP transfer of the same repeat.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hmac
import os
import platform
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from benchmarks.harness.results import write_json
from benchmarks.harness.timing import median_seconds
from dilonode.net.auth import Credentials, Identity
from dilonode.net.channel import TAG_BYTES, FrameSealer, InboundChannel, OutboundHandshake
from dilonode.wire.framing import HEADER_BYTES

__all__ = ["main", "parse_args"]

_KEY = bytes(range(32))
_ANSWER_TIMEOUT = 300.0  # seconds for one whole transfer, however slow the machine


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256, help="MiB per transfer")
    p.add_argument("--frame-kib", type=int, default=1024, help="KiB per frame")
    p.add_argument("--repeats", type=int, default=3, help="measured transfers per method")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if args.mib < 1 or args.frame_kib < 1 or args.repeats < 1:
        p.error("--mib, --frame-kib and --repeats must be >= 1")
    if args.mib * 1024 % args.frame_kib:
        p.error("--mib must be a whole number of frames")
    return args


# ---------------------------------------------------------------------- one transfer


async def _send(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, frames: int,
                body: bytes, mac: bool) -> None:
    frame = len(body).to_bytes(HEADER_BYTES, "big") + body
    sealer = FrameSealer(_KEY) if mac else None
    for _ in range(frames):
        writer.write(frame)
        if sealer is not None:
            writer.write(sealer.seal(frame))
        await writer.drain()
    await reader.readexactly(1)


async def _receive(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, frames: int,
                   mac: bool) -> None:
    check = FrameSealer(_KEY) if mac else None  # the same tags, computed independently
    for _ in range(frames):
        head = await reader.readexactly(HEADER_BYTES)
        body = await reader.readexactly(int.from_bytes(head, "big"))
        if check is not None:
            tag = await reader.readexactly(TAG_BYTES)
            if not hmac.compare_digest(check.seal(head, body), tag):
                raise RuntimeError("MAC mismatch")
    writer.write(b"k")
    await writer.drain()


Opener = Callable[[Callable[..., Awaitable[None]]],
                  Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


def _cpu_seconds(pids: list[int]) -> float:
    """CPU time of this process plus the given child processes (Linux /proc)."""
    total = time.process_time()
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


async def _timed(open_pair: Opener, frames: int, body: bytes, mac: bool,
                 pids: list[int]) -> tuple[float, float]:
    """(wall s, CPU s of this process and `pids`) for one transfer over a fresh stream
    made by `open_pair(server_handler)`."""
    done = asyncio.get_running_loop().create_future()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await _receive(reader, writer, frames, mac)
            done.set_result(None)
        except Exception as exc:  # reported to the sender's side below
            done.set_exception(exc)

    reader, writer = await open_pair(serve)
    t0, cpu0 = time.perf_counter(), _cpu_seconds(pids)
    await asyncio.wait_for(_send(reader, writer, frames, body, mac), _ANSWER_TIMEOUT)
    elapsed, cpu = time.perf_counter() - t0, _cpu_seconds(pids) - cpu0
    await asyncio.wait_for(done, 5.0)
    writer.close()
    return elapsed, cpu


# ---------------------------------------------------------------------- the two paths


async def _tcp_opener() -> tuple[Opener, Callable[[], Awaitable[None]], list[int]]:
    handlers: list[Callable[..., Awaitable[None]]] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await handlers.pop(0)(reader, writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0, limit=1 << 20)
    port = server.sockets[0].getsockname()[1]

    async def open_pair(handler: Callable[..., Awaitable[None]]) -> Any:
        handlers.append(handler)
        return await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port, limit=1 << 20), 10.0)

    async def close() -> None:
        server.close()
        await asyncio.wait_for(server.wait_closed(), 5.0)

    return open_pair, close, []


async def _p2pd_opener() -> tuple[Opener, Callable[[], Awaitable[None]], list[int]]:
    from dilonode.swarm.hivemind_process import import_hivemind

    hivemind = import_hivemind()
    P2P = hivemind.p2p.P2P
    host = ["/ip4/127.0.0.1/tcp/0"]
    server = await asyncio.wait_for(P2P.create(host_maddrs=host), 60.0)
    maddrs = await server.get_visible_maddrs()
    client = await asyncio.wait_for(P2P.create(host_maddrs=host, initial_peers=maddrs), 60.0)
    handlers: list[Callable[..., Awaitable[None]]] = []

    async def on_stream(_info: Any, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter) -> None:
        await handlers.pop(0)(reader, writer)

    await server.add_binary_stream_handler("dilonode-bench", on_stream)

    async def open_pair(handler: Callable[..., Awaitable[None]]) -> Any:
        handlers.append(handler)
        _, reader, writer = await asyncio.wait_for(
            client.call_binary_stream_handler(server.peer_id, "dilonode-bench"), 30.0)
        return reader, writer

    async def close() -> None:
        for p2p in (client, server):
            await asyncio.wait_for(p2p.shutdown(), 10.0)

    return open_pair, close, [p2p._child.pid for p2p in (client, server)]


# ---------------------------------------------------------------------- in-memory figures


def _mac_speed(frame_bytes: int, seconds: float = 1.0) -> float:
    """MB/s of `FrameSealer.seal` over frames of `frame_bytes` on one core."""
    frame, sealer, n = os.urandom(frame_bytes), FrameSealer(_KEY), 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        sealer.seal(frame)
        n += 1
    return n * frame_bytes / (time.perf_counter() - t0) / 1e6


def _handshake_ms(repeats: int = 20) -> float:
    """Median ms for one authenticated handshake, both sides' work, in memory."""
    a = Credentials(Identity.generate(), "bench", b"s" * 32)
    b = Credentials(Identity.generate(), "bench", b"s" * 32)

    def handshake() -> None:
        out = OutboundHandshake(a, "bench", a.peer_id, b.peer_id)
        inn = InboundChannel(b, "bench", b.peer_id, max_frame_bytes=1 << 20)
        list(inn.feed(out.hello_frame()))
        auth, _ = out.on_ack(inn.outgoing.pop()[HEADER_BYTES:])
        list(inn.feed(auth))
        assert inn.peer_id == a.peer_id

    return median_seconds(handshake, repeats, warmup=0) * 1e3


# ---------------------------------------------------------------------- main


async def _measure(args: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    """Seconds per transfer and method. Methods take turns within each repeat, so load
    from other processes on a shared machine falls on all of them alike."""
    body = os.urandom(args.frame_kib * 1024)
    frames = args.mib * 1024 // args.frame_kib
    methods = (("p2pd stream", _p2pd_opener, False), ("direct TCP", _tcp_opener, False),
               ("direct TCP + MAC", _tcp_opener, True))
    opened = []
    try:
        for name, make, mac in methods:
            open_pair, close, pids = await make()
            opened.append((name, open_pair, close, mac, pids))
            await _timed(open_pair, max(1, frames // 8), body, mac, pids)  # warm-up
        out: dict[str, list[tuple[float, float]]] = {name: [] for name, *_ in opened}
        for _ in range(args.repeats):
            for name, open_pair, _, mac, pids in opened:
                out[name].append(await _timed(open_pair, frames, body, mac, pids))
    finally:
        for _, _, close, _, _ in opened:
            await close()
    for name, runs in out.items():
        print(f"  {name}: " + ", ".join(f"{t:.2f}s ({c:.2f} cpu-s)" for t, c in runs),
              flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"{args.mib} MiB in {args.frame_kib} KiB frames, {args.repeats} transfers per method")
    runs = asyncio.run(_measure(args))
    times = {name: [t for t, _ in r] for name, r in runs.items()}
    nbytes = args.mib * (1 << 20)
    rows = {name: nbytes / statistics.median(t) / 1e6 for name, t in times.items()}
    # Ratio per repeat (the methods ran back to back), then the median of those.
    ratios = {name: statistics.median(b / a for a, b in zip(t, times["direct TCP"],
                                                            strict=True))
              for name, t in times.items()}
    cpu_per_gb = {name: statistics.median(c for _, c in r) / (nbytes / 1e9)
                  for name, r in runs.items()}
    print("\n| path | MB/s (median) | throughput vs direct TCP (median of per-repeat "
          "ratios) | CPU s per GB (all processes) |\n|---|---|---|---|")
    for name, mbs in rows.items():
        print(f"| {name} | {mbs:.0f} | {ratios[name]:.2f}x | {cpu_per_gb[name]:.2f} |")
    mac = _mac_speed(args.frame_kib * 1024)
    hs = _handshake_ms()
    print(f"\nkeyed MAC (FrameSealer) on one core: {mac:.0f} MB/s; "
          f"authenticated handshake: {hs:.1f} ms (both sides, in memory)")
    write_json(args.json, {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus {platform.platform()}",
        "args": {k: str(v) for k, v in vars(args).items()}, "seconds": times,
        "cpu_s_per_gb": cpu_per_gb,
        "mb_per_s": rows, "ratio_vs_direct_tcp": ratios, "mac_mb_per_s": mac,
        "handshake_ms": hs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
