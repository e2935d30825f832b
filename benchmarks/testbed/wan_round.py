"""Rounds against the line rate: butterfly all-reduce rounds between the hosts of the WAN
test bed (testbed/hosts.py, `tbf` on both ends of every link), per TCP congestion control,
link delay and socket buffer.

    sudo .venv/bin/python -m benchmarks.testbed.wan_round --rates 20,100 --cc system,cubic,reno \
        --passes 2 --json runs/bench/wan_round.json
    sudo .venv/bin/python -m benchmarks.testbed.wan_round --rates 100 --delays 100 --cc cubic \
        --sockbuf 4194304,auto --numel 40000000 --json runs/bench/wan_round_fat.json

`--delays` are one-way path delays in ms (the link emulator, half on each host's access
link: a round trip is twice the delay) and `--loss` the share of packets each host's access
link drops (a path crosses two); `--sockbuf` the plane's `socket_buffer_bytes`
("auto": `sockbuf.bdp_bytes` of the rate, as a node's "auto" sets it). The ideal with
delay adds the two one-way delays a butterfly round cannot avoid (its reduce-scatter
and all-gather each cross the path once).

Each host runs one process with a `DataPlane` whose connections use the named congestion
control (`network.tcp_congestion`; "system" leaves the kernel's default). Round r starts
at the same wall-clock instant on every host (the hosts share this machine's clock), so
matchmaking is not part of it; a round's time is its slowest member's, from its start to
its result. The ideal is the bytes one member sends, 2 (N-1)/N x the encoded tensor, at the
line rate. "retransmitted" is the TCP segments the hosts sent again during the measured
rounds (each host's namespace counts only its own process's traffic) per full-size segment
of the round bytes they sent; a segment the sender's own queue dropped costs no link time,
one lost at the receiver's end does. Passes
alternate the congestion controls, so each sees the box in the same state.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import ROOT, module_argv
from benchmarks.harness.args import floats, names
from benchmarks.harness.results import write_json
from dilonode.algo.codec_table import CODEC_NAMES
from testbed.hosts import Testbed, unavailable_reason

DEFAULT_HOSTS = 4
PORT = 7100
_COUNTERS = ("OutSegs", "RetransSegs")
_MSS = 1448  # payload bytes of a full segment on the bed's 1500-byte veth links


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="20,100", help="link rates, Mbit/s, comma-separated")
    p.add_argument("--delays", default="0", help="one-way path delays, ms, comma-separated")
    p.add_argument("--loss", type=float, default=0.0,
                   help="packet loss on every host's access link (the link emulator)")
    p.add_argument("--sockbuf", default="4194304",
                   help="socket buffer bytes, comma-separated ('auto': from the rate; 0: autotune)")
    p.add_argument("--hosts", type=int, default=DEFAULT_HOSTS)
    p.add_argument("--idle-restart", default="1,0",
                   help="net.ipv4.tcp_slow_start_after_idle in the hosts' namespaces, "
                        "comma-separated (1: the kernel's default, cwnd restarts after idle)")
    p.add_argument("--cc", default="system,cubic",
                   help="congestion controls, comma-separated ('system': the kernel's default)")
    p.add_argument("--numel", type=int, default=2_300_000,
                   help="values per round (a third of the `small` preset: one fragment)")
    p.add_argument("--codec", default="int4", choices=CODEC_NAMES)
    p.add_argument("--rounds", type=int, default=8, help="measured rounds per setting")
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--json", type=Path)
    p.add_argument("--worker", help=argparse.SUPPRESS)  # one host's process: its JSON job
    return p.parse_args(argv)


def _tcp_counters() -> dict[str, int]:
    """This network namespace's TCP segment counters (/proc/net/snmp)."""
    with open("/proc/net/snmp") as f:
        lines = f.read().splitlines()
    for head, values in zip(lines[::2], lines[1::2], strict=False):
        if head.startswith("Tcp:"):
            row = dict(zip(head.split()[1:], values.split()[1:], strict=True))
            return {k: int(row[k]) for k in _COUNTERS}
    raise RuntimeError("no Tcp line in /proc/net/snmp")


async def _reachable(host: str, port: int, deadline: float) -> None:
    """Return once (host, port) accepts a TCP connection; RuntimeError past `deadline`."""
    while True:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5.0)
            writer.close()
            return
        except (OSError, TimeoutError):
            if time.time() > deadline:
                raise RuntimeError(f"{host}:{port} did not listen in time") from None
            await asyncio.sleep(0.2)  # a retry interval, not a synchronisation


