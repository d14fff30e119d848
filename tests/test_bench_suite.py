"""The benchmark suite: its prompt categories have the properties they claim, it runs end
to end on a tiny fake quickstart workdir (random models, random heads, a tokenizer
trained here) and writes a section with every method and category, and bad input is a
clear error with a non-zero exit."""

from __future__ import annotations

import ast
import dataclasses
import io
import json
import re
import textwrap
import tokenize
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import specjax
from specjax.bench import prompts as P, suite, suite_methods, suite_report
from specjax.calibrate import MIN_TIMED_CALLS
from specjax.cli import main as cli
from specjax.config import tiny_llama
from specjax.corpus import CorpusConfig, load_corpus
from specjax.speculators import Eagle, Medusa
from specjax.timing import balanced_order
from specjax.train.tokenizer import train_bpe

VOCAB = 320
# what the suite runs without --methods: every method but those that need a corpus file
# and those named to run
DEFAULT_METHODS = tuple(m for m in suite.SPECJAX_METHODS + suite.HF_METHODS
                        if m not in suite_methods.CORPUS_METHODS + suite_methods.OPT_IN_METHODS)
WORDS = ("alpha", "beta", "gamma", "delta", "total", "scale", "offset", "limit")
# Every category in one length band (33..64 tokens): one compiled program per method.
# One torch thread: two spin badly on a shared 2-core machine (see docs/benchmarks.md).
TINY = ["--batches", "1", "--prompts", "2", "--new", "4", "--repeats", "1", "--k", "2",
        "--short-tokens", "64", "--edit-tokens", "64", "--long-tokens", "64",
        "--torch-threads", "1"]


def write_corpus(root: Path, files: int = 12) -> None:
    """Small Python modules: functions with docstrings, short ones without, a long table."""
    rng = np.random.default_rng(0)
    for i in range(files):
        parts = [f'"""Module {i}: small helpers."""\n\nimport math\n\n\n']
        for j in range(6):
            a, b = rng.choice(WORDS, 2, replace=False)
            parts.append(f'def f{i}_{j}({a}, {b}):\n    """Combine {a} and {b}.\n\n'
                         f'    Step {j} of module {i}, {b} first.\n    """\n'
                         f"    x = {a} + {b}\n    y = x * {j + 1}\n    return y - {a}\n\n\n")
            parts.append(f"def g{i}_{j}({a}):\n    x = {a} + {j}\n    y = x * x\n"
                         f"    return y\n\n\n")
        parts.append("TABLE = [\n" + "".join(f"    ({k}, {k * i}),\n" for k in range(60)) + "]\n")
        (root / f"mod{i:02d}.py").write_text("".join(parts))


def corpus_and_tokenizer(root: Path):
    """The suite tests' corpus written under root/corpus (half held out) and a BPE
    tokenizer trained on its train split."""
    (root / "corpus").mkdir()
    write_corpus(root / "corpus")
    corpus = CorpusConfig(source=str(root / "corpus"), eval_fraction=0.5)
    return corpus, train_bpe(load_corpus(corpus).train, VOCAB)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A finished quickstart run in miniature: target/draft exports with the tokenizer,
    random Medusa and EAGLE heads, and target/DONE.json naming the corpus."""
    root = tmp_path_factory.mktemp("suite")
    corpus, tok = corpus_and_tokenizer(root)
    w = root / "run"
    ids = dict(bos_token_id=0, eos_token_id=1)
    target = specjax.init_model(tiny_llama(VOCAB, num_layers=1, **ids), seed=0)
    target = dataclasses.replace(target, tokenizer=tok)
    draft = specjax.init_model(tiny_llama(VOCAB, num_layers=1, hidden_size=32,
                                          intermediate_size=64, num_heads=2, num_kv_heads=1,
                                          **ids), seed=1)
    specjax.save_hf(target, w / "target" / "export")
    specjax.save_hf(dataclasses.replace(draft, tokenizer=tok), w / "draft" / "export")
    Medusa.random(target, num_heads=2, tree=[[0], [0, 0]]).save(w / "medusa" / "heads")
    Eagle.random(target, top_k=2, depth=2, total_tokens=3).save(w / "eagle" / "heads")
    settings = {"data": {"corpus": dataclasses.asdict(corpus), "seq_len": 64}, "seed": 0}
    (w / "target" / "DONE.json").write_text(json.dumps({"settings": settings}))
    return w


@pytest.fixture(scope="module")
def heldout(workdir):
    docs, _ = suite.Workdir.check(workdir, ["autoregressive"]).heldout_documents()
    return docs, specjax.load(workdir / "target" / "export").tokenizer


def test_loop_steps_times_the_suites_prompts_of_a_category(workdir, heldout):
    """`bench.loop_steps --category`: the suite's prompts of the category, calibrated on
    others of it, the n-gram built as the suite builds it."""
    from specjax.bench import loop_steps

    flags = ("--short-tokens", "64", "--new", "4", "--k", "2")
    target, spec, cal, cost, prompts, new = loop_steps._category_inputs(
        workdir, "ngram", 0.0, "completion", 2, 1, flags)
    docs, tok = heldout
    want = suite.build_prompt_sets(["completion"], docs, tok, 2, {"completion": 64}, 0)
    assert prompts == [p.ids for p in want["completion"]] and new == 4
    assert (spec.k, spec.peeks, cost) == (2, True, 0.0)
    assert cal.proposal is not None and len(cal.prior) == 2
    with pytest.raises(SystemExit):  # the suite's own check of its flags
        loop_steps._category_inputs(workdir, "ngram", 0.0, "nonsense", 2, 1, flags)


def test_a_pretrained_targets_prompts_come_from_the_whole_corpus(workdir, tmp_path):
    """A quickstart run on a pretrained target (its target stage records the source)
    draws prompts from the whole corpus's held-out split, as its comparison does, not
    only from the few files its heads trained on."""
    import shutil

    real = tmp_path / "real"
    shutil.copytree(workdir, real)
    done = json.loads((real / "target" / "DONE.json").read_text())
    done["settings"]["data"]["corpus"]["max_files"] = 2
    (real / "target" / "DONE.json").write_text(json.dumps(done))
    few, _ = suite.Workdir.check(real, ["autoregressive"]).heldout_documents()
    done["settings"]["target"] = {"source": "model.gguf"}
    (real / "target" / "DONE.json").write_text(json.dumps(done))
    whole, config = suite.Workdir.check(real, ["autoregressive"]).heldout_documents()
    assert len(whole) > len(few) and set(few) <= set(whole)
    assert "max_files=None" in config


# ---- prompt categories ---------------------------------------------------------------
SOURCE = textwrap.dedent('''\
    class Box:
        def grow(self, amount, *, factor=2):
            """Grow the box.

            By amount times factor.
            """
            size = self.size + amount
            size = size * factor
            self.size = size  # keep
            return size
''')


def test_docstring_prompt_ends_right_after_the_docstring():
    fn = P.functions(SOURCE)[0]
    text = P.docstring_text(SOURCE, fn)
    assert text.endswith('    """\n') and "size" not in text
    tree = ast.parse(textwrap.dedent(text + "        pass\n"))
    fn2 = tree.body[0]
    assert ast.get_docstring(fn2) == ast.get_docstring(fn)
    assert [type(s) for s in fn2.body] == [ast.Expr, ast.Pass]  # the docstring, nothing else


