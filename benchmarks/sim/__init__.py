"""Benchmarks that run the simulator in one process (no sockets)."""
