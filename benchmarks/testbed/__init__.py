"""Benchmarks on the WAN test bed (network namespaces and rate limits; needs root)."""
