"""All-reduce benchmark: dilonode's TCP butterfly per codec vs torch.distributed gloo
(and hivemind's DecentralizedAverager with --hivemind), N processes on 127.0.0.1.

    .venv/bin/python -m benchmarks.loopback.allreduce                         # 4 procs, 10M floats
    .venv/bin/python -m benchmarks.loopback.allreduce --numel 1000000 --rounds 3 --json out.json
    .venv/bin/python -m benchmarks.loopback.allreduce --hivemind              # if hivemind imports
    .venv/bin/python -m benchmarks.loopback.allreduce --inline --profile out/ # cProfile of rank 0

Every process holds a different random tensor of --numel float32 values. Each measured
round starts after a gloo barrier; its wall time is the slowest member's, and the table
shows the median over --rounds (one extra warm-up round is not counted). "payload" is the
codec bytes one member sends, "wire" the whole frames (msgpack map + 4-byte header), both
against the ideal butterfly/ring volume 2(N-1)/N x encoded tensor. gloo's wire bytes are
not observable from Python; its ideal is shown. "cpu" is process CPU seconds per member
per round (for hivemind only the calling process: its averaging runs in helper processes,
and its round time includes matchmaking), "lag" the worst event-loop delay seen by a 5 ms
probe during our rounds, "faults" the minor page faults per member per round (fresh memory
mapped in; exact, where CPU seconds on a loaded machine are not), "direct" the share of
received bytes the event loop read straight into their frame's body (`bytes_in_direct`).
--inline runs round work on the event loop instead of a worker thread, to measure the
difference; --profile (rank 0, needs --inline since cProfile sees only the main thread)
writes one pstats file per codec and prints the top entries by CPU time; --perf DIR samples
rank 0 with Linux `perf` during each method's measured rounds (gloo's included) and prints
the share of its CPU per category (GMAC, BLAKE3, kernel copies, ...: cpu_sampling.py), which
unlike cProfile sees native code and every thread. Our peers run on
uvloop, as the daemon does (--loop asyncio for the standard loop); --reuse-output writes
every round's result into one preallocated buffer (run_round(out=...)); --keep-encoded
also keeps the encoded result, as the daemon does for joiners (run_round(keep_encoded=True)).
The data plane tunes glibc malloc for the whole process (`tune_allocator`), gloo's rounds
included, which run after ours in the same processes; --no-tune-malloc leaves it alone.
--device cuda hands our rounds the tensor on the GPU, as a GPU host's trainer does (codecs
and reduction run there: the torch data path), while gloo reduces the same values as a CPU
float32 tensor; --link-gbit 1,10 adds the time an ideal link of each rate would need for
the bytes one peer sends (the butterfly's 2 (N-1)/N x encoded tensor), to compare loopback
round times with (benchmarks/gpu.sh runs both on the GPU machine).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import datetime
import multiprocessing as mp
import os
import platform
import pstats
import queue
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.harness.args import floats, names
from benchmarks.harness.perf import PerfSampler, format_shares
from benchmarks.harness.results import write_json
from dilonode.algo.butterfly import round_chunk_numel, wire_bytes_ideal
from dilonode.algo.codecs import get_codec
from dilonode.allreduce.driver import run_round
from dilonode.allreduce.plane_limits import PlaneLimits
from dilonode.allreduce.round import GroupSpec, RoundState, group_digest
from dilonode.allreduce.transport import DataPlane
from dilonode.config import DEFAULT_CHUNK_NUMEL
from tests.support.ports import free_port

__all__ = ["main", "parse_args"]

RUN = "bench"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=10_000_000, help="float32 values per peer")
    p.add_argument("--procs", type=int, default=4, help="peers (processes)")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds per method")
    p.add_argument("--codecs", default="float32,bfloat16,int8,int4")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--chunk", type=int, default=None,
                   help="values per frame (default: what the daemon's round picks with "
                   "network.chunk_numel at its default, butterfly.round_chunk_numel)")
    p.add_argument("--timeout", type=float, default=300.0, help="round timeout, s")
    p.add_argument("--sockbuf", type=int, default=4 << 20, help="SO_SNDBUF/RCVBUF, 0=kernel")
    p.add_argument("--inline", action="store_true", help="round work on the event loop")
    p.add_argument("--keep-encoded", action="store_true",
                   help="keep each round's encoded result (the daemon does, for joiners)")
    p.add_argument("--reuse-output", action="store_true",
                   help="write every round's result into one preallocated buffer "
                        "(run_round(out=...)), as the daemon does")
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                   help="event loop of our peers (the daemon uses uvloop when installed)")
    p.add_argument("--no-tune-malloc", action="store_true",
                   help="leave glibc malloc as it is (PlaneLimits(tune_malloc=False)); by "
                        "default the data plane calls tune_allocator() as the daemon's does")
    p.add_argument("--no-gloo", action="store_true")
    p.add_argument("--hivemind", action="store_true", help="also DecentralizedAverager")
    p.add_argument("--profile", type=Path, help="dir for rank 0 pstats (use with --inline)")
    p.add_argument("--profile-clock", choices=("cpu", "wall"), default="cpu",
                   help="--profile's clock: wall shows time spent waiting on a GPU")
    p.add_argument("--perf", type=Path,
                   help="dir for `perf record` samples of rank 0's measured rounds, per "
                        "method; prints where its CPU goes (benchmarks/harness/perf.py)")
    p.add_argument("--device", default="cpu",
                   help="where our rounds' tensor lives (cpu, cuda): the data path")
    p.add_argument("--link-gbit", default="",
                   help="comma-separated link rates (Gbit/s) to show ideal round times for")
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)
    if args.chunk is None:
        args.chunk = round_chunk_numel(args.numel, args.procs, DEFAULT_CHUNK_NUMEL,
                                       args.block_size)
    elif args.chunk < 1 or args.chunk % args.block_size:
        p.error(f"--chunk {args.chunk}: must be a positive multiple of --block-size "
                f"{args.block_size}")
    return args


# ---------------------------------------------------------------------- per process


class _LagProbe:
    """Worst lateness of a 5 ms timer: how long the event loop was kept from running."""

    def __init__(self, period: float = 0.005) -> None:
        self.period = period
        self.worst = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(self.period)
            self.worst = max(self.worst, loop.time() - t - self.period)

    def take(self) -> float:
        worst, self.worst = self.worst, 0.0
        return worst


def _spec(args: argparse.Namespace, world: int, codec: str, fragment: int,
          round_no: int) -> GroupSpec:
    members = tuple(f"bench-{i}" for i in range(world))
    return GroupSpec(run_id=RUN, fragment=fragment, round=round_no, members=members,
                     weights=(1.0,) * world, numel=args.numel, codec=codec,
                     block_size=args.block_size, chunk_numel=args.chunk,
                     group_digest=group_digest(members))


async def _ours(rank: int, world: int, x: torch.Tensor,
                args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    plane = DataPlane(f"bench-{rank}", RUN, limits=PlaneLimits(
        socket_buffer_bytes=args.sockbuf, tune_malloc=not args.no_tune_malloc))
    await plane.start()
    addrs: list[Any] = [None] * world
    dist.all_gather_object(addrs, plane.address)
    peers = {i: a for i, a in enumerate(addrs) if i != rank}
    probe = _LagProbe()
    probe.start()
    x = x.to(args.device)  # cuda: the round quantizes and reduces on the GPU
    buf = torch.empty(args.numel, device=args.device) if args.reuse_output else None
    out: dict[str, list[dict[str, Any]]] = {}
    for fragment, codec in enumerate(names(args.codecs)):
        # CPU time by default: on a shared box waiting for a core would swamp the profile.
        clock = time.perf_counter if args.profile_clock == "wall" else time.process_time
        prof = cProfile.Profile(clock) if args.profile and rank == 0 else None
        # Round 0 warms up connections and allocations; it is neither counted nor sampled.
        await _our_round(plane, _spec(args, world, codec, fragment, 0), rank, x, peers,
                         args, probe, None, buf)
        rows = []
        with _sampler(args, rank, codec) as sampler:
            for r in range(1, args.rounds + 1):
                rows.append(await _our_round(plane, _spec(args, world, codec, fragment, r),
                                             rank, x, peers, args, probe, prof, buf))
        if sampler is not None:
            rows[0]["perf"] = sampler.shares()
        digests: list[Any] = [None] * world
        await asyncio.get_running_loop().run_in_executor(
            None, dist.all_gather_object, digests, rows[-1].pop("digest"))
        if len(set(digests)) != 1:
            raise RuntimeError(f"{codec}: members disagree: {digests}")
        if prof is not None:
            _dump_profile(prof, args.profile, codec)
        out[codec] = rows
    await plane.aclose()
    return out


async def _our_round(plane: DataPlane, spec: GroupSpec, rank: int, x: torch.Tensor,
                     peers: dict[int, str], args: argparse.Namespace, probe: _LagProbe,
                     prof: cProfile.Profile | None,
                     buf: torch.Tensor | None) -> dict[str, Any]:
    # In a thread: the loop must keep writing the frames that earlier rounds left queued.
    await asyncio.get_running_loop().run_in_executor(None, dist.barrier)
    probe.take()
    c0, t0, f0 = time.process_time(), time.perf_counter(), _minor_faults()
    in0, direct0 = plane.stats["bytes_in"], plane.stats["bytes_in_direct"]
    if prof is not None:
        prof.enable()
    res = await run_round(plane, spec, rank, x, peers, args.timeout, offload=not args.inline,
                          out=buf, keep_encoded=args.keep_encoded)
    if prof is not None:
        prof.disable()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    faults = _minor_faults() - f0
    if res.state is not RoundState.DONE:
        raise RuntimeError(f"{spec.codec} round {spec.round}: {res.failure}")
    return {"wall": wall, "cpu": cpu, "faults": faults, "lag": probe.take(),
            "wire": res.bytes_sent, "bytes_in": plane.stats["bytes_in"] - in0,
            "bytes_in_direct": plane.stats["bytes_in_direct"] - direct0,
            "payload": res.payload_bytes_sent, "digest": res.digest}


def _minor_faults() -> int:
    """Minor page faults of this process so far (fresh memory mapped in): exact where CPU
    seconds on a loaded machine are noisy."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _dump_profile(prof: cProfile.Profile, out_dir: Path, codec: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"allreduce_{codec}.pstats"
    prof.dump_stats(path)
    print(f"--- rank 0 profile, {codec} ({path}) ---", flush=True)
    pstats.Stats(str(path)).sort_stats("tottime").print_stats(14)
    pstats.Stats(str(path)).sort_stats("cumulative").print_stats(24)


