"""Benchmarks: speed, memory and footprint measurements written to docs/results."""
