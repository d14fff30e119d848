"""Target-generated training text: the continuations are the target's own (greedy ones
equal `generate`'s) from seeded windows or function docstrings of the training
documents, a killed run resumes without repeating or losing a call, and the file reads
back as a corpus."""

import dataclasses
import json

import pytest
import train_setup

import specjax
from specjax.bench.prompts import build_prompts
from specjax.corpus import CorpusConfig, encode_documents, load_corpus
from specjax.pysource import docstring_texts
from specjax.train.regenerate import RegenerateConfig, prefixes, regenerate, training_prompts

CONFIG = RegenerateConfig(prompts=6, prompt_len=8, new_tokens=6, temperatures=(0.0, 1.0),
                          batch=2, seed=3)


@pytest.fixture(scope="module")
def target():
    return specjax.init_model(train_setup.MODEL, seed=0, tokenizer=train_setup.tokenizer())


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(train_setup.DATA.corpus)


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_continuations_are_the_targets_own(target, corpus, tmp_path):
    path = regenerate(target, corpus, CONFIG, tmp_path / "regen.jsonl")
    records = _records(path)
    assert len(records) == CONFIG.prompts
    # calls alternate the temperatures, a call's rows share one
    assert [r["temperature"] for r in records] == [0.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    tok = target.tokenizer
    # the prompts regenerate draws, from the training documents: any held-out document
    # among them would change the windows and so the texts compared below
    prompts = prefixes(encode_documents(tok, corpus.train), CONFIG.prompt_len,
                       CONFIG.prompts, CONFIG.prompt_len + CONFIG.new_tokens, CONFIG.seed)
    greedy = specjax.generate(target, prompts[:2], max_new_tokens=CONFIG.new_tokens)
    for prompt, new, record in zip(prompts, greedy.tokens, records):
        assert record["text"] == tok.decode(prompt + new, skip_special_tokens=True)
    # sampled rows are seeded: the same call gives the same text again
    again = regenerate(target, corpus, CONFIG, tmp_path / "again.jsonl")
    assert _records(again) == records
    # and the file is a corpus the heads' data pipeline reads
    read = load_corpus(CorpusConfig(source=str(path), eval_fraction=0.5))
    assert sorted(read.train + read.eval) == sorted(r["text"] for r in records)


def test_prefixes_are_seeded_windows_of_the_documents(corpus, target):
    tok = target.tokenizer
    docs = encode_documents(tok, corpus.train)
    train_text = "".join(corpus.train)
    picked = prefixes(docs, 8, 20, 14, seed=0)
    for p in picked:
        assert len(p) == 8 and tok.decode(p) in train_text
    assert prefixes(docs, 8, 20, 14, seed=0) == picked != prefixes(docs, 8, 20, 14, seed=1)


def test_docstring_prompts_end_after_a_training_functions_docstring(target, corpus,
                                                                   tmp_path):
    tok = target.tokenizer
    config = dataclasses.replace(CONFIG, prompt_style="docstring", prompt_len=96)
    prompts = training_prompts(tok, corpus, config)
    heads = {h for doc in corpus.train for h in docstring_texts(doc)}
    assert len(prompts) == config.prompts
    for p in prompts:
        assert config.prompt_len // 2 < len(p) <= config.prompt_len
        assert tok.decode(p) in heads  # a def line and docstring, whole, of a training doc
    assert training_prompts(tok, corpus, dataclasses.replace(config, seed=4)) != prompts
    records = _records(regenerate(target, corpus, config, tmp_path / "doc.jsonl"))
    greedy = specjax.generate(target, prompts[:2], max_new_tokens=config.new_tokens)
    for prompt, new, record in zip(prompts, greedy.tokens, records):
        assert record["text"] == tok.decode(prompt + new, skip_special_tokens=True)
    # no prompt from a held-out document (unless a training one has the same function)
    held_only = {h for doc in corpus.eval for h in docstring_texts(doc)} - heads
    assert held_only and not held_only & {tok.decode(p) for p in prompts}
    # the draw is the suite's docstring category's, on the training documents: the
    # recorded recipe's prompts stay what they were if the suite's categories change
    suite = build_prompts("docstring", corpus.train, tok, config.prompts, config.prompt_len,
                          config.seed)
    assert [q.ids for q in suite] == prompts


def test_a_killed_run_resumes_after_its_last_whole_call(target, corpus, tmp_path):
    path = tmp_path / "killed.jsonl"
    whole = regenerate(target, corpus, CONFIG, path).read_text()
    lines = whole.splitlines(keepends=True)
    path.write_text("".join(lines[:3]) + lines[3][:5])  # a call and a half, one cut line
    regenerate(target, corpus, CONFIG, path)
    assert path.read_text() == whole
    regenerate(target, corpus, CONFIG, path)  # finished: nothing runs, nothing is added
    assert path.read_text() == whole
    # a run with other settings starts afresh instead of resuming this file
    other = dataclasses.replace(CONFIG, seed=4, prompts=4)
    fresh = regenerate(target, corpus, other, tmp_path / "fresh.jsonl").read_text()
    assert regenerate(target, corpus, other, path).read_text() == fresh != whole[:len(fresh)]


def test_bad_settings_name_the_value(target, corpus, tmp_path):
    with pytest.raises(ValueError, match="prompts=0"):
        RegenerateConfig(prompts=0)
    with pytest.raises(ValueError, match="eval_fraction=1.0"):
        RegenerateConfig(eval_fraction=1.0)
    with pytest.raises(ValueError, match="prompt_style='chat'"):
        RegenerateConfig(prompt_style="chat")
    with pytest.raises(ValueError, match="temperatures"):
        RegenerateConfig(temperatures=(-1.0,))
    with pytest.raises(ValueError, match="docstring prompts of 5..8 tokens"):
        regenerate(target, corpus, RegenerateConfig(prompts=4, prompt_len=8,
                                                    prompt_style="docstring"),
                   tmp_path / "y.jsonl")
    with pytest.raises(ValueError, match="100000 asked"):
        regenerate(target, corpus, RegenerateConfig(prompts=100000, prompt_len=8),
                   tmp_path / "x.jsonl")