def _sampler(args: argparse.Namespace, rank: int, method: str) -> Any:
    """--perf: rank 0's measured rounds of `method`, sampled by `perf record`."""
    if args.perf is None or rank != 0:
        return contextlib.nullcontext()
    return PerfSampler(args.perf / f"allreduce_{method}.perf")


def _gloo(x: torch.Tensor, args: argparse.Namespace, rank: int) -> list[dict[str, Any]]:
    rows = []
    with _sampler(args, rank, "gloo") as sampler:
        for r in range(args.rounds + 1):
            y = x.clone()
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            dist.all_reduce(y)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            if r:
                rows.append({"wall": wall, "cpu": cpu})
    if sampler is not None:  # gloo's warm-up round is sampled too: it is short
        rows[0]["perf"] = sampler.shares()
    return rows


def _hivemind(rank: int, world: int, x: torch.Tensor,
              args: argparse.Namespace) -> list[dict[str, Any]]:
    import hivemind
    from hivemind.averaging import DecentralizedAverager

    # The averager is a multiprocessing.Process holding unpicklable state: it needs fork,
    # while this worker was spawned and so inherited the spawn start method.
    mp.set_start_method("fork", force=True)

    first: list[Any] = [None] * world
    dht = None
    if rank == 0:
        dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        first[0] = [str(a) for a in dht.get_visible_maddrs()]
    dist.all_gather_object(first, first[0] if rank == 0 else None)
    if dht is None:
        dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                           initial_peers=first[0])
    avg = DecentralizedAverager([x.clone()], dht, start=True, prefix="bench",
                                target_group_size=world, min_group_size=world,
                                min_matchmaking_time=1.0, request_timeout=5.0)
    rows = []
    for r in range(args.rounds + 1):
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        gathered = avg.step(timeout=args.timeout)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if r:
            rows.append({"wall": wall, "cpu": cpu, "ok": gathered is not None})
    avg.shutdown()
    dht.shutdown()
    return rows


