"""Benchmarks: `python -m benchmarks.engine` measures the machine, the engine and a reference."""