def test_completion_prompt_cuts_the_body_in_the_middle():
    fn = P.functions(SOURCE)[0]
    whole = "".join(SOURCE.splitlines(keepends=True)[fn.lineno - 1:fn.end_lineno])
    cuts = {P.completion_text(SOURCE, fn, np.random.default_rng(s)) for s in range(20)}
    for text in cuts:
        assert whole.startswith(text) and text.endswith("\n")
        body_lines = text.count("\n") - 5  # def line + four docstring lines
        assert 2 <= body_lines <= 3 and whole[len(text):].strip()  # some body left
    assert len(cuts) > 1  # the cut point is drawn


def _shape(line: str) -> str:
    return re.sub(r"\w+", "w", line)


def test_repetitive_prompt_is_a_block_then_a_renamed_copy():
    fn = P.functions(SOURCE)[0]
    text = P.repetitive_text(SOURCE, fn, np.random.default_rng(0))
    block = "".join(SOURCE.splitlines(keepends=True)[fn.lineno - 1:fn.end_lineno])
    assert text.startswith(block + "\n")
    copy = text[len(block) + 1:].splitlines()
    assert 7 <= len(copy) < len(block.splitlines())  # the copy's start, into the body
    assert [_shape(x) for x in copy] == [_shape(x) for x in block.splitlines()[:len(copy)]]
    toks = list(tokenize.generate_tokens(io.StringIO(textwrap.dedent("\n".join(copy))).readline))
    names = {t.string for t, before in zip(toks[1:], toks) if t.type == tokenize.NAME
             and before.string != "."}  # not attributes
    assert P.local_names(fn) == ["grow", "amount", "factor", "size"]
    assert not names & set(P.local_names(fn)) and "self" in names  # all renamed, self kept
    renamed = P.rename_identifiers(block, dict.fromkeys(P.local_names(fn), "z"))
    assert "def z(self, z, *, z=2)" in renamed and "self.size = z  # keep" in renamed
    assert '"""Grow the box.' in renamed  # strings are not code


def test_lines_are_counted_as_the_parser_counts_them():
    """A form feed (stdlib files have them) is no line break for Python's parser."""
    src = "def f(a):\n    \"\"\"Doc.\x0c\"\"\"\n    x = a\x0c + 1\n    y = x\n    return y\n"
    fn = P.functions(src)[0]
    assert P.docstring_text(src, fn) == 'def f(a):\n    """Doc.\x0c"""\n'
    assert P.completion_text(src, fn, np.random.default_rng(0)) == src.rsplit("    return", 1)[0]


def test_prompt_sets_have_their_lengths_and_properties(heldout):
    docs, tok = heldout
    sets = {c: P.build_prompts(c, docs, tok, 3, 64, seed=0) for c in P.CATEGORIES}
    for c, ps in sets.items():
        assert len(ps) == 3 and all(p.category == c for p in ps)
        for p in ps:
            assert (len(p.ids) == 64) if c == "long" else (32 < len(p.ids) <= 64)
            assert tok.encode(p.text).ids == p.ids or c == "long"
    for p in sets["docstring"]:
        assert p.text.rstrip().endswith('"""') and p.text.startswith("def ")
    for p in sets["repetitive"]:
        lines = p.text.splitlines()
        blank = lines.index("")
        block, copy = lines[:blank], lines[blank + 1:]
        assert 2 <= len(copy) < len(block) and copy[0] != block[0]
        assert [_shape(x) for x in copy] == [_shape(x) for x in block[:len(copy)]]
    for p in sets["completion"]:
        doc = next(d for d in docs if p.text in d)
        rest = doc[doc.index(p.text) + len(p.text):].split("\n")[0]
        assert p.text.startswith("def ") and rest.startswith("    ") and rest.strip()
    long = sets["long"][0]
    assert any(tok.decode(long.ids) in d for d in docs)  # one file's consecutive tokens
    again = P.build_prompts("completion", docs, tok, 3, 64, seed=0)
    assert [p.ids for p in again] == [p.ids for p in sets["completion"]]
    other = P.build_prompts("completion", docs, tok, 3, 64, seed=1)
    assert [p.ids for p in other] != [p.ids for p in again]


def test_too_few_prompts_is_a_clear_error(heldout):
    docs, tok = heldout
    with pytest.raises(ValueError, match="docstring prompts of 5..8 tokens"):
        P.build_prompts("docstring", docs, tok, 2, 8, seed=0)
    with pytest.raises(ValueError, match="windows of 100000 tokens"):
        P.build_prompts("long", docs, tok, 1, 100000, seed=0)


# ---- the suite end to end -------------------------------------------------------------
@pytest.fixture(scope="module")
def finished(workdir, tmp_path_factory):
    out = tmp_path_factory.mktemp("docs")
    (out / "benchmarks.md").write_text("# Benchmarks\n\nkeep me\n")
    argv = ["--workdir", str(workdir), *TINY, "--out", str(out / "benchmarks.md"),
            "--figures", str(out / "figures"), "--json", str(out / "suite.json"),
            "--note", "a tiny test run"]
    code = suite.main(argv)
    return code, out, json.loads((out / "suite.json").read_text())


def test_suite_compares_every_method_on_every_category(finished):
    code, out, result = finished
    assert code == 0 and "partial" not in result  # the finished run replaced the parts
    assert "kernel (VERIFY_COST['cpu" in result["matmul"]  # SPECJAX_CPU_MATMUL=on (conftest)
    rows = result["rows"]
    cells = {(r["category"], r["temperature"], r["method"]) for r in rows}
    methods = DEFAULT_METHODS
    assert cells == {(c, t, m) for c in P.CATEGORIES for t in (0.0, 1.0) for m in methods}
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["speedup"] > 0
        if r["method"] in suite.SPECJAX_METHODS:
            assert r["tau"] >= 1.0 and 0 <= r["alpha"] <= 1
            assert r["analytical"] > 0 and r["analytical_free_verify"] >= r["analytical"]
    greedy = [r for r in rows if r["temperature"] == 0 and r["method"] in suite.SPECJAX_METHODS]
    assert all(r["identical"] is True for r in greedy)
    assert all(r["identical"] is None for r in rows if r["temperature"] == 1)
    auto = [r for r in rows if r["method"] == "autoregressive"]
    assert all(r["speedup"] == 1.0 and r["tau"] == 1.0 for r in auto)
    assert all(r["loop"] == "plain" for r in auto)
    # a method that drafted ran the speculative loop in at least one call
    assert all(r["loop"] != "plain" for r in rows if r.get("k"))
    assert all("loop" not in r for r in rows if r["method"] in suite.HF_METHODS)
    assert "| loop |" in suite_report.table(rows)
    # every cell against the fastest transformers method of its category and temperature
    for c in P.CATEGORIES:
        for t in (0.0, 1.0):
            cell = [r for r in rows if (r["category"], r["temperature"]) == (c, t)]
            best = max(r["tokens_per_s"] for r in cell if r["method"] in suite.HF_METHODS)
            for r in cell:
                assert r["vs_transformers"] == pytest.approx(r["tokens_per_s"] / best)
                assert r["vs_llamacpp"] is None  # llama.cpp did not run


