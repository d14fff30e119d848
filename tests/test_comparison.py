"""The quickstart's comparison: its warm-up compiles every program the timed rounds run,
on one call's prompts when they all have the same length."""

import numpy as np
import pytest

from specjax.decoding import programs
from specjax.decoding.generate import PROGRAMS
from specjax.speculators import DraftModel, NGram
from specjax.train import comparison
from specjax.train.comparison import compare, warmup_prompts


def compiles_per_call(monkeypatch, module, name: str) -> list:
    """Patches `module.name` to record how many decode programs each of its calls
    compiled (with `specjax.decoding.programs.compile_decode` counted); the list."""
    compiled, per_call = [0], []
    real_compile, real = programs.compile_decode, getattr(module, name)

    def counting_compile(lowered):
        compiled[0] += 1
        return real_compile(lowered)

    def recording(*a, **kw):
        before = compiled[0]
        out = real(*a, **kw)
        per_call.append((a, compiled[0] - before))
        return out

    monkeypatch.setattr(programs, "compile_decode", counting_compile)
    monkeypatch.setattr(module, name, recording)
    PROGRAMS.clear()
    return per_call


def test_warmup_prompts_are_one_calls_rows_when_lengths_match():
    same = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 1, 1]]
    assert warmup_prompts(same, 1) == [[1, 2, 3]]
    assert warmup_prompts(same, 2) == [[1, 2, 3], [4, 5, 6]]
    assert warmup_prompts(same, None) == same  # one call holds them all
    mixed = [[1, 2, 3], [4, 5], [7, 8, 9]]
    assert warmup_prompts(mixed, 1) == mixed  # a length might compile its own programs


def test_the_timed_rounds_compile_nothing(tiny_target, tiny_draft, monkeypatch):
    """Counts compilations per `speculative_run` call: after each method's warm-up call
    (one prompt), the timed rounds over all four prompts compile nothing."""
    per_call = compiles_per_call(monkeypatch, comparison, "speculative_run")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 128, 12).tolist() for _ in range(4)]
    specs = {"autoregressive": None, "ngram": NGram(k=3),
             "draft": DraftModel.create(tiny_draft, k=3, target=tiny_target)}
    rows = compare(tiny_target, specs, prompts, new_tokens=8, temperatures=(0.0, 1.0),
                   batch=1, adaptive=True, repeats=2)
    assert len(rows) == 6 and all(r["identical_to_plain"] for r in rows
                                  if r["temperature"] == 0)
    warm = [c for (_, _, p), c in per_call if len(p) == 1]
    timed = [c for (_, _, p), c in per_call if len(p) == 4]
    # two rounds per method, one call for a speculator on plain decoding's programs
    plain = sum(r["loop"] == "plain" for r in rows if r["method"] != "autoregressive")
    assert len(warm) == 6 and len(timed) == 12 - plain
    assert sum(warm) > 0  # the warm-up compiled (the cache was empty) ...
    assert timed == [0] * len(timed)  # ... and nothing was left for the timed rounds


def test_calibrations_time_passes_that_compile_nothing(tiny_target, tiny_draft, monkeypatch):
    """`specjax.calibrate.calibrations` warms up on the first call of each shape at the
    first temperature only (temperature is traced: the programs are shared); the timed
    passes of every call, at both temperatures, compile nothing; and a
    speculator's depth-1 and idle passes run the loop its full-depth pass compiled (the
    idle pass's free verify takes the default cost model's form, `VerifyCost.free`)."""
    import specjax.decoding.generate as generate_mod
    from specjax.calibrate import calibrations

    calls = compiles_per_call(monkeypatch, generate_mod, "generate")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 128, 12).tolist() for _ in range(3)]
    specs = {"ngram": NGram(k=3), "draft": DraftModel.create(tiny_draft, k=3,
                                                              target=tiny_target)}
    calibrations(tiny_target, specs, prompts, new_tokens=8, temperatures=(0.0, 1.0))
    # one call's 7 warm-up passes (plain, then each speculator at full depth, at depth 1
    # and idle), then per temperature 5 calls' 8 timed passes (`MIN_TIMED_CALLS`; the
    # same 7 and plain decoding again)
    per_call = [c for _, c in calls]
    assert len(per_call) == 7 + 2 * 40
    warm, timed = per_call[:7], per_call[7:]
    assert sum(warm) > 0 and timed == [0] * 80
    # warm-up order: plain, then (full, depth 1, idle) per speculator
    assert per_call[1] > 0 and per_call[4] > 0
    assert per_call[2:4] == per_call[5:7] == [0, 0]


