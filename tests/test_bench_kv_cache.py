"""specjax.bench.kv_cache on a tiny model: every cache dtype runs, bytes per token are
ordered as the dtypes, drift is counted, and bad arguments exit naming the value."""

import argparse

import pytest

from specjax.bench import kv_cache


def test_runs_every_dtype_on_a_tiny_model():
    import specjax
    from specjax.bench.prompts import heldout_windows
    from specjax.config import ModelConfig

    model = specjax.init_model(ModelConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, max_position_embeddings=256), seed=0)
    ids = heldout_windows(None, 128, 5, 40, seed=0)
    assert len(ids) == 5 and all(len(r) == 40 for r in ids) and ids[0] != ids[1]
    rows = kv_cache.run(model, {48: (ids[:2], ids[2:])}, new_tokens=8, repeats=1)
    by = {r["dtype"]: r for r in rows}
    assert list(by) == list(kv_cache.DTYPES)
    f32 = by["float32"]
    assert f32["vs_float32"] == 1.0 and f32["tpot_vs_float32"] == 1.0 and f32["tpot_ms"] > 0
    assert (f32["same_tokens"], f32["same_rows"], f32["rows"]) == (24, 3, 3)
    assert f32["first_difference"] is None and f32["batch"] == 2
    # float32: n-gram speculation is exactly plain decoding's greedy output
    assert f32["ngram"] == dict(same_tokens=24, same_rows=3, first_difference=None)
    # head_dim 16: float32 64 bytes a vector, bf16 32, int8 16 + a 4-byte scale
    assert f32["kv_bytes_per_token"] > by["bfloat16"]["kv_bytes_per_token"] > \
        by["int8"]["kv_bytes_per_token"]
    args = argparse.Namespace(batch=2, new_tokens=8, repeats=1, drift_prompts=3)
    text = kv_cache.markdown(rows, args, "python -m specjax.bench.kv_cache", "tiny")
    assert "| 48 | int8 |" in text and "- command: `python -m specjax.bench.kv_cache`" in text
    rows = kv_cache.run(model, {48: (ids[:1], ids[4:])}, new_tokens=4, repeats=1,
                        dtypes=("float32", "int8"))
    assert [r["dtype"] for r in rows] == ["float32", "int8"]
    with pytest.raises(ValueError, match="must include float32"):
        kv_cache.run(model, {48: (ids[:1], ids[4:])}, new_tokens=4, repeats=1,
                     dtypes=("int8",))


def test_agreement_counts_equal_tokens_rows_and_the_first_flip():
    got = kv_cache._agreement([[1, 2, 3, 4], [5, 6, 7, 8], [1, 1, 1, 1]],
                              [[1, 2, 9, 4], [5, 6, 7, 8], [2, 1, 1, 1]])
    assert got == dict(same_tokens=3 + 4 + 3, same_rows=1, first_difference=0)
    assert kv_cache._agreement([[1, 2]], [[1, 2]])["first_difference"] is None


@pytest.mark.parametrize("argv, match", [
    (["--contexts", "64,x"], "--contexts='64,x'"),
    (["--contexts", "64", "--new-tokens", "64"], "--new-tokens=64"),
    (["--repeats", "0"], "--repeats=0"),
    (["--drift-prompts", "0"], "--drift-prompts=0"),
    (["--kv-cache-dtypes", "int8"], "--kv-cache-dtypes='int8' must include float32"),
    (["--kv-cache-dtypes", "float32,fp8"], "--kv-cache-dtypes"),
    (["--contexts", "9000"], "9000 exceeds the model's 8192 positions")])
def test_bad_arguments_exit_with_a_message(argv, match, capsys):
    with pytest.raises(SystemExit) as err:
        kv_cache.main(argv)
    assert err.value.code == 2 and match in capsys.readouterr().err


def test_heldout_windows_of_the_real_tokenizer_are_held_out_code():
    """With a tokenizer, the windows are `length` ids of the standard library's held-out
    split (the `long` prompts), distinct, the same for the same seed."""
    from specjax.bench.prompts import _heldout_docs, heldout_windows
    from specjax.bench.target import load_target

    tok = load_target().tokenizer
    ids = heldout_windows(tok, 0, 3, 64, seed=0)
    assert len(ids) == 3 and all(len(r) == 64 for r in ids) and len({tuple(r) for r in ids}) == 3
    assert heldout_windows(tok, 0, 3, 64, seed=0) == ids
    docs = _heldout_docs()
    assert all(any(tok.decode(r[1:-1]) in d for d in docs) for r in ids)