def test_loop_kind_names_the_loop_the_calls_ran():
    assert suite.loop_kind(0, 4) == "plain"
    assert suite.loop_kind(4, 4) == "speculative"
    assert suite.loop_kind(1, 4) == "1/4 speculative"


def test_untimed_methods_are_those_after_the_baseline_that_never_drafted():
    from specjax.stats import untimed_methods
    specs = {"autoregressive": None, "ngram": object(), "draft": object(), "hf": None}
    calls = {"autoregressive": (0, 4), "ngram": (1, 4), "draft": (0, 4), "hf": (0, 4)}
    # the baseline and the peers (no speculator) are always timed; one drafting call is enough
    assert untimed_methods(specs, calls) == ["draft"]


@pytest.mark.parametrize("n", [2, 4, 5, 8, 9])
def test_round_order_moves_every_method_and_its_predecessor(n):
    """Over n rounds every method runs once at every position (a Latin square); from one
    round to the next no method keeps its predecessor; for an even n every ordered pair
    of methods is adjacent exactly once (Williams' balance)."""
    names = [f"m{i}" for i in range(n)]

    def round_order(r):  # the order side_by_side runs the methods in
        return [names[i] for i in balanced_order(n, r)]

    rounds = [round_order(r) for r in range(n)]
    assert all(sorted(r) == names for r in rounds)
    assert all(sorted(col) == names for col in zip(*rounds))

    def before(order):
        return {b: a for a, b in zip(order, order[1:])}

    for this, nxt in zip(rounds, rounds[1:]):
        p, q = before(this), before(nxt)
        assert not [m for m in p.keys() & q.keys() if p[m] == q[m]]
    pairs = [pair for r in rounds for pair in zip(r, r[1:])]
    if n % 2 == 0:
        assert len(set(pairs)) == len(pairs) == n * (n - 1)
    assert round_order(n + 1) == rounds[1]


def fake_generate_calls(monkeypatch, fake_pass) -> None:
    """Patches the suite's specjax passes: `fake_pass(target, spec, ids, batch=, **kw)`
    -> (tokens, stats, wall) for each call's rows (batch rows), the parts joined as
    `merge_pass` does but with the stats of the last call (fakes do not merge)."""
    from specjax import passes

    def calls(target, spec, ids, *, batch, **kw):
        return [lambda i=i: fake_pass(target, spec, ids[i:i + batch], batch=batch, **kw)
                for i in range(0, len(ids), batch)]

    def merge(parts):
        return ([row for toks, _, _ in parts for row in toks], parts[-1][1],
                sum(w for _, _, w in parts))

    monkeypatch.setattr(passes, "generate_calls", calls)
    monkeypatch.setattr(passes, "merge_pass", merge)


def fake_stats(**kw) -> SimpleNamespace:
    base = dict(acceptance_rate=0.5, mean_accepted_length=1.5, mean_k=1.0, cost_ratio=0.1,
                expected_speedup=1.2, ttft_s=0.01, expected_speedup_free_verify=1.4,
                expected_speedup_iid=1.1, tpot_s=0.01, speculative_calls=1)
    return SimpleNamespace(**dict(base, **kw))


def test_timed_rounds_interleave_the_methods_call_by_call(monkeypatch):
    """Within a round every method's call j (specjax's generate call, a peer's prompt j)
    runs before call j + 1 of any; no method opens every call (the first measured slower
    on the same programs); autoregressive stays the reference whatever its position, and
    the peers (transformers, llama.cpp) at batch 1 are timed in the same rounds."""
    order = []

    def fake_pass(target, spec, ids, *, batch, **kw):
        order.append((spec, ids[0][0]))
        return [[len(order)] * 4], fake_stats(), 0.1

    fake_generate_calls(monkeypatch, fake_pass)
    names = ["autoregressive", "ngram", "draft"]
    ids = [[1, 2], [3, 4]]
    # a peer at batch 1 runs in the same rounds: one warm-up, then a call per prompt
    peer = suite._Peer(warm=lambda: order.append(("peer warm-up", 1)),
                       calls=[lambda i=i: order.append(("peer", ids[i][0])) or
                              ([[9] * 4], 0.1, 1) for i in range(2)])
    rows, peer_results = suite._specjax_rows(
        None, {n: n for n in names}, ids, "docstring", 0.0, 1, {},
        {n: {} for n in names}, 4, 4, {}, lambda _: None, peers={"peer": peer})
    methods = names + ["peer"]
    warm = order[:len(names) * 2 + 1]  # each specjax method over both prompts, the peer once
    assert sorted(m for m, _ in warm) == sorted(names * 2 + ["peer warm-up"])
    timed = order[len(warm):]
    assert len(timed) == 4 * len(methods) * 2  # rounds x methods x prompts
    calls = [timed[i:i + len(methods)] for i in range(0, len(timed), len(methods))]
    assert all(sorted(m for m, _ in c) == sorted(methods) for c in calls)
    assert [p for c in calls for _, p in c] == [1] * 4 + [3] * 4 + [1] * 4 + [3] * 4 + \
        [1] * 4 + [3] * 4 + [1] * 4 + [3] * 4  # prompt 0 of every method, then prompt 1
    assert {c[0][0] for c in calls} == set(methods)  # each method opens some call
    assert [r["method"] for r in rows] == names
    # the reference is autoregressive's last pass: its tokens are identical to themselves
    assert rows[0]["identical"] is True and rows[1]["identical"] is False
    assert len(peer_results["peer"]) == 4
    # a peer's round: its prompts' tokens joined, walls and target calls summed
    assert peer_results["peer"][0] == ([[9] * 4, [9] * 4], 0.2, 2)
    ref = suite.Reference([[4] * 4] * 2, [0.2] * 4, [0.01] * 4)  # 40 tokens/s each round
    peer_row = suite._peer_row("peer", peer, peer_results["peer"], ids, "docstring",
                               dict(new=4, temperature=0.0), ref, lambda _: None)
    assert peer_row["tokens_per_s"] == 8 / 0.2 and peer_row["tau"] == 2 * 4 * 4 / 8
    assert peer_row["speedup"] == 1.0 and peer_row["identical"] is False
    # each round's wall seconds in the row, the ones its speedup pairs
    assert peer_row["round_wall_s"] == [r[1] for r in peer_results["peer"]]