@pytest.mark.parametrize("draft_warm_tokens", [[[1]], [[2]]])
def test_a_method_on_plain_programs_is_not_timed_again(monkeypatch, draft_warm_tokens):
    """A speculator whose warm-up ran plain decoding's programs (no speculative call)
    does not run again: its warm-up gives its stats and its greedy identity (against the
    first method's warm-up), and it reports the first method's tokens/s at a speedup of
    1; the other methods are timed every round."""
    order = []
    speeds = {"autoregressive": [10.0, 9.0, 11.0], "ngram": [12.0, 12.0, 13.0]}

    def fake_run(target, spec, prompts, **kw):
        calls = 0 if spec == "draft" else 1  # the rule never lets the draft draft
        if len(prompts) == 1:  # the warm-up
            tokens = draft_warm_tokens if spec == "draft" else [[1]]
            return tokens, dict(speculative_calls=calls, calls=1, alpha=0.5 * calls)
        order.append(spec)
        r = sum(1 for s in order if s == spec) - 1
        return [[1]], dict(speculative_calls=2 * calls, calls=2, alpha=0.5 * calls,
                           tokens_per_s=speeds.get(spec, [99.0])[min(r, 2)])

    monkeypatch.setattr(comparison, "speculative_run", fake_run)
    names = ["autoregressive", "ngram", "draft"]
    rows = compare(None, {m: m for m in names}, [[1, 2, 3], [4, 5, 6]], new_tokens=4,
                   temperatures=(0.0,), batch=1, repeats=3)
    assert order.count("autoregressive") == order.count("ngram") == 3
    assert "draft" not in order  # its warm-up is its run
    by = {r["method"]: r for r in rows}
    assert by["draft"]["loop"] == "plain" and by["ngram"]["loop"] == "speculative"
    assert by["draft"]["tokens_per_s"] == 10.0 and by["draft"]["speedup"] == 1.0
    assert by["draft"]["calls"] == 1 and by["draft"]["alpha"] == 0.0  # the warm-up's stats
    assert by["draft"]["identical_to_plain"] == (draft_warm_tokens == [[1]])
    assert [r["timed"] for r in rows] == [True, True, False]
    assert by["ngram"]["tokens_per_s"] == 12.0
    # the untimed method's rounds are the first method's, as its tokens/s is
    assert by["draft"]["round_tokens_per_s"] == speeds["autoregressive"]


def test_rounds_vary_the_order_and_the_speedup_pairs_each_round(monkeypatch):
    """No method runs first in every round, and a method's speedup is the median of its
    per-round tokens/s ratios to the first method's (a slow round cancels there)."""
    order = []
    # tokens/s per (method, timed round): round 1 slowed autoregressive only
    speeds = {"autoregressive": [10.0, 2.0, 10.0, 10.0], "ngram": [12.0, 12.0, 13.0, 11.0]}

    def fake_run(target, spec, prompts, **kw):
        if len(prompts) == 1:  # the warm-up: every call ran the speculative loop
            return [[1]], dict(speculative_calls=1, calls=1)
        order.append(spec)
        r = sum(1 for s in order if s == spec) - 1
        return [[1]], dict(speculative_calls=2, calls=2, tokens_per_s=speeds[spec][r])

    monkeypatch.setattr(comparison, "speculative_run", fake_run)
    rows = compare(None, {m: m for m in speeds}, [[1, 2, 3], [4, 5, 6]], new_tokens=4,
                   temperatures=(0.0,), batch=1, repeats=4)
    firsts = [order[i] for i in range(0, len(order), 2)]
    assert set(firsts) == set(speeds)
    by = {r["method"]: r for r in rows}
    assert by["autoregressive"]["speedup"] == 1.0
    assert by["ngram"]["speedup"] == np.median([1.2, 6.0, 1.3, 1.1])  # 1.25
    assert by["ngram"]["tokens_per_s"] == 12.0
    # each round's tokens/s in the row, round by round
    assert by["ngram"]["round_tokens_per_s"] == speeds["ngram"]
    assert by["autoregressive"]["round_tokens_per_s"] == speeds["autoregressive"]


def test_choosing_trees_without_calibration_is_refused(tmp_path):
    """Other tree shapes are chosen between by their calibration: without one (or with
    the adaptive rule off) the comparison says so before it runs anything."""
    from specjax.corpus import CorpusConfig
    from specjax.train.comparison import evaluate

    kw = dict(num_prompts=2, prompt_len=8, new_tokens=4, k=2, sweep_k=(), temperatures=(0.0,),
              seed=0, alternatives={"eagle@1,4,4": None})
    with pytest.raises(ValueError, match=r"needs calibrate > 0 and adaptive \(calibrate=0"):
        evaluate(tmp_path, None, None, {}, {}, CorpusConfig(), adaptive=True, **kw)
    with pytest.raises(ValueError, match="adaptive=False"):
        evaluate(tmp_path, None, None, {}, {}, CorpusConfig(), calibrate=2, **kw)
    assert not list(tmp_path.iterdir())
