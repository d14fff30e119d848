"""Benchmark scripts (not tests): `python -m specjax.bench.<name>` or `specjax bench <name>`."""
