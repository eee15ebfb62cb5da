"""Benchmarks of the eviction engine (not part of the library): speed, memory and operation counts."""