def _worker(rank: int, world: int, port: int, args: argparse.Namespace,
            results: Any) -> None:
    torch.set_num_threads(1)  # one process per core is already more than this box has
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(rank))
    factory = None
    if args.loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        out: dict[str, Any] = {"ours": runner.run(_ours(rank, world, x, args))}
    if not args.no_gloo:
        out["gloo"] = _gloo(x, args, rank)
    if args.hivemind:
        out["hivemind"] = _hivemind(rank, world, x, args)
    results.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------- parent


def _run_workers(args: argparse.Namespace) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.procs, port, args, results))
             for r in range(args.procs)]
    for proc in procs:
        proc.start()
    per_rank: dict[int, dict[str, Any]] = {}
    try:
        deadline = time.monotonic() + 3600
        while len(per_rank) < args.procs:
            try:
                rank, out = results.get(timeout=1.0)
            except queue.Empty:
                # A worker that failed leaves the others waiting in a barrier: stop them.
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise SystemExit(f"allreduce: worker(s) {dead} failed (exit codes "
                                     f"{[procs[r].exitcode for r in dead]}; their traceback "
                                     "is above)" if dead else "allreduce: no result in an "
                                     "hour") from None
                continue
            per_rank[rank] = out
    finally:
        for proc in procs:
            proc.join(30 if len(per_rank) == args.procs else 0.1)
            if proc.is_alive():
                proc.kill()
    return [per_rank[r] for r in range(args.procs)]


