"""CPU seconds per peer of one all-reduce round without sockets: N `AllReduceRound`s in one
process over `MemNet` (real msgpack framing, codecs, reduction and digests; no TCP, MAC or
event loop). Like the data plane, it first tunes glibc malloc (`tune_allocator`);
--no-tune-malloc leaves it alone.

    .venv/bin/python -m benchmarks.micro.round_cpu                        # float32,int4, 10M values
    .venv/bin/python -m benchmarks.micro.round_cpu --codecs int8 --numel 1000000 --profile 20
    .venv/bin/python -m benchmarks.micro.round_cpu --data-path torch     # the device codecs, on CPU
    .venv/bin/python -m benchmarks.micro.round_cpu --reuse-output        # results kept as the
    daemon does

Chunks by the round rule (`butterfly.round_chunk_numel`) unless --chunk says otherwise;
--reuse-output writes each peer's result into one buffer kept across rounds (as the daemon
does) instead of a fresh one, whose page faults otherwise dominate a float32 round.
Prints, per codec, the process CPU time of a whole round divided by the number of peers:
the minimum and every value over --rounds rounds (one warm-up round is not counted), and
the fewest minor page faults per peer of a round.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import time

import torch

from benchmarks.harness.args import names
from dilonode.algo.butterfly import round_chunk_numel
from dilonode.allreduce.allocator import tune_allocator
from dilonode.allreduce.memnet import MemNet
from dilonode.allreduce.round import AllReduceRound, GroupSpec, RoundState, group_digest
from dilonode.config import DEFAULT_CHUNK_NUMEL

__all__ = ["main"]


def _round(xs: list[torch.Tensor], codec: str, chunk: int, round_no: int,
           data_path: str = "host", outs: list[torch.Tensor] | None = None) -> None:
    members = tuple(f"peer-{i}" for i in range(len(xs)))
    spec = GroupSpec(run_id="cpu", fragment=0, round=round_no, members=members,
                     weights=(1.0,) * len(xs), numel=xs[0].numel(), codec=codec,
                     block_size=64, chunk_numel=chunk, group_digest=group_digest(members))
    rounds = [AllReduceRound(spec, i, x, data_path=data_path,
                             out=None if outs is None else outs[i]) for i, x in enumerate(xs)]
    MemNet(rounds).run()
    if any(r.state is not RoundState.DONE for r in rounds) or len({r.digest for r in rounds}) > 1:
        raise RuntimeError(f"{codec}: round {round_no} did not complete identically")


def _minor_faults() -> int:
    """Minor page faults of this process so far: fresh memory being mapped in, a cost that
    CPU seconds on a loaded machine show only noisily, counted exactly."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=10_000_000)
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--codecs", default="float32,int4")
    p.add_argument("--chunk", type=int, default=None,
                   help="values per frame (default: the round rule, round_chunk_numel)")
    p.add_argument("--reuse-output", action="store_true",
                   help="each peer's result into one buffer kept across rounds")
    p.add_argument("--profile", type=int, default=0, help="print the top N entries (CPU)")
    p.add_argument("--no-tune-malloc", action="store_true", help="skip tune_allocator()")
    p.add_argument("--data-path", choices=("host", "torch"), default="host",
                   help="the rounds' data path (torch: the device codecs, here on the CPU)")
    args = p.parse_args(argv)
    if args.chunk is None:
        args.chunk = round_chunk_numel(args.numel, args.peers, DEFAULT_CHUNK_NUMEL, 64)
    torch.set_num_threads(1)
    if not args.no_tune_malloc:
        tune_allocator()
    xs = [torch.randn(args.numel, generator=torch.Generator().manual_seed(i))
          for i in range(args.peers)]
    outs = [torch.empty(args.numel) for _ in xs] if args.reuse_output else None
    for codec in names(args.codecs):
        _round(xs, codec, args.chunk, 0, args.data_path, outs)
        cpu, faults = [], []
        for r in range(1, args.rounds + 1):
            c0, f0 = time.process_time(), _minor_faults()
            _round(xs, codec, args.chunk, r, args.data_path, outs)
            cpu.append((time.process_time() - c0) / args.peers)
            faults.append((_minor_faults() - f0) / args.peers)
        print(f"{codec:9s} CPU s per peer per round: min {min(cpu):.3f}, all "
              f"{', '.join(f'{c:.3f}' for c in cpu)}; page faults per peer per round: "
              f"{min(faults):.0f}", flush=True)
        if args.profile:
            prof = cProfile.Profile(time.process_time)
            prof.runcall(_round, xs, codec, args.chunk, args.rounds + 1, args.data_path, outs)
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
