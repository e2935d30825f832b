"""The link emulator's own limits: the highest rate it forwards at 0 and 250 ms one-way.

    sudo .venv/bin/python -m benchmarks.testbed.linkem --json runs/bench/linkem.json

Two test bed hosts (testbed/hosts.py); a UDP source on one sends full-size datagrams
(1472 bytes of payload, 1514 on the wire) as fast as its tbf upload at the offered rate
lets it (UDP segmentation offload: one send per 44 datagrams, so the source's Python is not
the limit), a sink on the other counts what arrives. Each rate is run on a bed without the
emulator (the machine's own limit: veth, bridge, tbf, the endpoints), then with it at 0 ms
and at 250 ms one-way (a 30 MB queue at 1 Gbit/s). "delivered" is the sink's wire rate over
its receive interval; "lost" the datagrams that never arrived, "at TUN" those of them the
TUN device dropped because the emulator fell behind reading it; "late" how long after
their release times packets left the emulator (mean, max); "CPU" the emulator's busy
share of one core while the source sent, and its CPU time per packet (user + system in
/proc/PID/stat: its writes carry each packet on through the kernel to the sink's socket,
and a kernel that accounts softirq time apart leaves part of that out). A rate
counts as forwarded when at least 95% of it is delivered and under 1% lost.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.results import save_rows
from testbed.hosts import Testbed, unavailable_reason

__all__ = ["main", "measure", "table"]

PORT = 7300
PAYLOAD, WIRE = 1472, 1514  # a full-size UDP datagram's payload, and its Ethernet frame
_SINK = """
import json, socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE: absorb the sink's hiccups
s.bind((sys.argv[1], int(sys.argv[2])))
s.settimeout(float(sys.argv[3]))
print("ready", flush=True)
buf = bytearray(65536)
n, first, last = 0, None, None
try:
    while True:
        s.recv_into(buf)
        last = time.perf_counter()
        if first is None:
            first = last
            s.settimeout(1.0)  # then the stream has ended once a second passes without one
        n += 1
except TimeoutError:
    pass
