"""dilonode's benchmarks, by where they run: `sim` (the simulator), `loopback` (real
processes on 127.0.0.1), `testbed` (the WAN test bed, root), `gpu` (a GPU host,
benchmarks/gpu.sh) and `micro` (one mechanism's cost in one process). benchmarks/README.md
is the index; `harness` holds what they share."""