def _worker(rank: int, addrs: list[str], cc: str, sockbuf: int, numel: int, codec: str,
            rounds: int, period: float, t0: float, out_dir: str) -> None:
    import torch
    import uvloop

    from dilonode.algo.butterfly import round_chunk_numel
    from dilonode.allreduce.driver import run_round
    from dilonode.allreduce.plane_limits import PlaneLimits
    from dilonode.allreduce.round import GroupSpec, RoundState, group_digest
    from dilonode.allreduce.transport import DataPlane
    from dilonode.config import DEFAULT_CHUNK_NUMEL

    torch.set_num_threads(1)
    world = len(addrs)
    members = tuple(f"h{i}" for i in range(world))
    chunk = round_chunk_numel(numel, world, DEFAULT_CHUNK_NUMEL, 64)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))

    async def main() -> list[dict[str, Any]]:
        async with DataPlane(members[rank], "wan-round", host=addrs[rank], port=PORT,
                             limits=PlaneLimits(tcp_congestion=cc,
                                               socket_buffer_bytes=sockbuf)) as plane:
            peers = {i: f"{a}:{PORT}" for i, a in enumerate(addrs) if i != rank}
            # Round 0 waits for every peer's listener: a loaded box starts them seconds apart.
            for a in addrs:
                await _reachable(a, PORT, deadline=time.time() + 90)
            rows = []
            before = _tcp_counters()
            for r in range(rounds + 1):  # round 0 opens the connections: not counted
                start = t0 + r * period
                await asyncio.sleep(max(0.0, start - time.time()))
                spec = GroupSpec(run_id="wan-round", fragment=0, round=r, members=members,
                                 weights=(1.0,) * world, numel=numel, codec=codec,
                                 block_size=64, chunk_numel=chunk,
                                 group_digest=group_digest(members))
                began = time.time()
                res = await run_round(plane, spec, rank, x, peers, timeout=max(60.0, period))
                if res.state is not RoundState.DONE:
                    raise RuntimeError(f"round {r}: {res.failure}")
                rows.append({"wall": time.time() - began, "late": began - start,
                             "sent": res.bytes_sent, "digest": res.digest})
                if r == 0:
                    before = _tcp_counters()
            after = _tcp_counters()
            rows[0]["tcp"] = {k: after[k] - before[k] for k in _COUNTERS}
            return rows

    rows = uvloop.run(main())
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(rows))


def _setting(bed: Testbed, rate: float, delay_ms: float, cc: str, sockbuf: int,
             args: argparse.Namespace) -> dict[str, Any]:
    from dilonode.algo.codecs import get_codec

    world = args.hosts
    encoded = get_codec(args.codec, 64).encoded_size(args.numel)
    ideal = 2 * (world - 1) / world * encoded * 8 / (rate * 1e6)
    period = 3 * ideal + 8 * delay_ms / 1e3 + 1.0
    t0 = time.time() + 15.0  # the processes import torch meanwhile (slow on a loaded box)
    with tempfile.TemporaryDirectory() as out:
        job = {"addrs": [bed.addr(f"h{i}") for i in range(world)], "cc": cc, "sockbuf": sockbuf,
               "numel": args.numel, "codec": args.codec, "rounds": args.rounds,
               "period": period, "t0": t0, "out_dir": out}
        procs = [bed.popen(f"h{i}", [*module_argv(__spec__.name), "--worker",
                                     json.dumps(job | {"rank": i})], cwd=ROOT) for i in
                                     range(world)]
        deadline = t0 + (args.rounds + 1) * period + 60
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
        if any(p.returncode != 0 for p in procs):
            raise SystemExit(f"wan_round: a host failed at {rate:g} Mbit/s, {delay_ms:g} ms, {cc} "
                             f"(exit codes {[p.returncode for p in procs]})")
        per_rank = [json.loads(Path(out, f"rank-{i}.json").read_text()) for i in range(world)]
    if len({rows[-1]["digest"] for rows in per_rank}) != 1:
        raise SystemExit(f"wan_round: members disagree at {rate:g} Mbit/s, {cc}")
    walls = [max(rows[r]["wall"] for rows in per_rank) for r in range(1, args.rounds + 1)]
    tcp = {k: sum(rows[0]["tcp"][k] for rows in per_rank) for k in _COUNTERS}
    sent = sum(r["sent"] for rows in per_rank for r in rows[1:])
    return {"rate_mbit": rate, "delay_ms": delay_ms, "cc": cc, "sockbuf": sockbuf,
            "ideal_s": ideal, "ideal_delay_s": ideal + 2 * delay_ms / 1e3, "walls": walls,
            "wall_median_s": statistics.median(walls),
            "late_max_s": max(r["late"] for rows in per_rank for r in rows[1:]),
            "sent_bytes": per_rank[0][1]["sent"],
            "retransmitted": tcp["RetransSegs"] * _MSS / max(1, sent), "tcp": tcp}


