"""specjax.bench.kv_cache on a tiny model: every cache dtype runs, bytes per token are
ordered as the dtypes, and bad arguments exit naming the value."""

import argparse

import pytest

from specjax.bench import kv_cache


def test_runs_every_dtype_on_a_tiny_model(monkeypatch, capsys):
    monkeypatch.setattr(kv_cache, "BENCH_CONFIG", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, max_position_embeddings=256))
    rows = kv_cache.run([48], batch=2, new_tokens=8, repeats=1)
    by = {r["dtype"]: r for r in rows}
    assert list(by) == list(kv_cache.DTYPES)
    assert by["float32"]["vs_float32"] == 1.0 and by["float32"]["same_tokens"] == 16
    # head_dim 16: float32 64 bytes a vector, bf16 32, int8 16 + a 4-byte scale
    assert by["float32"]["kv_bytes_per_token"] > by["bfloat16"]["kv_bytes_per_token"] > \
        by["int8"]["kv_bytes_per_token"]
    args = argparse.Namespace(batch=2, new_tokens=8, repeats=1)
    text = kv_cache.markdown(rows, args, "python -m specjax.bench.kv_cache")
    assert "| 48 | int8 |" in text and "- command: `python -m specjax.bench.kv_cache`" in text


@pytest.mark.parametrize("argv, match", [
    (["--contexts", "64,x"], "--contexts='64,x'"),
    (["--contexts", "64", "--new-tokens", "64"], "--new-tokens=64"),
    (["--repeats", "0"], "--repeats=0")])
def test_bad_arguments_exit_with_a_message(argv, match, capsys):
    with pytest.raises(SystemExit) as err:
        kv_cache.main(argv)
    assert err.value.code == 2 and match in capsys.readouterr().err
