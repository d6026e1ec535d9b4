"""Engine simulator, workloads and benchmarks for meshd."""
