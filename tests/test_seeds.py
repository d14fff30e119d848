"""Per-row seeds: a row's sampled tokens are a function of its own prompt, seed and
settings, the same alone, in a batch of 4 or of 64, padded or not, with plain sampling
and with every speculator, at fixed depth and with the adaptive rule."""

import numpy as np
import pytest

import specjax
from specjax.config import tiny_llama
from specjax.speculators import DraftModel, Eagle, Medusa, NGram

ROW = [3, 4, 5, 3, 4, 5, 3, 4]  # repetitive: n-gram drafts on it
SEED = 11


def _batch(n, at, seed=0):
    """n prompts of ragged lengths (1 to 30 tokens: ROW is padded in the batch) with ROW
    at index `at`, and their seeds (ROW's is SEED)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 128, rng.integers(1, 31)).tolist() for _ in range(n)]
    seeds = rng.integers(0, 2 ** 32, n).tolist()
    prompts[at], seeds[at] = ROW, SEED
    return prompts, seeds


@pytest.fixture(scope="module")
def pair():
    """One-layer target and draft: compiling five speculators at three batch sizes is
    this module's cost."""
    cfg = tiny_llama(vocab_size=128, num_layers=1, hidden_size=32, intermediate_size=64,
                     num_heads=2, num_kv_heads=1)
    return specjax.init_model(cfg, seed=0), specjax.init_model(cfg, seed=1)


def _speculators(target, draft):
    return {"plain": None, "ngram": NGram(k=2), "draft": DraftModel.create(draft, k=2),
            "medusa": Medusa.random(target, num_heads=2, tree=[[0], [1], [0, 0]]),
            "eagle": Eagle.random(target, top_k=2, depth=2, total_tokens=4)}


# Each case compiles two generate programs (batch 1 and 64): the speculators that
# draft deterministically run with -m slow; the draft model, which samples its own
# proposals with the rows' keys, runs by default.
SLOW = pytest.mark.slow


@pytest.mark.parametrize("name,adaptive", [
    ("plain", False), ("draft", False), ("draft", True),
    pytest.param("ngram", False, marks=SLOW), pytest.param("ngram", True, marks=SLOW),
    pytest.param("medusa", False, marks=SLOW), pytest.param("eagle", False, marks=SLOW),
    pytest.param("eagle", True, marks=SLOW)])
def test_a_row_samples_the_same_alone_and_in_any_batch(pair, name, adaptive):
    """adaptive=True: with one seed per row the rule decides each row as if alone, and
    a row at k = 0 inside a drafting batch draws what a plain step draws."""
    target, draft = pair
    spec = _speculators(target, draft)[name]
    kw = dict(max_new_tokens=8, ignore_eos=True, temperature=1.0, top_k=40, speculator=spec)
    if spec is not None:
        kw["adaptive"] = adaptive
    if adaptive:  # free drafts from an optimistic start: rows draft, those whose drafts
        # fail drop to k = 0 while others still draft, and the verify forward's cost (this
        # backend's table) grows with the batch, so a batch-priced rule would decide
        # differently at 1 and 64 rows
        kw.update(cost_ratio=0.0, acceptance_prior=[0.9] * spec.shape.max_depth)
    alone = specjax.generate(target, [ROW], seed=[SEED], **kw).tokens[0]
    # 64 rows: more than the few-row matmul kernel takes (`specjax.rows_matmul`), so the
    # batch's products run another kernel than the row's alone
    prompts, seeds = _batch(64, 37)
    out = specjax.generate(target, prompts, seed=seeds, **kw)
    assert out.tokens[37] == alone, name
    if spec is not None:
        assert out.stats.drafted > 0  # speculation really happened
    other = specjax.generate(target, [ROW], seed=[SEED + 1], **kw).tokens[0]
    assert other != alone  # the seed matters


def test_one_int_seed_gives_identical_prompts_independent_draws(tiny_target):
    out = specjax.generate(tiny_target, [ROW] * 4, max_new_tokens=8, ignore_eos=True,
                           temperature=1.0, seed=5).tokens
    assert len({tuple(t) for t in out}) > 1
    again = specjax.generate(tiny_target, [ROW] * 4, max_new_tokens=8, ignore_eos=True,
                             temperature=1.0, seed=5).tokens
    assert again == out


@pytest.mark.parametrize("seed,match", [
    ([1, 2], "seed has 2 entries for 3 prompts"), ([1, 2, "x"], "seed entry 'x'"),
    ([1, True, 3], "seed entry True"), ([1, -2, 3], "seed entry -2"),
    (2 ** 32, "seed=4294967296"), (1.5, "seed=1.5"), ("7", "seed='7'")])
def test_bad_seeds_are_named(tiny_target, seed, match):
    with pytest.raises(ValueError, match=match):
        specjax.generate(tiny_target, [ROW] * 3, max_new_tokens=2, seed=seed)


def test_greedy_rows_with_their_own_seeds_are_decided_as_a_batch(pair):
    """At temperature 0 the depth drafted cannot change a row's tokens, so a seed list
    does not make the rule decide rows alone: it prices the batch's forward, as with one
    int seed (alone, the rows would draft where the batch does not)."""
    target, _ = pair
    prompts, seeds = _batch(64, 37)
    kw = dict(max_new_tokens=8, ignore_eos=True, speculator=NGram(k=2), cost_ratio=0.0,
              acceptance_prior=[0.9, 0.9])
    by_list = specjax.generate(target, prompts, seed=seeds, **kw)
    by_int = specjax.generate(target, prompts, seed=0, **kw)
    assert by_list.tokens == by_int.tokens
    assert by_list.stats.target_calls == by_int.stats.target_calls
    assert by_list.stats.drafted == by_int.stats.drafted
    alone = specjax.generate(target, prompts, seed=seeds, temperature=1.0, top_k=1, **kw)
    assert alone.tokens == by_int.tokens  # top_k=1 samples the greedy tokens
    assert alone.stats.drafted != by_int.stats.drafted  # rows alone decide otherwise
