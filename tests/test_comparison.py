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
    """Counts compilations per generate call: after each method's warm-up call (one
    prompt), the timed rounds over all four prompts (a call each, interleaved call by
    call) compile nothing."""
    import specjax.decoding.generate as generate_mod

    per_call = compiles_per_call(monkeypatch, generate_mod, "generate")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 128, 12).tolist() for _ in range(4)]
    specs = {"autoregressive": None, "ngram": NGram(k=3),
             "draft": DraftModel.create(tiny_draft, k=3, target=tiny_target)}
    rows = compare(tiny_target, specs, prompts, new_tokens=8, temperatures=(0.0, 1.0),
                   batch=1, adaptive=True, repeats=2)
    assert len(rows) == 6 and all(r["identical_to_plain"] for r in rows
                                  if r["temperature"] == 0)
    compiled = [c for _, c in per_call]
    at = 0
    for temp in (0.0, 1.0):
        # a speculator on plain decoding's programs runs its warm-up call only
        timed = sum(r["loop"] != "plain" or r["method"] == "autoregressive"
                    for r in rows if r["temperature"] == temp)
        warm, at = compiled[at:at + 3], at + 3
        if temp == 0.0:
            assert sum(warm) > 0  # the warm-up compiled (the cache was empty) ...
        # ... and nothing was left for the timed rounds: 2 rounds of 4 calls per method
        assert compiled[at:at + 2 * 4 * timed] == [0] * (2 * 4 * timed)
        at += 2 * 4 * timed
    assert at == len(compiled)


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


def fake_methods(monkeypatch, record) -> list:
    """Patches the comparison's generate calls: a pass over n prompts at batch 1 is n
    calls, each logged as (method, call index) in the list returned, except the warm-up
    (one prompt); a pass's record is `record(method, warm, r)` -> (tokens, record dict),
    r its timed round."""
    order, rounds = [], {}

    def generate_calls(target, spec, prompts, **kw):
        warm = len(prompts) == 1

        def call(j):
            if not warm:
                order.append((spec, j))
            return spec, warm

        return [lambda j=j: call(j) for j in range(len(prompts))]

    def run_record(outs):
        (spec, warm), = set(outs)
        r = None if warm else rounds.setdefault(spec, -1) + 1
        if not warm:
            rounds[spec] = r
        return record(spec, warm, r)

    monkeypatch.setattr(comparison, "generate_calls", generate_calls)
    monkeypatch.setattr(comparison, "run_record", run_record)
    return order


@pytest.mark.parametrize("draft_warm_tokens", [[[1]], [[2]]])
def test_a_method_on_plain_programs_is_not_timed_again(monkeypatch, draft_warm_tokens):
    """A speculator whose warm-up ran plain decoding's programs (no speculative call)
    does not run again: its warm-up gives its stats and its greedy identity (against the
    first method's warm-up), and it reports the first method's tokens/s at a speedup of
    1; the other methods are timed every round."""
    speeds = {"autoregressive": [10.0, 9.0, 11.0], "ngram": [12.0, 12.0, 13.0]}

    def record(spec, warm, r):
        calls = 0 if spec == "draft" else 1  # the rule never lets the draft draft
        if warm:
            tokens = draft_warm_tokens if spec == "draft" else [[1]]
            return tokens, dict(speculative_calls=calls, calls=1, alpha=0.5 * calls)
        return [[1]], dict(speculative_calls=2 * calls, calls=2, alpha=0.5 * calls,
                           tokens_per_s=speeds.get(spec, [99.0])[min(r, 2)])

    order = fake_methods(monkeypatch, record)
    names = ["autoregressive", "ngram", "draft"]
    rows = compare(None, {m: m for m in names}, [[1, 2, 3], [4, 5, 6]], new_tokens=4,
                   temperatures=(0.0,), batch=1, repeats=3)
    methods = [m for m, _ in order]
    assert methods.count("autoregressive") == methods.count("ngram") == 3 * 2
    assert "draft" not in methods  # its warm-up is its run
    by = {r["method"]: r for r in rows}
    assert by["draft"]["loop"] == "plain" and by["ngram"]["loop"] == "speculative"
    assert by["draft"]["tokens_per_s"] == 10.0 and by["draft"]["speedup"] == 1.0
    assert by["draft"]["calls"] == 1 and by["draft"]["alpha"] == 0.0  # the warm-up's stats
    assert by["draft"]["identical_to_plain"] == (draft_warm_tokens == [[1]])
    assert [r["timed"] for r in rows] == [True, True, False]
    assert by["ngram"]["tokens_per_s"] == 12.0
    # the untimed method's rounds are the first method's, as its tokens/s is
    assert by["draft"]["round_tokens_per_s"] == speeds["autoregressive"]
    lines = comparison.table([dict(r, tau=1.0, analytical=1.0) for r in rows]).splitlines()
    draft = next(line for line in lines if line.startswith("| draft |"))
    assert draft.split("|")[6].strip() == "1.00×"  # no rounds of its own: no range


def test_rounds_interleave_call_by_call_and_the_speedup_pairs_each_round(monkeypatch):
    """Within a round every method's call j runs before call j + 1 of any, no method
    runs first at every call, and a method's speedup is the median of its per-round
    tokens/s ratios to the first method's (a slow round cancels there)."""
    # tokens/s per (method, timed round): round 1 slowed autoregressive only
    speeds = {"autoregressive": [10.0, 2.0, 10.0, 10.0], "ngram": [12.0, 12.0, 13.0, 11.0]}

    def record(spec, warm, r):
        if warm:  # every call ran the speculative loop
            return [[1]], dict(speculative_calls=1, calls=1)
        return [[1]], dict(speculative_calls=2, calls=2, tokens_per_s=speeds[spec][r])

    order = fake_methods(monkeypatch, record)
    rows = compare(None, {m: m for m in speeds}, [[1, 2, 3], [4, 5, 6]], new_tokens=4,
                   temperatures=(0.0,), batch=1, repeats=4)
    assert len(order) == 4 * 2 * 2  # rounds x methods x calls
    assert [j for _, j in order] == [0, 0, 1, 1] * 4  # call by call
    firsts = [order[i][0] for i in range(0, len(order), 2)]  # who opens each call
    assert set(firsts) == set(speeds)
    by = {r["method"]: r for r in rows}
    assert by["autoregressive"]["speedup"] == 1.0
    assert by["ngram"]["speedup"] == np.median([1.2, 6.0, 1.3, 1.1])  # 1.25
    assert by["ngram"]["round_speedups"] == pytest.approx([1.2, 6.0, 1.3, 1.1])
    assert "round_speedups" not in by["autoregressive"]  # the baseline's are all 1
    assert by["ngram"]["tokens_per_s"] == 12.0
    # each round's tokens/s in the row, round by round
    assert by["ngram"]["round_tokens_per_s"] == speeds["ngram"]
    assert by["autoregressive"]["round_tokens_per_s"] == speeds["autoregressive"]
    # the table gives a timed speculator's speedup with its rounds' range
    lines = comparison.table([dict(r, alpha=0.5, tau=1.5, analytical=1.3) for r in rows])
    ngram = next(line for line in lines.splitlines() if line.startswith("| ngram |"))
    assert "| 1.25× (1.10-6.00) |" in ngram
    base = next(line for line in lines.splitlines() if line.startswith("| autoregressive |"))
    assert base.split("|")[6].strip() == "1.00×"


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
