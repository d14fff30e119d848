"""The quickstart's comparison: its warm-up compiles every program the timed rounds run,
on one call's prompts when they all have the same length."""

import numpy as np

from specjax.decoding import programs
from specjax.decoding.generate import PROGRAMS
from specjax.speculators import DraftModel, NGram
from specjax.train import comparison
from specjax.train.comparison import compare, warmup_prompts


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
    compiled, per_call = [0], []
    real_compile, real_run = programs.compile_decode, comparison.speculative_run

    def counting_compile(lowered):
        compiled[0] += 1
        return real_compile(lowered)

    def recording_run(target, spec, prompts, **kw):
        before = compiled[0]
        out = real_run(target, spec, prompts, **kw)
        per_call.append((len(prompts), compiled[0] - before))
        return out

    monkeypatch.setattr(programs, "compile_decode", counting_compile)
    monkeypatch.setattr(comparison, "speculative_run", recording_run)
    PROGRAMS.clear()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 128, 12).tolist() for _ in range(4)]
    specs = {"autoregressive": None, "ngram": NGram(k=3),
             "draft": DraftModel.create(tiny_draft, k=3, target=tiny_target)}
    rows = compare(tiny_target, specs, prompts, new_tokens=8, temperatures=(0.0, 1.0),
                   batch=1, adaptive=True, repeats=2)
    assert len(rows) == 6 and all(r["identical_to_plain"] for r in rows
                                  if r["temperature"] == 0)
    warm = [c for n, c in per_call if n == 1]
    timed = [c for n, c in per_call if n == 4]
    assert len(warm) == 6 and len(timed) == 12
    assert sum(warm) > 0  # the warm-up compiled (the cache was empty) ...
    assert timed == [0] * 12  # ... and nothing was left for the timed rounds
