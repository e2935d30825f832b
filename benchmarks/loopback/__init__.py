"""Benchmarks of real processes on 127.0.0.1."""
