"""Benchmark scripts (run as modules or through `specjax bench`), never timed tests."""
