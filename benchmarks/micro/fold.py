"""The float32 owner's reduction of one chunk, the two ways the code can do it, interleaved
in one process so that a shared machine's load falls on both alike:

* `steps`: `codec.accumulate` once per contribution (a pass each over the output), then
  `codec.encode` of the mean (a finiteness pass and a copy): the path for codecs and
  aggregators the fold does not cover;
* `fold`: `codecs.fold_float32`, one blocked sweep per four contributions that also
  checks and encodes the mean (what `HostPath.combine_encode` runs for float32).

    .venv/bin/python -m benchmarks.micro.fold                      # 4 members, 833,344 values
    .venv/bin/python -m benchmarks.micro.fold --members 8 --numel 262144 --reps 400

Prints the median and minimum milliseconds per chunk of each over --reps alternations,
after checking that both give the same bits.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from dilonode.algo.butterfly import reduction_steps
from dilonode.algo.codecs import CodecMeta, fold_float32, get_codec

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--members", type=int, default=4)
    p.add_argument("--numel", type=int, default=833_344, help="values per chunk (the "
                   "round rule's chunk for 10M values over 4 peers)")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--weighted", action="store_true", help="uneven token weights")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    codec = get_codec("float32")
    g = torch.Generator().manual_seed(0)
    payloads = [torch.randn(args.numel, generator=g).numpy().tobytes()
                for _ in range(args.members)]
    weights = [1.0 + i for i in range(args.members)] if args.weighted else None
    steps = reduction_steps(weights, args.members)
    meta = CodecMeta(codec="float32", numel=args.numel, block_size=1)
    out_steps, out_fold = torch.empty(args.numel), torch.empty(args.numel)

    def by_steps() -> bytes:
        for data, (step, coef) in zip(payloads, steps, strict=True):
            codec.accumulate(data, meta, out_steps, step, coef)
        return codec.encode(out_steps)[0]

    def by_fold() -> memoryview:
        encoded = fold_float32(codec, payloads, steps, out_fold)
        assert encoded is not None
        return encoded

    if by_steps() != bytes(by_fold()) or not np.array_equal(
            out_steps.numpy().view(np.int32), out_fold.numpy().view(np.int32)):
        raise SystemExit("fold and steps disagree")
    times: dict[str, list[float]] = {"steps": [], "fold": []}
    for _ in range(args.reps):
        for name, fn in (("steps", by_steps), ("fold", by_fold)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    print(f"{args.members} members, {args.numel:,} values, "
          f"{'weighted' if weights else 'plain'} mean, {args.reps} alternations")
    for name, ts in times.items():
        print(f"{name:6s} median {1e3 * statistics.median(ts):.3f} ms, "
              f"min {1e3 * min(ts):.3f} ms per chunk")
    ratio = statistics.median(times["fold"]) / statistics.median(times["steps"])
    print(f"fold / steps (medians): {ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
