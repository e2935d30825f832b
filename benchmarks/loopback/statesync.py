"""State sync throughput on loopback: how fast `recover()` pulls a state of a given size from
K state servers, with no link limit, i.e. the cost of the implementation itself (chunking,
sha256 on both sides, framing). The WAN figure (a joiner on the test bed against the link
rate) is benchmarks/testbed/join.py.

Servers run in child processes (one each, like real peers); the joiner is this process.

    python -m benchmarks.loopback.statesync --mb 100 --peers 3
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import time

import torch

from dilonode.config import load_config
from dilonode.statesync.client import recover
from dilonode.statesync.server import SnapshotSource, StateServer
from dilonode.train.state import WorkerState, config_digest


def _state(mb: float, fragments: int = 3) -> WorkerState:
    numel = int(mb * 1e6 / 4 / (2 * fragments))
    g = torch.Generator().manual_seed(0)
    tensors = {f"outer.{p}.{k}": torch.randn(numel, generator=g)
               for p in range(fragments) for k in ("weights", "momentum")}
    return WorkerState(100, (9,) * fragments, (9,) * fragments, tensors)


class _Fixed:
    def __init__(self, state: WorkerState) -> None:
        self.state, self.step, self.pending = state, state.step, {}

    def export_state(self, reuse: WorkerState | None = None) -> WorkerState:
        return self.state


def _serve(name: str, mb: float, chunk_bytes: int, addr_q: mp.Queue, stop: mp.Event) -> None:
    cfg = load_config(overrides={"statesync": {"chunk_bytes": chunk_bytes}})

    async def main() -> None:
        server = StateServer(SnapshotSource(_Fixed(_state(mb))), cfg.run_id,
                             config_digest(cfg), cfg.statesync, peer_id=name)
        addr_q.put((name, await server.start()))
        while not stop.is_set():
            await asyncio.sleep(0.1)
        await server.aclose()

    asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=100.0, help="state size in MB (1e6 bytes)")
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--chunk-bytes", type=int, default=1 << 20)
    ap.add_argument("--window", type=int, default=4)
    args = ap.parse_args()
    cfg = load_config(overrides={"statesync": {"chunk_bytes": args.chunk_bytes,
                                               "window": args.window}})
    ctx = mp.get_context("spawn")
    addr_q, stop = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_serve, args=(f"peer{i}", args.mb, args.chunk_bytes, addr_q,
                                              stop)) for i in range(args.peers)]
    for p in procs:
        p.start()
    try:
        peers = dict(addr_q.get(timeout=120) for _ in range(args.peers))
        t0 = time.perf_counter()
        rec = asyncio.run(recover(peers, None, cfg.run_id, config_digest(cfg), cfg.statesync,
                                  peer_id="joiner"))
        wall = time.perf_counter() - t0
    finally:
        stop.set()
        for p in procs:
            p.join(10)
    assert rec is not None
    mb = rec.fetched_bytes / 1e6
    print(f"{mb:.1f} MB from {args.peers} peers in {wall:.2f} s: {mb / wall:.0f} MB/s "
          f"({mb * 8 / wall:.0f} Mbit/s); per peer MB: "
          + ", ".join(f"{n / 1e6:.1f}" for n in rec.sources.values()))


if __name__ == "__main__":
    main()