def _sockbufs(text: str, rate: float) -> list[int]:
    from dilonode.net.sockbuf import bdp_bytes

    return [bdp_bytes(rate) if v == "auto" else int(v) for v in names(text)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        _worker(**json.loads(args.worker))
        return 0
    if (why := unavailable_reason()) is not None:
        raise SystemExit(f"wan_round: {why}")
    rates, delays = floats(args.rates), floats(args.delays)
    ccs = names(args.cc)
    hosts = [f"h{i}" for i in range(args.hosts)]
    kernel = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    print(f"{args.hosts} hosts, {args.numel:,} values {args.codec}, {args.rounds} rounds per "
          f"setting, {args.passes} passes; the kernel's default: {kernel}", flush=True)
    rows = []
    emulated = {h: delays[0] / 2 for h in hosts} if any(delays) or args.loss else None
    loss = {h: args.loss for h in hosts} if args.loss else None
    with Testbed(hosts, rate_mbit=rates[0], delays=emulated, loss=loss) as bed:
        for n in range(args.passes):
            order = ccs if n % 2 == 0 else ccs[::-1]
            for rate in rates:
                for h in hosts:
                    bed.set_rate(h, rate)
                for delay in delays:
                    if emulated is not None:
                        for h in hosts:
                            bed.set_link(h, delay_ms=delay / 2)
                    for cc, buf, idle in itertools.product(order, _sockbufs(args.sockbuf, rate),
                                                           names(args.idle_restart)):
                        for h in hosts:
                            bed.set_idle_restart(h, bool(int(idle)))
                        row = _setting(bed, rate, delay, cc, buf, args)
                        row["pass"], row["idle_restart"] = n, int(idle)
                        rows.append(row)
                        print(f"pass {n}  {rate:6g} Mbit/s {delay:5g} ms  {cc:8s} buffer "
                              f"{buf / 2**20:6.1f} MiB  idle restart {idle}  round "
                              f"{row['wall_median_s']:.3f} s "
                              f"(ideal {row['ideal_s']:.3f} s: "
                              f"{row['wall_median_s'] / row['ideal_s']:.2f}x; with delay "
                              f"{row['ideal_delay_s']:.3f} s: "
                              f"{row['wall_median_s'] / row['ideal_delay_s']:.2f}x)  "
                              f"retransmitted {row['retransmitted']:.1%}", flush=True)
    print("\n| link | congestion control | buffer | idle restart | round (median of passes) "
          "| ideal | / ideal | / ideal with delay | retransmitted |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for rate in rates:
        for delay in delays:
            for cc in ccs:
                for buf, idle in itertools.product(_sockbufs(args.sockbuf, rate),
                                                   names(args.idle_restart)):
                    key = (rate, delay, cc, buf, int(idle))
                    mine = [r for r in rows if (r["rate_mbit"], r["delay_ms"], r["cc"],
                                                r["sockbuf"], r["idle_restart"]) == key]
                    wall = statistics.median(r["wall_median_s"] for r in mine)
                    label = f"{cc} ({kernel})" if cc == "system" else cc
                    retx = statistics.median(r["retransmitted"] for r in mine)
                    lossy = f", {args.loss:.1%} loss" if args.loss else ""
                    print(f"| {rate:g} Mbit/s, {delay:g} ms{lossy} | {label} | "
                          f"{buf / 2**20:.1f} MiB | "
                          f"{idle} | "
                          f"{wall:.3f} s | {mine[0]['ideal_s']:.3f} s | "
                          f"{wall / mine[0]['ideal_s']:.2f}x | "
                          f"{wall / mine[0]['ideal_delay_s']:.2f}x | {retx:.1%} |")
    write_json(args.json, {"args": {k: v for k, v in vars(args).items() if k != "json"}
                           | {"kernel_default": kernel}, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
