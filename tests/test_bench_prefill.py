"""specjax.bench.prefill: one row per prompt length with specjax's prefill time (and
llama.cpp's beside it when asked), prompts of exactly the lengths asked for, and bad
flags that name themselves."""

from __future__ import annotations

import json

import pytest

import specjax
from specjax.bench import prefill
from specjax.bench.prompts import source_ids
from specjax.config import tiny_llama

INSTALL = "llama-cpp-python is in the bench extra: pip install -e '.[bench]'"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    model = specjax.init_model(tiny_llama(vocab_size=64), seed=0)
    return specjax.save_gguf(model, tmp_path_factory.mktemp("prefill") / "tiny.gguf")


def test_a_row_per_length(tiny_gguf, tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert prefill.main(["--target", str(tiny_gguf), "--tokens", "8,40", "--repeats", "2",
                         "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["tokens"] for r in rows] == [8, 40]
    assert all(r["specjax_ms"] > 0 and "llamacpp_ms" not in r for r in rows)
    assert "| 40 |" in capsys.readouterr().out


def test_a_batch_beside_the_ngram_prefill(tiny_gguf, tmp_path, capsys):
    """--batch and --ngram: the rows say their batch and carry the speculative call's
    prefill time beside plain decoding's."""
    out = tmp_path / "rows.json"
    assert prefill.main(["--target", str(tiny_gguf), "--tokens", "24", "--repeats", "1",
                         "--batch", "3", "--ngram", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["batch"] == 3 and row["specjax_ms"] > 0 and row["ngram_ms"] > 0
    text = capsys.readouterr().out
    assert "specjax n-gram ms" in text and "specjax at batch 3" in text


def test_prompts_are_the_lengths_asked_for():
    ids = source_ids(None, 64, 30)
    assert len(ids) == 30 and ids == source_ids(None, 64, 30) and max(ids) < 64


@pytest.mark.slow
def test_beside_llama_cpp(tmp_path):
    """A model with a tokenizer (llama.cpp needs one): its prompt is argparse.py's tokens."""
    pytest.importorskip("llama_cpp", reason=INSTALL)
    from tests.test_gguf_write import tiny_model

    path = specjax.save_gguf(tiny_model("llama"), tmp_path / "tiny.gguf")
    out = tmp_path / "rows.json"
    assert prefill.main(["--target", str(path), "--tokens", "8", "--repeats", "1",
                         "--llamacpp", "write", "--threads", "1", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["llamacpp_ms"] > 0 and row["specjax_ms"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "0"], "--tokens='0': every value must be >= 1"),
    (["--tokens", "a,b"], "comma-separated integers"),
    (["--repeats", "0"], "--repeats=0 must be >= 1"),
    (["--batch", "0"], "--batch=0 must be >= 1"),
    (["--dtype", "float16"], "--dtype: invalid choice: 'float16'"),
])
def test_bad_flags_name_themselves(argv, message, capsys):
    with pytest.raises(SystemExit):
        prefill.main(argv)
    assert message in capsys.readouterr().err
