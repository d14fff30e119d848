"""The benchmark script runs (CPU: interpret mode, --small), so it is not broken."""

import json

import pytest

from pallas_kernels import bench


def test_bench_small(tmp_path, capsys):
    out = tmp_path / "bench.jsonl"
    bench.main(["--small", "--dtype", "float32", "--iters", "1", "--copy-mib", "8", "--only",
                "B=1 ctx=64$|tree T=5", "--json", str(out)])
    header, *rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert header["interpret"] == (header["device"] == "cpu")
    assert {r["impl"] for r in rows} == {
        "pallas ragged (ours)", "jax pallas gpu paged_attention", "jnp reference (XLA)"}
    assert all(r["max_abs_err"] < 1e-4 for r in rows)  # float32 on CPU
    assert "n/a" in capsys.readouterr().out  # no tree mask in JAX's kernel


@pytest.mark.slow
def test_bench_tune_small(capsys):
    bench.main(["--small", "--tune", "--iters", "1"])
    printed = capsys.readouterr().out
    assert all(regime in printed for regime in ("DECODE", "VERIFY", "PREFILL"))


def test_bench_small_int8(tmp_path):
    out = tmp_path / "bench.jsonl"
    bench.main(["--small", "--int8", "--dtype", "float32", "--iters", "1", "--copy-mib", "8",
                "--only", "B=1 ctx=64$", "--json", str(out)])
    header, *rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert header["int8"] and len(rows) == 3
    assert all(r["max_abs_err"] < 1e-4 for r in rows)  # all dequantize the same way