def test_a_method_on_plain_programs_reports_autoregressives_rounds(monkeypatch):
    """A speculator whose warm-up ran plain decoding's programs in every call is not
    timed in the rounds (it would time autoregressive's programs again) nor run again:
    its warm-up over every prompt gives its tokens and stats, with autoregressive's
    tokens/s and a speedup of exactly 1; a speculator that drafted in any call is timed
    in every round."""
    order = []

    def fake_pass(target, spec, ids, *, batch, **kw):
        order.append(spec)
        drafted = {"autoregressive": 0, "ngram": 0, "draft": 1}[spec]  # calls that drafted
        stats = fake_stats(acceptance_rate=0.0, mean_accepted_length=1.0, mean_k=0.0,
                           expected_speedup=1.0, expected_speedup_free_verify=1.0,
                           expected_speedup_iid=1.0, tpot_s=0.01 * len(order),
                           speculative_calls=drafted)
        return [[7] * 4, [7] * 4], stats, 0.1 * len(order)  # every pass slower

    fake_generate_calls(monkeypatch, fake_pass)
    names = ["autoregressive", "ngram", "draft"]
    reference = {}
    rows, _ = suite._specjax_rows(None, {n: n for n in names}, [[1, 2], [3, 4]], "docstring",
                                  0.0, 2, {}, {n: {} for n in names}, 4, 3, reference,
                                  lambda _: None)
    assert order[:3] == names  # the warm-up
    rounds = order[3:]
    assert sorted(rounds) == sorted(["autoregressive", "draft"] * 3)  # ngram ran once
    ar, ngram, draft = rows
    assert (ngram["loop"], ngram["timed"]) == ("plain", False)
    assert (draft["loop"], draft["timed"]) == ("speculative", True)
    assert ngram["tokens_per_s"] == ar["tokens_per_s"] and ngram["speedup"] == 1.0
    assert ngram["decode_speedup"] == 1.0 and ngram["identical"] is True
    assert ngram["round_wall_s"] == ar["round_wall_s"] and len(draft["round_wall_s"]) == 3
    assert draft["speedup"] != 1.0  # timed in its own rounds
    assert "| plain, untimed |" in suite_report.table(rows)
    assert "| speculative |" in suite_report.table(rows)


def test_speedup_is_the_median_of_each_rounds_ratio():
    """A row timed in the same rounds as autoregressive: its speedup is the median of the
    per-round ratios (a load that slows one whole round cancels there), not the ratio of
    the two medians, which can come from different rounds; rounds that do not pair up
    are an error."""
    from specjax.timing import paired_speedup

    base, method = [1.0, 4.0, 2.0], [2.0, 4.4, 1.1]  # medians 2.0 and 2.0
    ref = suite.Reference([[1]], base, [0.01, 0.04, 0.02])
    row = suite._finish(dict(category="c", temperature=1.0, batch=1, method="m",
                             tokens_per_s=2.0, tpot_ms=10.0), [[1]], ref, lambda _: None,
                        walls=method, tpots=[0.02, 0.044, 0.011])
    assert row["speedup"] == pytest.approx(4.0 / 4.4) == paired_speedup(base, method)
    assert row["decode_speedup"] == pytest.approx(0.04 / 0.044)
    with pytest.raises(ValueError, match="3 base and 2 method"):
        suite._finish(dict(category="c", temperature=1.0, batch=1, method="m",
                           tokens_per_s=2.0, tpot_ms=10.0), [[1]], ref, lambda _: None,
                      walls=method[:2])
    with pytest.raises(ValueError, match="positive"):
        paired_speedup([1.0, 0.0], [1.0, 1.0])


def test_a_run_that_dies_keeps_the_parts_it_finished(workdir, tmp_path, monkeypatch):
    """--json holds every finished (category, temperature) as the run goes, marked
    partial, so a crash later in a long run loses only the part it was in."""
    calls = []
    real = suite._specjax_rows

    def dies_in_the_second_part(*args, **kwargs):
        calls.append(args[4])  # the temperature
        if len(set(calls)) > 1:
            raise RuntimeError("the process died here")
        return real(*args, **kwargs)

    monkeypatch.setattr(suite, "_specjax_rows", dies_in_the_second_part)
    out = tmp_path / "suite.json"
    argv = ["--workdir", str(workdir), *TINY, "--categories", P.CATEGORIES[0],
            "--out", "", "--figures", "", "--json", str(out)]
    with pytest.raises(RuntimeError, match="died here"):
        suite.main(argv)
    kept = json.loads(out.read_text())
    assert kept["partial"] is True
    assert {(r["category"], r["temperature"]) for r in kept["rows"]} == {(P.CATEGORIES[0], 0.0)}
    assert {r["method"] for r in kept["rows"]} == set(DEFAULT_METHODS)
    assert all(r["vs_transformers"] is not None for r in kept["rows"])


def test_suite_writes_its_section_and_plots(finished):
    _, out, _ = finished
    text = (out / "benchmarks.md").read_text()
    assert "keep me" in text and text.count(suite_report.START) == text.count(suite_report.END) == 1
    section = text[text.index(suite_report.START):]
    for needle in ("- date: ", "- machine: ", "- versions: jax ", "transformers ",
                   "- command: `python -m specjax.bench.suite --workdir ", "--new 4",
                   "- note: a tiny test run", "![suite_speedup](figures/suite_speedup.png)"):
        assert needle in section
    for c in P.CATEGORIES:
        assert f"### {c}" in section
    for m in DEFAULT_METHODS:
        assert f"| {m} |" in section
    assert re.search(r"\| 0 \| 1 \| eagle \| (plain, untimed|speculative) \| 0\.", section)
    # no loop, α, τ or k for transformers
    assert "| 1 | 1 | hf_prompt_lookup | – | – | – | – |" in section
    for name in suite_report.FIGURES:
        assert (out / "figures" / name).stat().st_size > 1000


def test_a_run_in_parts_merges_into_one_section(finished, tmp_path, capsys):
    """suite_merge: the run's JSON split by category into two parts merges back into the
    same rows and one section naming both parts' commands; parts that time the same
    cell or disagree on a setting are refused by name (exit 2)."""
    from specjax.bench import suite_merge

    _, _, result = finished
    parts = []
    for i, cats in enumerate((P.CATEGORIES[:2], P.CATEGORIES[2:])):
        part = dict(result, rows=[r for r in result["rows"] if r["category"] in cats],
                    prompt_sets={c: v for c, v in result["prompt_sets"].items() if c in cats},
                    settings=dict(result["settings"], categories=list(cats)),
                    command=f"part {i} command")
        parts.append(tmp_path / f"part{i}.json")
        parts[-1].write_text(json.dumps(part))
    md = tmp_path / "benchmarks.md"
    md.write_text("# Benchmarks\n")
    argv = [str(p) for p in parts] + ["--out", str(md), "--figures", str(tmp_path / "fig"),
                                      "--json", str(tmp_path / "merged.json")]
    assert suite_merge.main(argv) == 0
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert merged["rows"] == result["rows"]
    assert merged["settings"]["categories"] == list(P.CATEGORIES)
    section = md.read_text()
    assert ("- commands: one run in 2 parts, merged by `python -m specjax.bench.suite_merge"
            in section)
    assert "`part 0 command`" in section and "`part 1 command`" in section
    assert all(f"### {c}" in section for c in P.CATEGORIES)
    assert (tmp_path / "fig" / suite_report.FIGURES[0]).stat().st_size > 1000
    capsys.readouterr()
    assert suite_merge.main([str(parts[0]), str(parts[0]), "--out", ""]) == 2
    assert "both time" in capsys.readouterr().err
    other = json.loads(parts[1].read_text())
    other["settings"]["new"] = 8
    parts[1].write_text(json.dumps(other))
    assert suite_merge.main([str(p) for p in parts] + ["--out", ""]) == 2
    assert "settings.new = 8" in capsys.readouterr().err