def _summarize(method: str, codec: str, rows_per_rank: list[list[dict[str, Any]]],
               args: argparse.Namespace) -> dict[str, Any]:
    n_rounds = len(rows_per_rank[0])
    walls = [max(rows[r]["wall"] for rows in rows_per_rank) for r in range(n_rounds)]
    cpus = [statistics.mean(rows[r]["cpu"] for rows in rows_per_rank) for r in range(n_rounds)]
    encoded = get_codec(codec, args.block_size).encoded_size(args.numel)
    row: dict[str, Any] = {
        "method": method, "codec": codec, "wall_median_s": statistics.median(walls),
        "wall_s": walls, "cpu_per_peer_s": statistics.median(cpus),
        "ideal_bytes_per_peer": wire_bytes_ideal(encoded, args.procs)}
    first = rows_per_rank[0][0]
    if "payload" in first:
        row["payload_bytes_per_peer"] = statistics.mean(
            rows[0]["payload"] for rows in rows_per_rank)
        row["wire_bytes_per_peer"] = statistics.mean(rows[0]["wire"] for rows in rows_per_rank)
        row["loop_lag_max_s"] = max(r["lag"] for rows in rows_per_rank for r in rows)
        # Received bytes the event loop read straight into their frame's body (transport).
        row["direct_read_share"] = (
            sum(r["bytes_in_direct"] for rows in rows_per_rank for r in rows)
            / max(1, sum(r["bytes_in"] for rows in rows_per_rank for r in rows)))
        row["page_faults_per_peer"] = statistics.median(
            statistics.mean(rows[r]["faults"] for rows in rows_per_rank)
            for r in range(n_rounds))
    if "ok" in first:
        row["failed_steps"] = sum(not r["ok"] for rows in rows_per_rank for r in rows)
    if "perf" in first:  # rank 0's shares, with its own CPU seconds per round
        row["perf_shares"] = first["perf"]
        row["perf_cpu_s"] = statistics.median(r["cpu"] for r in rows_per_rank[0])
    return row


