"""The benchmark script runs (CPU: interpret mode, --small), so it is not broken."""

import json

import pytest

from specjax.pallas_kernels import bench


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


@pytest.mark.parametrize("lowering,kind", [("triton", "NVIDIA H100 80GB HBM3"),
                                           ("mosaic", "TPU v5 lite")])
def test_tune_entries_resolve_to_the_timed_sizes(monkeypatch, lowering, kind):
    """Every candidate `--tune` may time, printed as a table entry and read back through
    `resolve_block_sizes`, gives the same kernel options (splits and warps included)."""
    import jax.numpy as jnp

    from specjax.pallas_kernels.ragged_paged_attention import tuned_block_sizes as tuned

    for s in bench.tune_shapes(small=False).values():
        candidates = bench.tune_candidates(s, False, jnp.bfloat16, lowering=lowering,
                                           interpret=False, device_kind=kind)
        assert len({tuple(sorted(c.items())) for c in candidates}) == len(candidates) > 1
        for sizes in candidates:
            entry = bench.table_entry(s, sizes)
            monkeypatch.setattr(tuned, "TUNED_BLOCK_SIZES", {
                "TESTDEV": {r: entry for r in (tuned.DECODE, tuned.VERIFY, tuned.PREFILL)},
                "": tuned.TUNED_BLOCK_SIZES[""]})
            got = bench.resolve_for(s, jnp.bfloat16, lowering=lowering, interpret=False,
                                    device_kind="TESTDEV")
            if lowering == "mosaic":
                assert "num_warps" not in sizes and got["kv_splits"] == 1
                got = {k: got[k] for k in sizes}
            assert got == sizes, (s.name, entry)
