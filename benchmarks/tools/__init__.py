"""Tooling the node never runs: fuzzers and network-namespace helpers for benchmarks and tests."""