def _link_table(rows: list[dict[str, Any]], rates: list[float]) -> str:
    """Round wall time against an ideal link: bytes one peer sends / rate, per row."""
    head = f"{'method':<10} {'codec':<9} {'round s':>8}" + "".join(
        f" {f'ideal@{r:g}G s':>13} {'x ideal':>8}" for r in rates)
    lines = [head, "-" * len(head)]
    for r in rows:
        ideal = [r["ideal_s"][str(g)] for g in rates]
        cells = "".join(f" {i:>13.3f} {r['wall_median_s'] / i:>8.2f}" for i in ideal)
        lines.append(f"{r['method']:<10} {r['codec']:<9} {r['wall_median_s']:>8.3f}{cells}")
    return "\n".join(lines)


def _table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'method':<10} {'codec':<9} {'round s':>8} {'payload/peer':>13} "
            f"{'wire/peer':>11} {'ideal/peer':>11} {'wire/ideal':>10} {'cpu s/peer':>10} "
            f"{'lag max':>8} {'faults':>7} {'direct':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        mb = 1e6
        pay = f"{r['payload_bytes_per_peer'] / mb:.2f} MB" if "payload_bytes_per_peer" in r \
            else "-"
        wire = f"{r['wire_bytes_per_peer'] / mb:.2f} MB" if "wire_bytes_per_peer" in r else "-"
        ratio = f"{r['wire_bytes_per_peer'] / r['ideal_bytes_per_peer']:.4f}" \
            if "wire_bytes_per_peer" in r and r["ideal_bytes_per_peer"] else "-"
        lag = f"{r['loop_lag_max_s'] * 1e3:.0f} ms" if "loop_lag_max_s" in r else "-"
        faults = f"{r['page_faults_per_peer']:.0f}" if "page_faults_per_peer" in r else "-"
        direct = f"{r['direct_read_share']:.0%}" if "direct_read_share" in r else "-"
        lines.append(f"{r['method']:<10} {r['codec']:<9} {r['wall_median_s']:>8.3f} "
                     f"{pay:>13} {wire:>11} {r['ideal_bytes_per_peer'] / mb:>8.2f} MB "
                     f"{ratio:>10} {r['cpu_per_peer_s']:>10.3f} {lag:>8} {faults:>7} "
                     f"{direct:>7}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    per_rank = _run_workers(args)
    rows = [_summarize("dilonode", codec, [o["ours"][codec] for o in per_rank], args)
            for codec in names(args.codecs)]
    if not args.no_gloo:
        rows.append(_summarize("gloo", "float32", [o["gloo"] for o in per_rank], args))
    if args.hivemind:
        rows.append(_summarize("hivemind", "float32", [o["hivemind"] for o in per_rank], args))
    rates = floats(args.link_gbit)
    for r in rows:  # ideal link seconds: the bytes one peer must send at each rate
        r["ideal_s"] = {str(g): r["ideal_bytes_per_peer"] * 8 / (g * 1e9) for g in rates}
    env = {"numel": args.numel, "procs": args.procs, "rounds": args.rounds,
           "chunk": args.chunk, "inline": args.inline, "sockbuf": args.sockbuf,
           "loop": args.loop, "reuse_output": args.reuse_output, "device": args.device,
           "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None,
           "keep_encoded": args.keep_encoded,
           "tune_malloc": not args.no_tune_malloc,
           "cpus": os.cpu_count(), "loadavg_before": load_before,
           "loadavg_after": os.getloadavg(), "python": platform.python_version(),
           "torch": torch.__version__, "total_s": time.perf_counter() - t0}
    print(f"{args.procs} peers on 127.0.0.1, {args.numel:,} float32 values, median of "
          f"{args.rounds} rounds; {os.cpu_count()} CPUs, load avg before "
          f"{load_before[0]:.2f}, after {env['loadavg_after'][0]:.2f}")
    print(_table(rows))
    if rates:
        print(_link_table(rows, rates))
    for r in rows:
        if "perf_shares" in r:
            print(f"rank 0, {r['method']} {r['codec']}: where its {r['perf_cpu_s']:.3f} CPU s "
                  f"per round go (perf samples)")
            print(format_shares(r["perf_shares"], r["perf_cpu_s"]))
    write_json(args.json, {"env": env, "results": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