def test_a_part_run_again_supersedes_the_earlier_cells(finished, tmp_path, capsys):
    """suite_merge --supersede: a later part's (category, temperature, batch) group
    replaces the earlier part's rows there, whole, and the section names it beside the
    earlier command; without the flag the same parts are refused, and a part a later
    one replaces entirely is refused by name."""
    from specjax.bench import suite_merge

    _, _, result = finished
    again = (P.CATEGORIES[0], 0.0, 1)
    rerun = dict(result, rows=[dict(r, tokens_per_s=r["tokens_per_s"] * 2)
                               for r in result["rows"] if suite_merge.group(r) == again],
                 command="the re-run's command")
    paths = [tmp_path / "all.json", tmp_path / "rerun.json"]
    paths[0].write_text(json.dumps(result))
    paths[1].write_text(json.dumps(rerun))
    md = tmp_path / "benchmarks.md"
    argv = [str(p) for p in paths] + ["--out", str(md), "--figures", "",
                                      "--json", str(tmp_path / "merged.json")]
    assert suite_merge.main(argv + ["--supersede"]) == 0
    merged = json.loads((tmp_path / "merged.json").read_text())
    speed = {(*suite_merge.group(r), r["method"]): r["tokens_per_s"] for r in merged["rows"]}
    assert len(speed) == len(merged["rows"]) == len(result["rows"])
    for r in result["rows"]:
        twice = 2 if suite_merge.group(r) == again else 1
        assert speed[(*suite_merge.group(r), r["method"])] == r["tokens_per_s"] * twice
    section = md.read_text()
    assert f"(re-run by a later part: {again[0]}, T = 0, batch 1)" in section
    assert "`the re-run's command`" in section
    capsys.readouterr()
    assert suite_merge.main(argv) == 2
    assert "both time" in capsys.readouterr().err
    assert suite_merge.main([str(paths[1]), str(paths[0]), "--supersede", "--out", ""]) == 2
    assert f"{paths[1]}: later parts time every group it times" in capsys.readouterr().err


def one_method_run(workdir, json_path, method: str, *flags: str, temperature: str = "0"):
    """The suite on completion prompts for `method` (and autoregressive) at one
    temperature with extra `flags`, no docs written; its JSON results."""
    argv = ["--workdir", str(workdir), *TINY, "--categories", "completion", "--methods",
            method, "--temperatures", temperature, "--out", "", "--figures", "",
            "--json", str(json_path), *flags]
    assert suite.main(argv) == 0
    return json.loads(json_path.read_text())


@pytest.mark.slow  # one more run of the suite; the flag is generate's `adaptive`
def test_no_adaptive_drafts_the_full_k_every_step(workdir, finished, capsys):
    """--no-adaptive turns generate's adaptive draft length off (no recompile: a flag)."""
    _, out, adaptive = finished
    fixed = one_method_run(workdir, out / "fixed.json", "draft", "--no-adaptive")
    k = {r["method"]: r["k"] for r in fixed["rows"]}
    assert fixed["settings"]["adaptive"] is False and k == {"autoregressive": 0, "draft": 2}
    before = next(r for r in adaptive["rows"] if r["method"] == "draft" and
                  r["category"] == "completion" and r["temperature"] == 0)
    assert before["k"] < 2  # a random draft: the adaptive rule drafts less
    assert all(r["identical"] for r in fixed["rows"])


@pytest.mark.slow  # one more run of the suite, compiling EAGLE's loop for its tree
def test_eagle_tree_sets_the_dynamic_tree_the_suite_verifies(workdir, finished):
    """--eagle-tree TOP_K,DEPTH,NODES: the EAGLE speculator's dynamic tree (4,4,16 by
    default), recorded in the settings and the models line."""
    _, out, default = finished
    res = one_method_run(workdir, out / "tree.json", "eagle", "--eagle-tree", "2,2,3",
                         "--no-adaptive")
    assert res["settings"]["eagle_tree"] == [2, 2, 3]
    assert "dynamic tree top_k 2, depth 2, 3 nodes" in res["models"]
    assert "dynamic tree top_k 4, depth 4, 16 nodes" in default["models"]
    assert all(r["identical"] for r in res["rows"])


def test_several_eagle_trees_run_the_one_each_cell_prices_best(workdir, finished):
    """--eagle-tree A/B with --calibrate: both shapes calibrated, each cell's choice and
    every shape's expected gain recorded, the chosen tree in its rows, still lossless."""
    _, out, _ = finished
    res = one_method_run(workdir, out / "trees.json", "eagle", "--eagle-tree", "2,2,3/1,2,2",
                         "--calibrate", "1")
    assert res["settings"]["eagle_trees"] == [[2, 2, 3], [1, 2, 2]]
    [record] = res["eagle_trees"]
    assert set(record["gains"]) == {"2,2,3", "1,2,2"} and record["chosen"] in record["gains"]
    assert {p["method"] for p in res["priors"]} == {"eagle", "eagle@1,2,2"}
    [row] = [r for r in res["rows"] if r["method"] == "eagle"]
    assert row["tree"] == record["chosen"] and row["identical"]


def test_ngram_corpus_drafts_from_the_given_texts(workdir, finished, heldout):
    """--ngram-corpus JSONL: `ngram_corpus` drafts from those texts where a row has no
    match of its own. A corpus of the target's own greedy continuations of the run's
    prompts (as token ids) gets drafts accepted that the plain n-gram does not have; the
    texts are counted in the models line; lossless."""
    _, out, _ = finished
    docs, tok = heldout
    args = suite.parse_args(["--workdir", str(workdir), *TINY, "--categories", "completion"])
    prompts = suite.build_prompt_sets(args.categories, docs, tok, args.prompts,
                                      suite.category_lengths(args), args.seed)["completion"]
    target = specjax.load(workdir / "target" / "export")
    ids = [p.ids for p in prompts]
    outputs = specjax.generate(target, ids, max_new_tokens=args.new, ignore_eos=True).tokens
    texts = out / "texts.jsonl"
    texts.write_text("".join(json.dumps({"ids": i + o}) + "\n" for i, o in zip(ids, outputs)))
    res = one_method_run(workdir, out / "corpus.json", "ngram,ngram_corpus",
                         "--ngram-corpus", str(texts), "--no-adaptive")
    assert res["settings"]["ngram_corpus"] == str(texts)
    assert f"n-gram corpus {len(ids)} texts" in res["models"]
    rows = {r["method"]: r for r in res["rows"]}
    assert set(rows) == {"autoregressive", "ngram", "ngram_corpus"}
    assert all(r["identical"] for r in rows.values())
    assert rows["ngram_corpus"]["tau"] > rows["ngram"]["tau"]


def test_int8_kv_cache_runs_and_stays_lossless(workdir, finished):
    """--kv-cache-dtype int8: specjax's target decodes over an int8 cache; the draft's
    greedy output equals the int8 target's own (the `identical` column), recorded."""
    _, out, _ = finished
    res = one_method_run(workdir, out / "int8.json", "draft", "--kv-cache-dtype", "int8",
                         "--no-adaptive")
    assert res["settings"]["kv_cache_dtype"] == "int8"
    assert [r["method"] for r in res["rows"]] == ["autoregressive", "draft"]
    assert all(r["identical"] for r in res["rows"])


