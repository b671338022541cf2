"""Benchmarks behind `tiercache bench ...` (each prints a table and, with --json, machine-readable rows)."""
