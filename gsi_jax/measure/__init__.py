"""Measurement: how benchmarks time and pair runs, the memory model, and what machine a
result came from."""