def test_token_wise_verification_runs_beside_block(workdir, finished, monkeypatch):
    """--verification rejection: the draft model's chains, block-verified by default,
    are verified token-wise (to compare τ and speed), and the setting is recorded."""
    import specjax.decoding.generate as generate_mod

    _, out, _ = finished
    asked = []
    generate = generate_mod.generate
    monkeypatch.setattr(generate_mod, "generate", lambda *a, **kw: asked.append(
        (kw["speculator"] is None, kw.get("verification"))) or generate(*a, **kw))
    res = one_method_run(workdir, out / "tokenwise.json", "draft", "--verification",
                         "rejection", temperature="1")
    assert res["settings"]["verification"] == "rejection"
    assert [r["method"] for r in res["rows"]] == ["autoregressive", "draft"]
    assert set(asked) == {(True, None), (False, "rejection")}


def test_draft_cost_is_measured_at_each_batch_the_run_times(workdir, finished, monkeypatch):
    """c (a draft call's cost relative to a target step) moves with the batch, so the
    suite measures it at every batch it times and each row's adaptive rule and
    analytical figure use its own batch's (`draft_cost_ratios(batch=)`)."""
    from specjax.calibrate import draft_cost

    _, out, _ = finished
    asked = []

    def fake(target, spec, temperatures, batch):
        asked.append(batch)
        return {t: 0.01 * batch for t in temperatures}
    monkeypatch.setattr(draft_cost, "draft_cost_ratios", fake)
    argv = ["--workdir", str(workdir), *TINY, "--categories", "completion", "--methods",
            "draft", "--temperatures", "0", "--batches", "1,2", "--out", "", "--figures",
            "", "--json", str(out / "batches.json")]
    assert suite.main(argv) == 0
    rows = json.loads((out / "batches.json").read_text())["rows"]
    assert sorted(asked) == [1, 2]
    assert {r["batch"]: r["cost_ratio"] for r in rows if r["method"] == "draft"} == {
        1: pytest.approx(0.01), 2: pytest.approx(0.02)}


def test_prefilled_state_holds_the_prompt_in_every_row(workdir):
    """`inspect.prefilled_state(batch=)`: what `measured_cost_ratio` times at a batch."""
    from specjax.inspect import prefilled_state
    from specjax.speculators import NGram

    target = specjax.load(workdir / "target" / "export")
    prompt = [5, 6, 7, 8, 9]
    one, _ = prefilled_state(target, prompt, NGram(k=2))
    three, _ = prefilled_state(target, prompt, NGram(k=2), batch=3)
    assert three.tokens.shape == (3, one.tokens.shape[1])
    assert (three.lengths == one.lengths[0]).all() and int(one.lengths[0]) == len(prompt) + 1
    assert (three.tokens == one.tokens).all()  # greedy: the same first token in every row
    with pytest.raises(ValueError, match="batch=0"):
        prefilled_state(target, prompt, NGram(k=2), batch=0)


def test_calibrate_sets_each_methods_prior_from_other_prompts(workdir, finished, heldout):
    """--calibrate N: N prompts per category from other functions than the timed ones,
    one full-depth pass per method, and its acceptance per depth becomes that method's
    acceptance_prior in the timed runs (recorded in the JSON, with the step overhead per
    depth)."""
    _, out, _ = finished
    argv = ["--workdir", str(workdir), *TINY, "--categories", "completion", "--methods",
            "ngram,draft", "--temperatures", "0", "--out", "", "--figures", "",
            "--json", str(out / "calibrated.json"), "--calibrate", "1"]
    assert suite.main(argv) == 0
    res = json.loads((out / "calibrated.json").read_text())
    priors = {p["method"]: p["acceptance_by_position"] for p in res["priors"]}
    assert set(priors) == {"ngram", "draft"} and res["settings"]["calibrate"] == 1
    assert all(len(a) == 2 and all(x is None or 0 <= x <= 1 for x in a)
               for a in priors.values())
    assert all(len(p["step_overhead"]) == 2 and min(p["step_overhead"]) >= 0
               for p in res["priors"])
    # the tries each depth's acceptance is worth: none where it was never tried
    assert all(len(p["prior_tries"]) == 2 and all(
        (n is None) == (a is None) and (n is None or n > 0)
        for a, n in zip(p["acceptance_by_position"], p["prior_tries"])) for p in res["priors"])
    # what each was priced from: per timed call, every pass's seconds per loop step
    for p in res["priors"]:
        assert set(p["timing"]) == {"plain", "closing", "full", "shallow", "idle", "fitted"}
        assert all(len(v) == MIN_TIMED_CALLS and all(x > 0 for x in v)
                   for v in p["timing"].values())
    assert all(r["identical"] for r in res["rows"])  # greedy stays lossless
    docs, tokenizer = heldout
    timed = suite.build_prompt_sets(["docstring"], docs, tokenizer, 2, dict(docstring=64), 0)
    calib = suite.calibration_sets(timed, docs, tokenizer, 2, dict(docstring=64), 0)
    assert len(calib["docstring"]) == 2
    assert not {p.origin for p in calib["docstring"]} & {p.origin for p in timed["docstring"]}


def test_merged_stats_add_up(workdir, finished):
    """The stats of a prompt set run in batches are those of its calls added up (prompt
    shapes as in the suite run, whose compiled programs this reuses)."""
    from specjax.bench.speculative import build_speculators, specjax_pass
    from specjax.stats import merge_stats

    target = specjax.load(workdir / "target" / "export")
    draft = specjax.load(workdir / "draft" / "export")
    spec = build_speculators(target, draft=draft, k=2)["draft"]
    prompts = [[5, 6, 7] * 13, [9, 8] * 20]
    # full depth: the adaptive rule may draft nothing here (CPU verify cost)
    tokens, merged, wall = specjax_pass(target, spec, prompts, new=4, batch=1, adaptive=False)
    parts = [specjax.generate(target, [p], max_new_tokens=4, seed=i, ignore_eos=True,
                              speculator=spec, adaptive=False) for i, p in enumerate(prompts)]
    assert tokens == [t for o in parts for t in o.tokens]
    assert merged.drafted == sum(o.stats.drafted for o in parts) > 0
    assert merged.acceptance_rate == pytest.approx(
        sum(o.stats.accepted for o in parts) / sum(o.stats.drafted for o in parts))
    assert merged.mean_accepted_length == pytest.approx(
        6 / sum(o.stats.target_calls for o in parts))  # 2 x (4 - 1) decode tokens
    assert len(merged.rows) == 2 and wall > 0
    assert merged.tried_hist == list(np.sum([o.stats.tried_hist for o in parts], axis=0))
    one = merge_stats([parts[0].stats])
    assert (one.expected_speedup, one.tokens_per_s, one.verify_cost) == pytest.approx(
        (parts[0].stats.expected_speedup, parts[0].stats.tokens_per_s,
         parts[0].stats.verify_cost))