print(json.dumps({"packets": n, "seconds": (last - first) if first else 0.0}))
"""
_SOURCE = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.IPPROTO_UDP, 103, 1472)  # UDP_SEGMENT: 1472-byte datagrams
s.connect((sys.argv[1], int(sys.argv[2])))
block, n = b"x" * (1472 * 44), 0
end = time.perf_counter() + float(sys.argv[3])
while time.perf_counter() < end:
    s.send(block)  # blocks while the tbf queue holds the socket's buffer
    n += 44
print(n)
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="100,250,500,750,1000,1500",
                   help="offered rates, Mbit/s on the wire, comma-separated")
    p.add_argument("--delays", default="0,250", help="one-way ms, comma-separated")
    p.add_argument("--seconds", type=float, default=3.0, help="sending time per rate")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the runs without the emulator")
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


def _blast(bed: Testbed, rate: float, seconds: float) -> dict[str, Any]:
    """Send at `rate` from h0 to h1 for `seconds`; what the sink got."""
    bed.set_rate("h0", rate)
    sink = bed.popen("h1", [sys.executable, "-c", _SINK, bed.addr("h1"), str(PORT), "10"],
                     stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout is not None
        if not select.select([sink.stdout], [], [], 10)[0] or sink.stdout.readline() != "ready\n":
            raise RuntimeError("the UDP sink did not start")
        sent = bed.run("h0", [sys.executable, "-c", _SOURCE, bed.addr("h1"), str(PORT),
                              str(seconds)], timeout=seconds + 30, check=True,
                       capture_output=True, text=True)
        out, _ = sink.communicate(timeout=30)
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait(timeout=5)
    got = json.loads(out)
    return {"sent": int(sent.stdout), "received": got["packets"], "seconds": got["seconds"]}


def _cpu_s(pid: int) -> float:
    """User plus system CPU seconds process `pid` has used (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tun_dropped(bed: Testbed) -> int:
    """Packets the emulator's TUN device dropped, its queue full, since it was made."""
    out = subprocess.run(["ip", "netns", "exec", bed.emulator_ns, "cat",
                          "/sys/class/net/tun0/statistics/tx_dropped"],
                         capture_output=True, text=True, timeout=10, check=True)
    return int(out.stdout)


def measure(bed: Testbed, label: str, rate: float, seconds: float) -> dict[str, Any]:
    pid = bed.linkem.proc.pid if bed.linkem is not None and bed.linkem.proc else None
    if pid is not None:
        bed.link_stats(reset=True)
        cpu0, t0, tun0 = _cpu_s(pid), time.perf_counter(), _tun_dropped(bed)
    got = _blast(bed, rate, seconds)
    emu: dict[str, Any] = {}
    if pid is not None:
        cpu = _cpu_s(pid) - cpu0
        emu = bed.link_stats(reset=True)
        emu["tun_dropped"] = _tun_dropped(bed) - tun0
        emu["cpu_share"] = round(cpu / (time.perf_counter() - t0), 3)
        emu["cpu_us_per_packet"] = round(cpu / emu["sent"] * 1e6, 2) if emu["sent"] else None
    delivered = got["received"] * WIRE * 8 / got["seconds"] / 1e6 if got["seconds"] else 0.0
    lost = 1 - got["received"] / got["sent"] if got["sent"] else 1.0
    return {"emulator": label, "offered_mbit": rate, "delivered_mbit": round(delivered, 1),
            "lost": round(lost, 5), "sent": got["sent"], "received": got["received"],
            "overflow": emu.get("overflow"), "tun_dropped": emu.get("tun_dropped"),
            "queue_peak_mb":
                round(emu["queue_peak_bytes"] / 1e6, 1) if emu else None,
            "late_mean_us": round(emu["late_sum_us"] / emu["sent"], 1)
                if emu.get("sent") else None,
            "late_max_us": emu.get("late_max_us"), "cpu_share": emu.get("cpu_share"),
            "cpu_us_per_packet": emu.get("cpu_us_per_packet"),
            "forwarded": delivered >= 0.95 * rate and lost < 0.01}


def run_config(label: str, delay: float | None, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One bed (`delay` None: no emulator), every offered rate."""
    links = {} if delay is None else {"delays": {"h0": delay}, "emulate": True}
    rows = []
    with Testbed(["h0", "h1"], **links) as bed:
        for rate in (float(r) for r in args.rates.split(",")):
            row = measure(bed, label, rate, args.seconds)
            rows.append(row)
            late = (f"late {row['late_mean_us']} us mean, {row['late_max_us']} us max"
                    if row["late_mean_us"] is not None else "")
            print(f"{label:12s} {rate:6g} Mbit/s offered: {row['delivered_mbit']:7.1f} "
                  f"delivered, lost {row['lost']:.2%} {late}", flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| emulator | offered Mbit/s | delivered Mbit/s | lost (at TUN) | queue peak MB | "
             "late mean / max us | CPU (us per packet) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        emulated = r["late_mean_us"] is not None
        late = f"{r['late_mean_us']} / {r['late_max_us']}" if emulated else "-"
        cpu = f"{r['cpu_share']:.0%} ({r['cpu_us_per_packet']})" if emulated else "-"
        peak = r["queue_peak_mb"] if r["queue_peak_mb"] is not None else "-"
        at_tun = f" ({r['tun_dropped'] / r['sent']:.2%})" if emulated and r["sent"] else ""
        lines.append(f"| {r['emulator']} | {r['offered_mbit']:g} | {r['delivered_mbit']} | "
                     f"{r['lost']:.2%}{at_tun} | {peak} | {late} | {cpu} |")
    best = {}
    for r in rows:
        if r["forwarded"]:
            best[r["emulator"]] = max(best.get(r["emulator"], 0.0), r["offered_mbit"])
    lines.append("")
    lines += [f"highest rate forwarded, {label}: {best.get(label, 0):g} Mbit/s"
              for label in dict.fromkeys(r["emulator"] for r in rows)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (why := unavailable_reason(delay=True)) is not None:
        raise SystemExit(f"linkem: {why}")
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the start; "
          f"{args.seconds:g} s per rate", flush=True)
    t0 = time.perf_counter()
    configs: list[tuple[str, float | None]] = [] if args.no_baseline else [("none", None)]
    configs += [(f"{float(d):g} ms", float(d)) for d in args.delays.split(",")]
    rows = [row for label, delay in configs for row in run_config(label, delay, args)]
    print(f"\n{table(rows)}\n({time.perf_counter() - t0:.0f} s, load average "
          f"{os.getloadavg()[0]:.2f} at the end)")
    save_rows(args.json, args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
