"""Corpus discovery and split, BPE tokenizer, packing, and the step-addressed order."""

import dataclasses
import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from specjax.corpus import CorpusConfig, is_held_out, load_corpus, split_documents, stdlib_files
from specjax.train import tokenizer as tok_lib
from specjax.train.data import DataConfig, TokenData, batch_rows, build_data, pack, tokenize_corpus


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(CorpusConfig(max_files=60, eval_fraction=0.2))


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return tok_lib.train_bpe(corpus.train, vocab_size=320)


def test_stdlib_files_sorted_and_filtered():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files()
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel) and len(rel) > 100
    assert all(f.endswith(".py") for f in rel)
    for part in ("site-packages", "test", "tests", "pydoc_data", "__pycache__"):
        assert not any(part in Path(r).parts[:-1] for r in rel), part
    assert "os.py" in rel and "json/decoder.py" in rel


def test_split_deterministic_and_disjoint(corpus):
    again = load_corpus(CorpusConfig(max_files=60, eval_fraction=0.2))
    assert again == corpus
    assert corpus.train and corpus.eval
    assert not set(corpus.train) & set(corpus.eval)
    # The split is a function of each text alone: order and neighbours do not matter.
    docs = list(corpus.train + corpus.eval)
    train, held = split_documents(reversed(docs), 0.2)
    assert set(train) == set(corpus.train) and set(held) == set(corpus.eval)
    assert all(is_held_out(d, 0.2) for d in corpus.eval)


def test_limits():
    small = load_corpus(CorpusConfig(max_files=20, eval_fraction=0.3))
    assert len(small.train) + len(small.eval) <= 20
    capped = load_corpus(CorpusConfig(max_chars=50_000, eval_fraction=0.3))
    assert sum(map(len, capped.train + capped.eval)) == 50_000


def test_user_corpora(tmp_path):
    (tmp_path / "a.txt").write_text("alpha document\n")
    lines = [json.dumps({"text": f"record number {i}"}) for i in range(40)]
    (tmp_path / "b.jsonl").write_text("\n".join(lines) + "\n\n")
    c = load_corpus(CorpusConfig(source=str(tmp_path), eval_fraction=0.25))
    assert set(c.train + c.eval) == {"alpha document\n"} | {f"record number {i}" for i in range(40)}
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": 1}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        load_corpus(CorpusConfig(source=str(tmp_path / "bad.jsonl")))
    with pytest.raises(FileNotFoundError, match="nope"):
        load_corpus(CorpusConfig(source=str(tmp_path / "nope")))


def test_tokenizer_round_trip(tokenizer, corpus, tmp_path):
    assert tokenizer.get_vocab_size() == 320
    ids = tok_lib.special_ids(tokenizer)
    assert (ids.bos, ids.eos, ids.pad) == (0, 1, 2)
    for text in (*corpus.eval[:3], "déjà vu — λx: x ∈ ℝ 🙂\n\ttabs  and  spaces"):
        assert tokenizer.decode(tokenizer.encode(text).ids) == text
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    again = tok_lib.load_tokenizer(tmp_path / "tokenizer.json")
    assert tok_lib.fingerprint(again) == tok_lib.fingerprint(tokenizer)
    assert again.encode(corpus.eval[0]).ids == tokenizer.encode(corpus.eval[0]).ids
    with pytest.raises(ValueError, match="vocab_size=100"):
        tok_lib.train_bpe(["x"], vocab_size=100)


def test_pack():
    docs = [np.array([5, 6, 7]), np.array([8]), np.array([9, 10])]
    rows = pack(docs, seq_len=4, bos=0, eos=1)
    assert rows.tolist() == [[0, 5, 6, 7], [1, 0, 8, 1], [0, 9, 10, 1]]
    assert pack(docs, seq_len=5, bos=0, eos=1).shape == (2, 5)  # remainder dropped


def test_order_is_a_function_of_step():
    n, b = 10, 4
    first = [batch_rows(s, b, n, seed=3) for s in range(10)]
    assert all(np.array_equal(first[s], batch_rows(s, b, n, seed=3)) for s in (7, 2, 9))
    flat = np.concatenate(first)  # 40 examples = 4 epochs, each a permutation of all rows
    for e in range(4):
        assert sorted(flat[e * n:(e + 1) * n]) == list(range(n))
    assert not np.array_equal(flat[:n], flat[n:2 * n])  # epochs are reshuffled
    assert not np.array_equal(np.concatenate([batch_rows(s, b, n, seed=4) for s in range(3)]),
                              flat[:12])


def test_token_data_batches(corpus, tokenizer):
    data = tokenize_corpus(corpus, tokenizer, seq_len=32, seed=0)
    assert data.train.dtype == np.int32 and data.train.shape[1] == 32
    batch = data.train_batch(5, 4)
    assert batch["tokens"].shape == (4, 32) and batch["mask"].all()
    evals = data.eval_batches(3)
    assert sum(int(b["mask"][:, 0].sum()) for b in evals) == len(data.eval)
    last = evals[-1]
    assert all(b["tokens"].shape == (3, 32) for b in evals)
    pad_rows = last["mask"][:, 0] == 0
    assert (last["tokens"][pad_rows] == data.pad_id).all()
    assert data.describe() == tokenize_corpus(corpus, tokenizer, 32, 0).describe()
    with pytest.raises(ValueError, match="packs into no sequences"):
        TokenData(data.train[:0], data.eval, 2, 0, "empty")


def test_train_rows_keeps_evenly_spaced_rows(tokenizer):
    """DataConfig.train_rows keeps that many distinct training rows spread over the whole
    packed split (first and last included), the held-out rows untouched; more rows than
    the split holds keeps them all; a bad count names itself."""
    config = DataConfig(CorpusConfig(max_files=60, eval_fraction=0.2), seq_len=32)
    whole = build_data(config, tokenizer, seed=0)
    kept = build_data(dataclasses.replace(config, train_rows=7), tokenizer, seed=0)
    assert kept.train.shape == (7, 32)
    rows = [next(i for i, r in enumerate(whole.train) if (r == k).all()) for k in kept.train]
    assert rows[0] == 0 and rows[-1] == len(whole.train) - 1 and rows == sorted(set(rows))
    assert min(np.diff(rows)) >= (len(whole.train) - 1) // 6 - 1  # spread, not a prefix
    np.testing.assert_array_equal(kept.eval, whole.eval)
    everything = build_data(dataclasses.replace(config, train_rows=10**6), tokenizer, seed=0)
    np.testing.assert_array_equal(everything.train, whole.train)
    with pytest.raises(ValueError, match="train_rows=0"):
        DataConfig(train_rows=0)