def test_timed_passes_leave_compilation_out():
    """A prompt length seen for the first time compiles inside its `generate` call:
    `specjax_pass`'s wall time leaves that out (the suite times the steady state)."""
    import time

    from specjax.bench.speculative import specjax_pass
    from specjax.config import tiny_llama

    target = specjax.init_model(tiny_llama(vocab_size=64, num_layers=1, hidden_size=32,
                                           intermediate_size=64, num_heads=2,
                                           num_kv_heads=1), seed=4)
    t0 = time.perf_counter()
    _, stats, wall = specjax_pass(target, None, [[3, 4, 5] * 7], new=3, batch=1)
    outer = time.perf_counter() - t0
    assert stats.compile_s > 0.2  # compiled the prefill and the decode loop
    assert 0 < wall <= outer - stats.compile_s


# ---- bad input ---------------------------------------------------------------------------
@pytest.mark.parametrize("argv, match", [
    (["--batches", "1,x"], "--batches='1,x'"),
    (["--categories", "completion,poetry"], "unknown ['poetry']"),
    (["--methods", "ngram,lookahead"], "unknown ['lookahead']"),
    (["--batches", "4", "--prompts", "6"], "--prompts=6 must be a positive multiple"),
    (["--new", "0"], "--new=0"),
    (["--temperatures", "0,-1"], "must be >= 0"),
    (["--calibrate", "-1"], "--calibrate=-1"),
    (["--kv-cache-dtype", "int3"], "--kv-cache-dtype='int3'"),
    (["--verification", "typical"], "invalid choice: 'typical'"),
    (["--eagle-tree", "4,4"], "--eagle-tree='4,4' must be TOP_K,DEPTH,NODES"),
    (["--eagle-tree", "4,4,100"], "total_tokens <= top_k + (depth-1)*top_k**2 = 52"),
    (["--eagle-tree", "4,4,16/1,4,4"], "choosing between trees needs --calibrate N"),
    (["--eagle-tree", "1,4,4/1,4,4", "--calibrate", "2"], "names 1,4,4 twice"),
    (["--eagle-tree", "4,4,16/1,4", "--calibrate", "2"], "must be TOP_K,DEPTH,NODES"),
    (["--methods", "ngram_corpus"], "ngram_corpus needs --ngram-corpus JSONL"),
    (["--ngram-corpus", "/no/such.jsonl"], "--ngram-corpus '/no/such.jsonl' is not a file"),
])
def test_bad_flags_exit_non_zero_with_a_message(argv, match, capsys, tmp_path):
    with pytest.raises(SystemExit) as err:
        suite.main(["--workdir", str(tmp_path), *argv])
    assert err.value.code == 2 and match in capsys.readouterr().err


def test_help_through_the_cli_shows_the_suites_flags(capsys):
    with pytest.raises(SystemExit) as err:
        cli(["bench", "suite", "--help"])
    assert err.value.code == 0 and "--long-tokens" in capsys.readouterr().out


def test_ngram_eagle_pairs_the_lookup_with_the_eagle_tree(workdir, finished):
    """--methods ngram_eagle (not run by default): n-gram's chain where lookup matches,
    the EAGLE head's tree elsewhere, in the tree --eagle-tree sets; lossless; a workdir
    without EAGLE heads is named."""
    _, out, default = finished
    assert "ngram_eagle" not in {r["method"] for r in default["rows"]}
    res = one_method_run(workdir, out / "hybrid.json", "ngram_eagle", "--eagle-tree",
                         "2,2,3", "--no-adaptive")
    [row] = [r for r in res["rows"] if r["method"] == "ngram_eagle"]
    assert row["identical"] and row["k"] == 2
    with pytest.raises(FileNotFoundError, match=str(Path("eagle", "heads", "heads.json"))):
        suite.Workdir.check(_without_eagle(workdir), ("autoregressive", "ngram_eagle"))


def _without_eagle(workdir: Path) -> Path:
    """A copy of the workdir's target stage alone (no heads)."""
    import shutil

    bare = workdir.parent / "bare"
    if not bare.exists():
        shutil.copytree(workdir / "target", bare / "target")
    return bare


def test_missing_workdir_files_are_named(workdir, tmp_path, capsys):
    assert cli(["bench", "suite", "--workdir", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "target" / "export").mkdir(parents=True)
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / "target" / "export" / name).write_bytes(
            (workdir / "target" / "export" / name).read_bytes())
    assert cli(["bench", "suite", "--workdir", str(tmp_path), "--out", ""]) == 2
    err = capsys.readouterr().err
    assert "DONE.json" in err and str(Path("draft", "export", "config.json")) in err
    assert str(Path("eagle", "heads", "heads.json")) in err
    # a method subset needs only its own files
    with pytest.raises(FileNotFoundError) as e:
        suite.Workdir.check(tmp_path, ("autoregressive", "medusa"))
    assert "medusa" in str(e.value) and "draft" not in str(e.value)


def test_a_merge_of_one_part_says_one_part():
    """The section's command line counts the parts in words a reader expects."""
    one = suite_report._command_lines({"parts": [{"date": "d", "command": "c"}]}, "merge")
    assert one[0] == "- commands: one run in one part, merged by `merge`:"
    two = suite_report._command_lines({"parts": [{"date": "d", "command": "c"}] * 2}, "merge")
    assert two[0].startswith("- commands: one run in 2 parts")


