"""The Python stages of benchmarks/gpu.sh (they also run on the CPU at toy sizes)."""
