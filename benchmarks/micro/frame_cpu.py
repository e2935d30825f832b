"""What one frame of a float32 round costs on the host, step by step, on a warm cache:

* `seal`: the frame's GMAC tag (`channel.FrameSealer`, what every frame carries);
* `hash`: BLAKE3 of the chunk's values (`datapath.chunk_hash`, a result chunk's digest);
* `encode`: a `Contribution` built and cut into frame pieces (`encode_frame_parts`), the
  Python a sender runs per frame;
* `decode`: the frame body decoded and validated into its message, payload shared
  (`decode_message(share=True)`), the Python a receiver runs per frame.

The chunk is the one the round rule cuts 10M values among 4 peers into (833,344 values,
3.3 MB): the all-reduce benchmark's. Tags and digests are given in GB/s, the Python steps
in microseconds, the median of --reps after a warm-up. Against the same steps inside a
round (`allreduce.py --perf`), they show what a cold cache adds.

    .venv/bin/python -m benchmarks.micro.frame_cpu
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from benchmarks.harness.timing import median_seconds
from dilonode.allreduce.datapath import chunk_hash
from dilonode.net.channel import FrameSealer
from dilonode.wire.framing import HEADER_BYTES, decode_message, encode_frame_parts
from dilonode.wire.messages import Contribution

__all__ = ["main", "measure"]


def measure(numel: int = 833_344, reps: int = 200) -> dict[str, float]:
    """Median seconds per call of each step (module docstring) for a chunk of `numel`."""
    values = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    payload = memoryview(values.numpy()).cast("B").toreadonly()

    def contribution() -> Contribution:
        return Contribution(run_id="bench", fragment=0, round=5, attempt=0, group="a" * 64,
                            sender=1, owner=2, chunk=1, n_chunks=3, offset=numel,
                            numel=numel, codec="float32", block_size=64, weight=1.0,
                            payload=payload)

    frame = encode_frame_parts(contribution())
    body = memoryview(np.frombuffer(b"".join(frame), dtype=np.uint8)[HEADER_BYTES:].data)
    if bytes(decode_message(body, run_id="bench", share=True).payload) != bytes(payload):
        raise AssertionError("the decoded payload differs from the one sent")
    sealer = FrameSealer(bytes(32))
    return {
        "seal": median_seconds(lambda: sealer.seal(*frame), reps),
        "hash": median_seconds(lambda: chunk_hash(values), reps),
        "encode": median_seconds(lambda: encode_frame_parts(contribution()), reps),
        "decode": median_seconds(lambda: decode_message(body, run_id="bench", share=True),
                                 reps),
        "bytes": float(len(payload)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=833_344, help="float32 values in the chunk")
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args(argv)
    if args.numel < 1 or args.reps < 1:
        p.error("--numel and --reps must be >= 1")
    torch.set_num_threads(1)
    got = measure(args.numel, args.reps)
    size = got["bytes"]
    print(f"one frame of {args.numel:,} float32 values ({size / 1e6:.2f} MB), median of "
          f"{args.reps}, one core, warm cache")
    for name in ("seal", "hash"):
        print(f"  {name:7s} {got[name] * 1e6:9.1f} us  {size / got[name] / 1e9:6.1f} GB/s")
    for name in ("encode", "decode"):
        print(f"  {name:7s} {got[name] * 1e6:9.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