@pytest.mark.slow  # its own suite runs at two draft vocabularies
def test_draft_vocab_bench_sweeps_the_trimmed_sizes(workdir, capsys):
    """`python -m specjax.bench.draft_vocab`: a row per size, category and temperature;
    the whole vocabulary covers every target token; bad flags exit 2 naming them."""
    from specjax.bench import draft_vocab

    argv = ["--workdir", str(workdir), "--sizes", "all,40", "--categories", "completion",
            "--prompts", "2", "--prompt-tokens", "64", "--new", "6", "--k", "2"]
    assert draft_vocab.main(argv) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith(("| all", "| 40"))]
    assert [(r[0], r[2]) for r in rows] == [("| all", "0"), ("| all", "1"), ("| 40", "0"),
                                            ("| 40", "1")]
    assert {r[4] for r in rows[:2]} == {"1.000"}  # the whole vocabulary holds every token
    assert all(0.0 <= float(r[4]) <= 1.0 for r in rows[2:])
    for bad, message in ((["--sizes", "all,x"], "'x' is neither 'all' nor an integer"),
                         (["--sizes", "999"], "exceed the vocabulary"),
                         (["--categories", "poems"], "--categories='poems': unknown ['poems']")):
        with pytest.raises(SystemExit) as e:
            draft_vocab.main(argv + bad)
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_corpus_drafts_bench_replays_the_corpus_ngram(workdir, heldout, tmp_path, capsys):
    """`python -m specjax.bench.corpus_drafts`: a row per category and min_share. The
    corpus is the target's own greedy continuations of the very prompts it replays, so
    its drafts are mostly right; a higher min_share drafts at no more positions; bad
    flags exit 2 naming them."""
    from specjax.bench import corpus_drafts

    docs, tok = heldout
    prompts = [p.ids for p in P.build_prompts("completion", docs, tok, 2, 64, seed=2)]
    target = specjax.load(workdir / "target" / "export")
    outputs = specjax.generate(target, prompts, max_new_tokens=12, ignore_eos=True).tokens
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"ids": o}) + "\n" for o in outputs))
    argv = ["--workdir", str(workdir), "--corpus", str(texts), "--categories", "completion",
            "--prompts", "2", "--prompt-tokens", "64", "--new", "12", "--k", "2",
            "--min-shares", "0,0.5"]
    assert corpus_drafts.main(argv) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| completion")]
    assert [r[1] for r in rows] == ["0", "0.5"]
    rate = [float(r[3]) for r in rows]
    assert rate[0] > 0 and rate[1] <= rate[0]
    assert float(rows[0][4].split(" / ")[0]) > 0.5  # the corpus's first tokens are right
    # --corpus train: the training split of the corpus the prompts are held out from
    corpus = suite.Workdir.check(workdir, []).corpus()[0]
    tokens = sum(len(e.ids) for e in tok.encode_batch(list(corpus.train),
                                                       add_special_tokens=False))
    assert corpus_drafts.main(argv[:2] + ["--corpus", "train"] + argv[4:]) == 0
    out = capsys.readouterr().out
    assert (f"corpus: the training split of {corpus.name}, {len(corpus.train):,} texts, "
            f"{tokens:,} tokens") in out
    assert sum(line.startswith("| completion") for line in out.splitlines()) == 2
    for bad, message in ((["--min-shares", "0,2"], "2 is outside [0, 1]"),
                         (["--corpus", str(tmp_path / "none.jsonl")], "--corpus:"),
                         (["--prompt-tokens", "0"], "--prompt-tokens=0 must be >= 1")):
        with pytest.raises(SystemExit) as e:
            corpus_drafts.main(argv + bad)
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_module_entry_turns_the_compilation_cache_on(tmp_path):
    """`python -m specjax.bench.suite` (the docs' commands) keeps the persistent cache, as
    the CLI does, even when it stops on a bad --workdir."""
    import os
    import subprocess
    import sys

    cache = tmp_path / "cache"
    env = dict(os.environ, SPECJAX_COMPILATION_CACHE=str(cache))
    out = subprocess.run([sys.executable, "-m", "specjax.bench.suite", "--workdir",
                          str(tmp_path / "missing")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2 and "missing" in out.stderr
    assert cache.is_dir()


def test_superseded_takes_each_group_from_the_last_part_that_times_it():
    """suite_merge.superseded over three parts: the first loses one group to the second
    and another to the third, the second loses one of its two to the third; the parts
    stay in their order and each names exactly the groups it lost."""
    from specjax.bench import suite_merge

    def part(tag, *groups):
        rows = [dict(category=c, temperature=t, batch=b, method="ngram", tag=tag)
                for c, t, b in groups]
        return dict(rows=rows, priors=[dict(r) for r in rows],
                    eagle_trees=[dict(r, chosen="1,4,4") for r in rows])

    a, b, c, d = ("he", 0.0, 1), ("he", 1.0, 1), ("long", 0.0, 1), ("long", 1.0, 1)
    parts = [part("first", a, b, c), part("second", b, d), part("third", b, c)]
    out = suite_merge.superseded(parts, ["first", "second", "third"])
    assert [[suite_merge.group(r) for r in p["rows"]] for p in out] == [[a], [d], [b, c]]
    assert [p["superseded"] for p in out] == [[list(b), list(c)], [list(b)], []]
    assert [r["tag"] for r in out[2]["rows"]] == ["third", "third"]
    assert [suite_merge.group(x) for x in out[0]["priors"]] == [a]
    assert [suite_merge.group(x) for x in out[1]["eagle_trees"]] == [d]
    with pytest.raises(ValueError, match="second: later parts time every group"):
        suite_merge.superseded([part("second", b), parts[2]], ["second", "third"])


def test_each_cell_runs_the_tree_its_calibration_prices_best(monkeypatch):
    """Several --eagle-tree shapes: per (category, temperature, batch), the shape whose
    calibration the rule expects to gain most (`choose_trees`), run under the method's
    own name with that shape's calibration and c, its tree in the row and the table."""
    from specjax.calibrate import Calibration
    from specjax.decoding.cost import VerifyCost

    target = specjax.init_model(tiny_llama(VOCAB, num_layers=1), seed=0)
    wide = Eagle.random(target, top_k=4, depth=3, total_tokens=12)
    chain = Eagle.random(target, top_k=1, depth=3, total_tokens=3)
    candidates = {"autoregressive": None, "eagle": wide, "eagle@1,3,3": chain}
    # docstring: the wide tree accepts far more; completion: both alike, so the chain's
    # cheaper verify wins
    priors = {("docstring", 0.0, 1, "eagle"): Calibration(prior=[0.9, 0.9, 0.9]),
              ("docstring", 0.0, 1, "eagle@1,3,3"): Calibration(prior=[0.3, 0.2, 0.1]),
              ("completion", 0.0, 1, "eagle"): Calibration(prior=[0.5, 0.4, 0.3]),
              ("completion", 0.0, 1, "eagle@1,3,3"): Calibration(prior=[0.5, 0.4, 0.3])}
    costs = {1: {0.0: {"eagle": 0.05, "eagle@1,3,3": 0.04}}}
    prompt = lambda c: P.Prompt(c, [1, 2, 3, 4], "x", "here")  # noqa: E731
    sets = {"docstring": [prompt("docstring")], "completion": [prompt("completion")]}
    monkeypatch.setattr("specjax.decoding.generate.default_verify_cost",
                        lambda *a: VerifyCost(per_token=0.2))
    choices, records = suite.choose_trees(target, "eagle", candidates, priors, costs, sets)
    assert choices == {("docstring", 0.0, 1, "eagle"): "eagle",
                       ("completion", 0.0, 1, "eagle"): "eagle@1,3,3"}
    assert [r["chosen"] for r in records] == ["4,3,12", "1,3,3"]
    assert set(records[1]["gains"]) == {"4,3,12", "1,3,3"}

    seen = []

    def fake_pass(target, spec, ids, *, batch, cost_ratio=None, calibration=None, **kw):
        seen.append((spec, cost_ratio, calibration))
        return [[7] * 4], fake_stats(), 0.1

    fake_generate_calls(monkeypatch, fake_pass)
    rows = suite.run(target, {"autoregressive": None, "eagle": wide}, sets, batches=(1,),
                     temperatures=(0.0,), new=4, repeats=1, cost_ratios=costs,
                     priors=priors, log=lambda _: None, alternatives={"eagle@1,3,3": chain},
                     choices=choices)
    ran = {(id(spec), c, id(cal)) for spec, c, cal in seen}
    assert (id(wide), 0.05, id(priors["docstring", 0.0, 1, "eagle"])) in ran
    assert (id(chain), 0.04, id(priors["completion", 0.0, 1, "eagle@1,3,3"])) in ran
    assert (id(wide), 0.05, id(priors["completion", 0.0, 1, "eagle"])) not in ran
    trees = {(r["category"], r["method"]): r.get("tree") for r in rows}
    assert trees == {("docstring", "autoregressive"): None, ("docstring", "eagle"): "4,3,12",
                     ("completion", "autoregressive"): None,
                     ("completion", "eagle"): "1,3,3"}
    assert "| eagle (tree 1,3,3) |" in suite_report.table(rows)
