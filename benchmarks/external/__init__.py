"""External baselines on shaped links (`benchmarks/bench_external.py`)."""
