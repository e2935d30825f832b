"""What the torch data path's per-chunk steps cost on a GPU host, for one chunk of 4,194,304
values (the daemon's largest: 16 MB of float32), median of 20 after a warm-up:

* BLAKE3 of the chunk (a result chunk's digest, protocol 5.1) on 1, 2, 4, 8 and all cores;
* the chunk copied off the GPU into pageable and into page-locked (pinned) host memory, and
  8 MB copied onto the GPU from each;
* int4 encode and decode of the chunk on the GPU (`torch_codecs`) and on the host (the
  compiled CPU codecs).

    python3 -m benchmarks.gpu.datapath_costs   # needs CUDA; `bash benchmarks/gpu.sh codecs` runs it
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import blake3
import numpy as np
import torch

from benchmarks.harness.timing import median_seconds
from dilonode.algo.codecs import CodecMeta, get_codec
from dilonode.algo.torch_codecs import decode_torch, encode_torch

__all__ = ["main"]

N = 4_194_304
REPS = 20


def median_ms(f: Callable[[], object]) -> float:
    """Median ms of `f` and the GPU work it queues, over REPS calls after one."""
    return median_seconds(f, REPS, sync=torch.cuda.synchronize) * 1e3


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    if not torch.cuda.is_available():
        print("datapath_costs: skipped, torch sees no CUDA GPU")
        return 0
    print("cpus", os.cpu_count(), "blake3", getattr(blake3, "__version__", "?"))
    x = torch.randn(N, device="cuda")
    a = np.random.randn(N).astype("<f4")
    for th in (1, 2, 4, 8, blake3.blake3.AUTO):
        ms = median_ms(lambda th=th: blake3.blake3(a.view(np.uint8).data,
                                                   max_threads=th).digest())
        print(f"blake3 16MB threads={th}: {ms:.2f} ms")
    print(f"D2H 16MB pageable .cpu(): {median_ms(lambda: x.cpu()):.2f} ms")
    pin = torch.empty(N, pin_memory=True)
    print(f"D2H 16MB pinned copy_: {median_ms(lambda: pin.copy_(x, non_blocking=True)):.2f} ms")
    pinned_u8 = torch.empty(N * 2, dtype=torch.uint8, pin_memory=True)
    pageable_u8 = torch.empty(N * 2, dtype=torch.uint8)
    print(f"H2D 8MB pageable: {median_ms(lambda: pageable_u8.to('cuda')):.2f} ms")
    ms = median_ms(lambda: pinned_u8.to("cuda", non_blocking=True))
    print(f"H2D 8MB pinned: {ms:.2f} ms")
    codec = get_codec("int4", 64)
    enc = encode_torch(codec, x)
    meta = CodecMeta(codec="int4", numel=N, block_size=64)
    out = torch.empty(N, device="cuda")
    print(f"encode_torch int4 4M: {median_ms(lambda: encode_torch(codec, x)):.2f} ms")
    ms = median_ms(lambda: decode_torch(codec, enc, meta, out=out))
    print(f"decode_torch int4 4M: {ms:.2f} ms")
    host_enc = enc.cpu().numpy().tobytes()
    print(f"host decode int4 4M: {median_ms(lambda: codec.decode(host_enc, meta)):.2f} ms")
    host_x = torch.from_numpy(a)
    print(f"host encode int4 4M: {median_ms(lambda: codec.encode(host_x)):.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
