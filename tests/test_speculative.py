"""Speculative generation end to end: lossless greedy, α/τ, sampling distribution, errors."""

from types import SimpleNamespace

import jax
import pytest

import specjax
from specjax import cpu_attention
from specjax.calibrate import MIN_IDLE
from specjax.config import tiny_llama
from specjax.decoding.cost import VerifyCost
from specjax.speculators import DraftModel, Hybrid, NGram
from specjax.stats import merge_stats
from tests.conftest import (
    PROMPTS,
    bfloat16_model,
    flat_verify_cost,
    self_drafting_emits_plain,
)
from tests.stat_utils import assert_same_distribution, exact_joint


@pytest.fixture(scope="module")
def greedy_ref(tiny_target):
    return specjax.generate(tiny_target, PROMPTS, max_new_tokens=16, ignore_eos=True).tokens


def _speculators(tiny_target, tiny_draft):
    return {
        "ngram": NGram(k=4),
        "draft": DraftModel.create(tiny_draft, k=3),
        "self": DraftModel.create(tiny_target, k=4),
    }


# "self" (the target as its own draft, every draft accepted) is also
# test_target_as_its_own_draft_accepts_everything's, in the default run; a distinct draft
# model's greedy output is checked by default in test_cost_ratio_override_drives_the_rule
# (adaptive), test_draft_skips_its_call_while_no_row_drafts and test_decode_outputs.py
@pytest.mark.parametrize("name", ["ngram", pytest.param("draft", marks=pytest.mark.slow),
                                  pytest.param("self", marks=pytest.mark.slow)])
def test_greedy_is_lossless(tiny_target, tiny_draft, greedy_ref, name):
    spec = _speculators(tiny_target, tiny_draft)[name]
    for adaptive in (False, True):
        out = specjax.generate(tiny_target, PROMPTS, max_new_tokens=16, ignore_eos=True,
                               speculator=spec, adaptive=adaptive)
        assert out.tokens == greedy_ref
    single = specjax.generate(tiny_target, PROMPTS[1:2], max_new_tokens=16, ignore_eos=True,
                              speculator=spec)
    assert single.tokens == greedy_ref[1:2]


def test_target_as_its_own_draft_accepts_everything(tiny_target):
    # 40 tokens: test_draft_skips_its_call_while_no_row_drafts's loop (adaptive is traced)
    out = specjax.generate(tiny_target, PROMPTS, max_new_tokens=40, ignore_eos=True,
                           speculator=DraftModel.create(tiny_target, k=4), adaptive=False)
    assert out.stats.acceptance_rate == 1.0
    assert out.stats.mean_accepted_length > 4.0  # k + 1 per step but for the budget's end
    assert out.stats.draft_calls == 4 * out.stats.target_calls


@pytest.mark.parametrize("kv_commit", ["write-kept", "compact"])
def test_a_bfloat16_target_drafting_for_itself_emits_plain_decodings_tokens(kv_commit):
    """A bfloat16 model decodes in the in-place layout through the CPU kernels (bfloat16
    weights widened as they stream, bfloat16 queries and pages); speculation over it,
    both commit paths, emits plain decoding's tokens."""
    from specjax.models.transformer import layout_of

    cfg = tiny_llama(vocab_size=128, hidden_size=128, num_heads=2, dtype="bfloat16")
    model = bfloat16_model(cfg, seed=3)
    assert layout_of(model.decode_params()) == "in_place"
    self_drafting_emits_plain(model, PROMPTS, 24, kv_commit=kv_commit)


def test_ngram_on_repetitive_input_accepts_long_runs(tiny_target):
    # The tiny model falls into a loop on this prompt; n-gram then drafts from the loop.
    prompt = [10] * 20
    out = specjax.generate(tiny_target, [prompt], max_new_tokens=48, ignore_eos=True,
                           speculator=NGram(k=6), adaptive=False)
    assert out.stats.mean_accepted_length > 2.0
    assert out.stats.draft_calls == 0


def test_ngram_takes_the_latest_match_with_a_whole_continuation():
    """Of the earlier occurrences of the last n tokens, the most recent one with k tokens
    after it; else the one with the most (the earliest); a longer n still wins."""
    import jax.numpy as jnp

    from specjax.speculators.base import ProposeContext

    def draft(row, length, k=4):
        toks = jnp.asarray([row + [0] * (16 - len(row))], jnp.int32)
        ctx = ProposeContext(toks, jnp.asarray([length]), jnp.asarray([True]), None, None,
                             jnp.asarray([k]))
        tree, _ = NGram(k=k, n_min=1).propose(None, ctx, None)
        return [int(t) for t, v in zip(tree.tokens[0], tree.valid[0]) if v]

    # last token 3: after position 9 only one token follows, after position 2 four do
    assert draft([1, 2, 3, 4, 5, 6, 7, 8, 9, 3, 3], 11) == [4, 5, 6, 7]
    # two whole continuations (3 at 2 and at 7): the later one
    assert draft([1, 2, 3, 4, 5, 6, 9, 3, 8, 8, 8, 8, 3], 13) == [8, 8, 8, 8]
    # none whole at k = 6: the longest (after 3 at 1), not the latest (after 3 at 4)
    assert draft([7, 3, 4, 5, 3, 9, 3], 7, k=6) == [4, 5, 3, 9, 3]
    # the bigram (2, 3) at 1-2 beats the unigram 3's whole continuation at 6
    assert draft([1, 2, 3, 7, 7, 9, 3, 4, 4, 4, 4, 4, 2, 3], 14) == [7, 7, 9, 3]


def test_eos_inside_an_accepted_run_stops_the_row(tiny_target, greedy_ref):
    eos = greedy_ref[2][5]
    plain = specjax.generate(tiny_target, PROMPTS, max_new_tokens=16, eos_id=eos)
    spec = specjax.generate(tiny_target, PROMPTS, max_new_tokens=16, eos_id=eos,
                            speculator=DraftModel.create(tiny_target, k=4), adaptive=False)
    assert spec.tokens == plain.tokens


@pytest.mark.parametrize("make,match", [
    (lambda t, d: NGram(k=0), "k=0"),
    (lambda t, d: NGram(n_min=3, n_max=2), "n_min"),
    (lambda t, d: DraftModel.create(d, k=0), "k=0"),
])
def test_bad_speculator_settings(tiny_target, tiny_draft, make, match):
    with pytest.raises(ValueError, match=match):
        make(tiny_target, tiny_draft)


def test_draft_with_another_vocabulary_is_rejected(tiny_target):
    other = specjax.init_model(tiny_llama(vocab_size=100, num_layers=1), seed=2)
    with pytest.raises(ValueError, match="vocab_size=100"):
        specjax.generate(tiny_target, PROMPTS, max_new_tokens=4,
                         speculator=DraftModel.create(other, k=2))
    with pytest.raises(ValueError, match="vocab_size=100"):
        DraftModel.create(other, k=2, target=tiny_target)


# ---- sampling: the output distribution is the target's ------------------------------
VOCAB = 8


@pytest.fixture(scope="module")
def peaked_pair():
    """A tiny-vocab target and draft with peaked, different distributions (so a wrong
    verifier is detectable): embeddings scaled up from the random init."""
    def make(seed):
        m = specjax.init_model(tiny_llama(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                          num_heads=2, num_kv_heads=1), seed=seed)
        m.params["lm_head"]["kernel"] = m.params["lm_head"]["kernel"] * 60.0
        return m
    target = make(10)
    draft = make(11)  # a noisy copy of the target: overlapping but different distributions
    draft.params = jax.tree.map(lambda t, d: t + 0.3 * (d - t), target.params, draft.params)
    return target, draft


# None: block verification, the chains' default; a chain verified token-wise by
# rejection runs with -m slow (trees' default: by default in test_speculators_heads.py)
@pytest.mark.parametrize("spec_name,temperature,top_p,verification", [
    ("draft", 1.0, 1.0, None), ("draft", 0.7, 0.9, None), ("ngram", 1.0, 1.0, None),
    ("hybrid", 1.0, 1.0, None),  # the lookup's chain where it matches, the draft's elsewhere
    ("draft", 1.0, (1.0, 0.1), None),  # min-p 0.1
    pytest.param("draft", 1.0, 1.0, "rejection", marks=pytest.mark.slow)])
def test_sampled_output_has_the_target_distribution(peaked_pair, spec_name, temperature, top_p,
                                                    verification):
    top_p, min_p = top_p if isinstance(top_p, tuple) else (top_p, 0.0)
    target, draft = peaked_pair
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    n_rows = 3000
    # one-token matches: a random model rarely repeats a pair of tokens
    spec = {"draft": lambda: DraftModel.create(draft, k=2),
            "ngram": lambda: NGram(k=2, n_min=1),
            "hybrid": lambda: Hybrid.create(NGram(k=2, n_min=1),
                                            DraftModel.create(draft, k=2))}[spec_name]()
    out = specjax.generate(target, [prompt] * n_rows, max_new_tokens=3, ignore_eos=True,
                           temperature=temperature, top_p=top_p, min_p=min_p, seed=1,
                           speculator=spec, adaptive=False, verification=verification)
    assert out.stats.accepted > 0  # speculation really happened
    samples = [tuple(t[:3]) for t in out.tokens]
    exact = exact_joint(target, prompt, 3, temperature, top_p, min_p=min_p)
    assert_same_distribution(samples, exact)


def test_verify_buckets_and_depth_widths():
    from specjax.decoding.policy import verify_buckets
    from specjax.tree import depth_widths

    assert NGram(k=4).shape.depth_widths == (0, 1, 2, 3, 4)
    # a plain step, depth 1 (probes, short n-gram matches), half and full depth
    assert verify_buckets((0, 1, 2, 3, 4, 5, 6, 7, 8)) == ((0, 0), (1, 1), (4, 4), (8, 8))
    assert verify_buckets((0, 1, 2, 3, 4)) == ((0, 0), (1, 1), (2, 2), (4, 4))
    assert verify_buckets((0, 1)) == ((0, 0), (1, 1))
    # equal widths: one forward serves the deeper depth
    assert verify_buckets((0, 5, 5, 5)) == ((0, 0), (3, 5))
    assert verify_buckets((0, 4, 16, 16, 16)) == ((0, 0), (1, 4), (4, 16))  # EAGLE-2
    # a depth-sorted static tree: widths are node counts up to each depth
    assert depth_widths([1, 1, 2, 2, 2, 3]) == (0, 2, 5, 6)


def test_adaptive_verifies_only_what_pays(tiny_target, greedy_ref):
    """A costly verify forward (large slope) makes every step a plain one-token step; a
    free one (slope 0) verifies the drafts. Output is target-only greedy either way, and
    the stats count the inputs each forward fed (one-token matches: a random model
    rarely repeats a pair of tokens)."""
    spec = NGram(k=4, n_min=1)
    costly = specjax.generate(tiny_target, PROMPTS, max_new_tokens=16, ignore_eos=True,
                              speculator=spec, verify_cost=VerifyCost(per_token=50.0))
    free = specjax.generate(tiny_target, PROMPTS, max_new_tokens=16, ignore_eos=True,
                            speculator=spec, verify_cost=VerifyCost())
    assert costly.tokens == greedy_ref and free.tokens == greedy_ref
    # k = 0 but for the probe step every 16 (rows re-measure with k = 1)
    assert costly.stats.mean_verified < 1.2 and costly.stats.mean_accepted_length < 1.2
    assert free.stats.mean_verified > 1.5 and free.stats.mean_accepted_length > 1.5
    assert free.stats.verify_cost == 1.0  # slope 0: the paper's free verify
    # every forward of a non-adaptive run is a speculative step's, in the verify switch
    branched = specjax.generate(tiny_target, PROMPTS, max_new_tokens=16, ignore_eos=True,
                                speculator=spec, verify_cost=VerifyCost(branch=0.5),
                                adaptive=False)
    assert branched.stats.verify_cost == pytest.approx(1.5)
    # a draft as costly as the target never pays, whatever the verify costs
    selfish = specjax.generate(tiny_target, PROMPTS, max_new_tokens=16, ignore_eos=True,
                               speculator=DraftModel.create(tiny_target, k=4),
                               verify_cost=VerifyCost())
    assert selfish.tokens == greedy_ref and selfish.stats.drafted <= 4
    for bad, match in ((VerifyCost(slope=-1.0), "slope=-1"),
                       (VerifyCost(jump=float("inf")), "jump=inf"), (0.5, "verify_cost=0.5")):
        with pytest.raises(ValueError, match=match):
            specjax.generate(tiny_target, PROMPTS, max_new_tokens=4, speculator=spec,
                             verify_cost=bad)


def test_mixed_buckets_in_one_batch_stay_lossless(tiny_target, greedy_ref):
    """n-gram finds matches in some rows and steps, none in others: steps run the plain,
    half-depth and full-depth forwards, and the output is still target-only greedy."""
    out = specjax.generate(tiny_target, PROMPTS, max_new_tokens=16, ignore_eos=True,
                           speculator=NGram(k=4), verify_cost=VerifyCost())
    assert out.tokens == greedy_ref
    assert 1.0 < out.stats.mean_verified < 5.0


def test_batch_verify_bucket_weighs_the_whole_batch():
    """One row with a deep draft does not make a batch of idle rows verify 5 tokens;
    alone, or with company that also drafts, it does."""
    import jax.numpy as jnp
    import numpy as np

    from specjax.decoding.policy import batch_verify_bucket

    depths = [0, 2, 4]
    cost = 1.0 + 0.75 * np.log2([1, 3, 5])
    one = lambda n, alpha, deep: batch_verify_bucket(  # noqa: E731
        jnp.full((n,), alpha), jnp.asarray([deep] + [0] * (n - 1)), jnp.ones((n,), bool),
        depths, cost)
    assert int(one(8, 0.9, 4)) == 0  # 7 idle rows: 8 + 3.1 tokens cannot pay 2.7x
    assert int(one(1, 0.9, 4)) == 2  # alone: 4.1 tokens for 2.7x
    assert int(one(1, 0.2, 4)) == 0  # poor acceptance never pays
    all_deep = batch_verify_bucket(jnp.full((8,), 0.9), jnp.full((8,), 4), jnp.ones((8,), bool),
                                   depths, cost)
    assert int(all_deep) == 2
    # inactive rows do not count; a free verify always covers the deepest draft
    inactive = batch_verify_bucket(jnp.full((8,), 0.9), jnp.asarray([4] + [0] * 7),
                                   jnp.asarray([True] + [False] * 7), depths, cost)
    assert int(inactive) == 2
    free = batch_verify_bucket(jnp.full((8,), 0.5), jnp.asarray([2] + [0] * 7),
                               jnp.ones((8,), bool), depths, np.ones(3))
    assert int(free) == 1


def test_the_batch_drafts_only_where_its_slowest_row_does_not_lose():
    """`speculation_pays`: at batch 1 it is the row's own rule (margin included); at
    batch > 1 a row kept at k = 0 vetoes a costly verify unless it finishes long before
    the others, and a free verify that no row loses by pays for the rows that gain."""
    import jax.numpy as jnp
    import numpy as np

    from specjax.decoding.policy import speculation_pays

    depths, cost = [0, 2, 4], 1.0 + 0.75 * np.log2([1, 3, 5])

    def pays(alpha, k, remaining=None, c=cost, margin=0.05):
        n = len(k)
        rem = jnp.full((n,), 32) if remaining is None else jnp.asarray(remaining)
        return bool(speculation_pays(jnp.full((n,), alpha), jnp.asarray(k), jnp.ones((n,), bool),
                                     rem, depths, c, margin))

    assert pays(0.9, [4])  # 4.1 tokens for 2.74
    assert not pays(0.45, [2])  # 1.65 tokens for 2.19
    # E(4) at α 0.7 is 2.77 for a cost of 2.74: a gain of 1 %, inside a 5 % margin
    assert pays(0.7, [4], margin=0.0) and not pays(0.7, [4])
    assert pays(0.9, [4] * 8) and not pays(0.9, [4] * 7 + [0])
    assert pays(0.9, [4] * 7 + [0], remaining=[32] * 7 + [8])
    assert pays(0.9, [4] * 7 + [0], c=np.ones(3)) and not pays(0.9, [0] * 8, c=np.ones(3))


def test_the_batch_rule_reads_its_unluckiest_row(tiny_target):
    """`slowest_row_acceptance` lowers α by the expected largest of B normal draws in
    standard errors: nothing at batch 1, more with more rows and fewer tries. So a
    verify cost that the default prior (α 0.75) pays for alone does not make 4 rows
    that share it draft: one of them is expected near α 0.52, where no depth pays."""
    import jax.numpy as jnp
    import numpy as np

    from specjax.decoding.policy import slowest_row_acceptance, slowest_row_z

    assert slowest_row_z(1) == 0.0 and slowest_row_z(4) == pytest.approx(1.05, abs=0.01)
    assert slowest_row_z(16) == pytest.approx(1.77, abs=0.01)
    a, few, many = jnp.full((1, 2), 0.75), jnp.zeros((1, 2)), jnp.full((1, 2), 96)
    assert np.allclose(slowest_row_acceptance(a, few, 1), 0.75)
    low4, low16 = slowest_row_acceptance(a, few, 4), slowest_row_acceptance(a, few, 16)
    assert 0.5 < float(low4[0, 0]) < 0.55 and float(low16[0, 0]) < float(low4[0, 0])
    assert float(slowest_row_acceptance(a, many, 16)[0, 0]) > 0.65  # tries shrink the doubt

    cost = VerifyCost.from_table({1: 1.0, 2: 1.6, 3: 1.9, 5: 2.2},
                                 by_rows={4: {1: 1.0, 2: 1.6, 3: 1.9, 5: 2.2}})
    kw = dict(max_new_tokens=14, ignore_eos=True, verify_cost=cost, speculator=NGram(k=4))
    alone = specjax.generate(tiny_target, PROMPTS[:1], **kw)
    batch = specjax.generate(tiny_target, PROMPTS, **kw)
    plain = specjax.generate(tiny_target, PROMPTS, max_new_tokens=14, ignore_eos=True)
    assert alone.stats.drafted > 0  # E(4) = 3.05 tokens for 2.2
    assert batch.stats.drafted == 0 and batch.tokens == plain.tokens  # no probe before 15


def test_batch_rule_spares_idle_rows(tiny_target):
    """A ragged batch where one row repeats itself (n-gram matches) and the others do
    not: with a costly verify the batch rule verifies far fewer inputs than drafting at
    full depth would, and the output stays target-only greedy."""
    prompts = [[5, 6, 7, 8] * 6] + [[int(x) for x in jax.random.permutation(
        jax.random.key(i), 128)[:24]] for i in range(7)]
    ref = specjax.generate(tiny_target, prompts, max_new_tokens=24, ignore_eos=True).tokens
    runs = {a: specjax.generate(tiny_target, prompts, max_new_tokens=24, ignore_eos=True,
                                speculator=NGram(k=4, n_min=2), adaptive=a,
                                verify_cost=VerifyCost(slope=0.75, per_token=0.4))
            for a in (False, True)}
    assert runs[False].tokens == ref and runs[True].tokens == ref
    assert runs[False].stats.mean_verified > 2.0  # the repeating row drafts every step
    assert runs[True].stats.mean_verified < 0.75 * runs[False].stats.mean_verified
    # the same row alone pays for its own verify, so it keeps drafting
    alone = specjax.generate(tiny_target, prompts[:1], max_new_tokens=24, ignore_eos=True,
                             speculator=NGram(k=4, n_min=2),
                             verify_cost=VerifyCost(slope=0.75, per_token=0.4))
    assert alone.tokens == ref[:1] and alone.stats.mean_verified > 2.0


def test_cost_ratio_override_drives_the_rule(tiny_target, tiny_draft, greedy_ref):
    """generate(cost_ratio=) replaces the parameter-count estimate: a draft said to cost
    as much as the target never drafts, a free one does; bad values are refused."""
    spec = DraftModel.create(tiny_draft, k=3)
    runs = {c: specjax.generate(tiny_target, PROMPTS, max_new_tokens=16, ignore_eos=True,
                                speculator=spec, cost_ratio=c, verify_cost=VerifyCost())
            for c in (0.0, 1.0)}
    assert runs[0.0].tokens == greedy_ref and runs[1.0].tokens == greedy_ref
    assert runs[1.0].stats.cost_ratio == 1.0 and runs[0.0].stats.cost_ratio == 0.0
    assert runs[1.0].stats.drafted <= len(PROMPTS)  # probe steps at most
    assert runs[0.0].stats.drafted > 4 * len(PROMPTS)
    for bad in (-0.5, float("nan")):
        with pytest.raises(ValueError, match="cost_ratio="):
            specjax.generate(tiny_target, PROMPTS, max_new_tokens=4, speculator=spec,
                             cost_ratio=bad)


def test_verify_cost_model_and_its_stats(tiny_target, greedy_ref):
    """v(T) = 1 + jump·[T > 1] + slope·log2 T; the stats' verify_cost is the mean over
    the decode forwards of their cost relative to a plain step of the batch, v(B·T)/v(B)
    (every step verifies 5 inputs per row here: the target drafts for itself at full
    depth; B = 4 rows)."""
    import numpy as np

    vc = VerifyCost(jump=0.5, slope=0.25)
    np.testing.assert_allclose(vc(np.asarray([1, 2, 8])), [1.0, 1.75, 2.25], rtol=1e-6)
    out = specjax.generate(tiny_target, PROMPTS, max_new_tokens=16, ignore_eos=True,
                           speculator=DraftModel.create(tiny_target, k=4), adaptive=False,
                           verify_cost=vc)
    assert out.tokens == greedy_ref and out.stats.mean_verified == 5.0
    assert out.stats.verify_cost == pytest.approx(
        (1.5 + 0.25 * np.log2(4 * 5)) / (1.5 + 0.25 * np.log2(4)), rel=1e-6)
    assert "0.5·[T > 1]" in vc.describe()


def test_a_free_verify_keeps_the_cost_models_form():
    """`VerifyCost.free`: every forward costs one plain step, at any batch and context,
    in the same pytree structure and shapes as the model it came from (so the loop
    compiled for that model runs it), and validated as generate validates."""
    import numpy as np

    from specjax.decoding.cost import VERIFY_COST

    for cost in (VERIFY_COST["cpu"], VERIFY_COST["cpu-rows"], VERIFY_COST["cpu-xla"],
                 VERIFY_COST["gpu"], VerifyCost.from_table({1: 1.0, 2: 1.5, 5: 2.0})):
        free = cost.free().validated()
        shapes = lambda c: jax.tree.map(np.shape, c.validated())  # noqa: E731
        assert jax.tree.structure(free) == jax.tree.structure(cost.validated())
        assert shapes(free) == shapes(cost)
        for rows in (1, 4, 16, 64):
            for context in (None, 64, 4096):
                got = free.speculative(np.asarray([1, 2, 5, 17, 300]), rows, context)
                np.testing.assert_allclose(got, 1.0, rtol=1e-6)
        assert float(cost.speculative(5, 1)) > 1.0  # the model it came from is not free


def test_every_cost_model_prices_in_one_layout():
    """`VerifyCost.canonical`: formulas and tables of any size up to the canonical one
    (with and without batch rows and far tables) take one pytree structure and shapes,
    so the loop compiled for one runs them all, and each prices every forward as the
    model it came from: at measured and unmeasured T, between and past the measured
    batches, at and beyond the measured contexts."""
    import numpy as np

    from specjax.decoding.cost import CANONICAL_POINTS, VERIFY_COST

    costs = [VERIFY_COST["cpu"], VERIFY_COST["cpu-rows"], VERIFY_COST["cpu-xla"],
             VERIFY_COST["gpu"], VerifyCost(),
             VerifyCost(jump=0.5, slope=0.25, per_token=0.3, branch=0.1),
             VerifyCost.from_table({1: 1.0, 4: 1.0, 5: 3.0, 10_000: 3.0}),
             VerifyCost.from_table({1: 1.0, 2: 1.5, 5: 2.0}, by_rows={8: {1: 1.0, 2: 1.9,
                                                                          5: 2.5}},
                                   contexts=(64, 512),
                                   far={1: {1: 1.1, 2: 1.4, 5: 3.0},
                                        8: {1: 1.3, 2: 2.2, 5: 4.0}})]
    layout = jax.tree.map(np.shape, costs[0].validated().canonical())  # structure, shapes
    for cost in costs:
        assert jax.tree.map(np.shape, cost.validated().canonical()) == layout
    assert layout.measured == (2, CANONICAL_POINTS)
    tokens = np.asarray([1, 2, 3, 4, 5, 7, 9, 30, 129, 300, 5000])
    # priced as the loop prices them, traced (eagerly, these 500 calls took ~25 s)
    price = jax.jit(lambda cost, rows, context: cost.speculative(tokens, rows, context))
    near = jax.jit(lambda cost, rows: cost.speculative(tokens, rows))
    for cost in costs:
        cost = cost.validated()
        canon = cost.canonical()
        for rows in (1, 2, 4, 6, 16, 40):
            for context in (None, 0, 64, 300, 1024, 4096):
                got, want = ((near(canon, rows), near(cost, rows)) if context is None else
                             (price(canon, rows, context), price(cost, rows, context)))
                np.testing.assert_allclose(got, want, rtol=2e-5,
                                           err_msg=f"{cost} {rows} {context}")
        np.testing.assert_allclose(canon(tokens), cost(tokens), rtol=2e-5)
    canon = costs[0].validated().canonical()
    again = canon.validated().canonical()  # generate validates what it is given
    assert jax.tree.all(jax.tree.map(np.array_equal, again, canon))
    with pytest.raises(ValueError, match="tabled=0.5"):
        canon.replace(tabled=0.5).validated()


def test_another_cost_model_or_n_min_runs_the_compiled_loop(tiny_target, greedy_ref):
    """After one call, calls with a formula or a table of another size (`canonical`'s one
    layout), or an n-gram of another `n_min` (traced), compile no program of their own."""
    from specjax.decoding.cost import VERIFY_COST
    from specjax.decoding.generate import PROGRAMS

    kw = dict(max_new_tokens=16, ignore_eos=True)
    assert specjax.generate(tiny_target, PROMPTS, speculator=NGram(k=4), **kw
                            ).tokens == greedy_ref
    compiled = {sig for sig, _ in PROGRAMS.items()}
    for cost in (VerifyCost(), VerifyCost(jump=0.5, slope=0.25), flat_verify_cost(3.0),
                 VERIFY_COST["cpu-xla"]):
        out = specjax.generate(tiny_target, PROMPTS, verify_cost=cost, speculator=NGram(k=4),
                               **kw)
        assert out.tokens == greedy_ref
    drafted = []
    for n_min in (1, 3):  # drafting at every chance (traced settings too), so n_min shows
        out = specjax.generate(tiny_target, PROMPTS, speculator=NGram(k=4, n_min=n_min),
                               cost_ratio=0.0, acceptance_prior=[0.9] * 4,
                               verify_cost=flat_verify_cost(1.0), **kw)
        assert out.tokens == greedy_ref
        drafted.append(out.stats.drafted)
    assert drafted[0] > drafted[1]  # the traced n_min took effect: one-token matches draft
    assert {sig for sig, _ in PROGRAMS.items()} == compiled


def test_per_position_acceptance_model():
    """E[tokens] from per-position acceptance: a constant α is Leviathan's closed form;
    all-or-nothing drafts (α_1 low, then certain) are worth drafting deep, which one
    averaged α would miss; the loop's counters give α_d."""
    import jax.numpy as jnp
    import numpy as np

    from specjax.decoding.policy import expected_tokens, leviathan_optimal_k, position_acceptance

    a = 0.7
    np.testing.assert_allclose(expected_tokens(jnp.full((1, 4), a))[0],
                               [(1 - a ** (k + 1)) / (1 - a) for k in range(5)], rtol=1e-6)
    np.testing.assert_allclose(expected_tokens(jnp.asarray([[1.0, 0.0, 1.0]]))[0],
                               [1, 2, 2, 2])
    v = np.asarray([1.0, 1.7, 1.7, 1.8, 1.8])
    bimodal = jnp.asarray([[0.4, 1.0, 1.0, 1.0]])  # E(4) = 2.6: worth 1.8
    assert int(leviathan_optimal_k(bimodal, 0.0, 4, v)[0]) == 4
    # the same steps as one α = accepted / drafted = 0.4 · 4 / 4: E(4) = 1.66, not worth it
    assert int(leviathan_optimal_k(jnp.asarray([0.4]), 0.0, 4, v)[0]) == 0
    # hist: 6 steps accepted 0, 4 accepted all 4 (of 10 that tried depth 1)
    hist = jnp.asarray([[6, 0, 0, 0, 4]])
    tried = jnp.asarray([[10, 4, 4, 4]])
    np.testing.assert_allclose(position_acceptance(hist, tried, prior=(0.0, 0.0))[0],
                               [0.4, 1.0, 1.0, 1.0])
    np.testing.assert_allclose(position_acceptance(jnp.zeros((1, 3)), jnp.zeros((1, 2)))[0],
                               [0.75, 0.75])
    # rejections at depth 1 leave deeper positions untried: their estimates follow α_1
    # (prior 3 in 4 at depth 1, then 4 pseudo-tries at α_{d-1}), so the row stops
    # drafting deep after three rejections, not after α_1 alone is tiny
    three_rejected = position_acceptance(jnp.asarray([[3, 0, 0, 0, 0]]),
                                         jnp.asarray([[3, 0, 0, 0]]))[0]
    np.testing.assert_allclose(three_rejected, [3 / 7] * 4, rtol=1e-6)
    v = np.asarray([1.0, 1.59, 1.82, 1.82, 1.82])  # CPU verify costs per k (buckets)
    assert int(leviathan_optimal_k(three_rejected[None], 0.0, 4, v)[0]) == 0
    one_rejected = position_acceptance(jnp.asarray([[1, 0, 0, 0, 0]]),
                                       jnp.asarray([[1, 0, 0, 0]]))
    assert int(leviathan_optimal_k(one_rejected, 0.0, 4, v)[0]) > 0  # not yet evidence


def test_a_draft_must_beat_plain_decoding_by_the_margin():
    """k > 0 is picked only where its tokens per unit of cost beat k = 0's by 1 + margin:
    α = 0.5 at one depth for 1.45 steps is 1.03x plain, so it drafts with no margin and not
    with the default DRAFT_MARGIN; 1.2 steps (1.25x) drafts either way."""
    import jax.numpy as jnp

    from specjax.decoding.policy import DRAFT_MARGIN, leviathan_optimal_k

    alpha = jnp.asarray([[0.5]])
    for v, no_margin, default in ((1.45, 1, 0), (1.2, 1, 1)):
        costs = jnp.asarray([1.0, v])
        assert int(leviathan_optimal_k(alpha, 0.0, 1, costs)[0]) == no_margin
        assert int(leviathan_optimal_k(alpha, 0.0, 1, costs, margin=DRAFT_MARGIN)[0]) == default


def test_draft_skips_its_call_while_no_row_drafts(tiny_target, tiny_draft):
    """With verification priced so that the batch stays at k = 0 from the prior and after
    two accepted probes, but four accepted probes would make it draft (so probes run:
    `specjax.decoding.policy.PROBE_LOOKAHEAD`), rows draft only on probe steps: the draft
    makes no call in between and its queue grows (forced calls when it fills). The target
    as its own draft must still accept every probe draft, so the draft's cache stayed
    exact."""
    ref = specjax.generate(tiny_target, PROMPTS, max_new_tokens=40, ignore_eos=True).tokens
    # any verify costs 2.6 plain steps at this batch; the draft is free. The batch's
    # slowest row (`slowest_row_acceptance`) is expected at E(4) = 2.0 from the prior
    # and 2.55 after two accepted probes (no gain), at 2.9 after four (a gain beyond
    # DRAFT_MARGIN)
    never = flat_verify_cost(2.6)
    own = specjax.generate(tiny_target, PROMPTS, max_new_tokens=40, ignore_eos=True,
                           speculator=DraftModel.create(tiny_target, k=4), verify_cost=never,
                           cost_ratio=0.0)
    assert own.tokens == ref
    # rows at k = 0 decode plainly (the nested loop) and probe one token at steps 15
    # and, the probe accepted (gap back to 16), 31: exactly two probes per row
    assert own.stats.drafted == 2 * len(PROMPTS), own.stats.drafted
    assert own.stats.accepted == own.stats.drafted
    assert own.stats.target_calls == (40 - 1 - 2) * len(PROMPTS)
    other = specjax.generate(tiny_target, PROMPTS, max_new_tokens=40, ignore_eos=True,
                             speculator=DraftModel.create(tiny_draft, k=3), verify_cost=never)
    assert other.tokens == ref


def test_a_speculator_that_can_never_draft_runs_plain_decoding(tiny_target, greedy_ref):
    """Where the rule keeps every row at k = 0 and no probe could pay (α = 0 at every
    depth, and a verify at twice a plain step at any batch: even four accepted probes,
    α_1 = 0.5, give 1.5 tokens for 2 steps), α can never move: generate runs plain
    decoding's compiled programs (none beside a plain call's) with plain decoding's
    tokens, sampled and greedy. A probe that could pay (a verify at 1 step) keeps the
    speculative loop."""
    import jax.numpy as jnp

    from specjax.decoding import policy
    from specjax.decoding.generate import PROGRAMS
    from specjax.decoding.policy import Rule

    dear = VerifyCost(per_token=2.0)
    # k = 4 at batch 4: the loop test_greedy_is_lossless compiled (the module's programs)
    kw = dict(max_new_tokens=12, ignore_eos=True, temperature=1.0, seed=5)
    plain = specjax.generate(tiny_target, PROMPTS, **kw)
    before = len(PROGRAMS.items())
    never = specjax.generate(tiny_target, PROMPTS, **kw, speculator=NGram(k=4),
                             acceptance_prior=[0.0] * 4, verify_cost=dear,
                             verification="block")
    assert len(PROGRAMS.items()) == before and never.tokens == plain.tokens
    assert never.stats.drafted == 0 and never.stats.target_calls == 11 * len(PROMPTS)
    assert never.stats.acceptance_by_position == [None] * 4  # counters at the draft's depth
    assert never.stats.speculative_calls == plain.stats.speculative_calls == 0
    greedy = specjax.generate(tiny_target, PROMPTS, max_new_tokens=12, ignore_eos=True,
                              speculator=NGram(k=4), acceptance_prior=[0.0] * 4,
                              verify_cost=dear)
    assert greedy.tokens == [g[:12] for g in greedy_ref]
    probing = specjax.generate(tiny_target, PROMPTS, **kw, speculator=NGram(k=4),
                               acceptance_prior=[0.0] * 4, verify_cost=VerifyCost())
    assert probing.stats.speculative_calls == 1  # a probe could pay: the speculative loop
    assert merge_stats([never.stats, probing.stats, probing.stats]).speculative_calls == 2
    rule = lambda prior, v=dear: Rule(jnp.float32(0.0), jnp.bool_(True), v.validated(),
                                      jnp.asarray(prior, jnp.float32))
    assert not policy.may_draft(NGram(k=3), rule([0.0] * 3), 4)
    assert policy.may_draft(NGram(k=3), rule([0.0] * 3, VerifyCost()), 4)  # probes pay
    assert policy.may_draft(NGram(k=3), rule([0.9] * 3, VerifyCost()), 4)  # drafts at once
    assert policy.may_draft(NGram(k=3), rule([0.0] * 3).replace(adaptive=jnp.bool_(False)), 1)
    # a verify that grows dear with the context: drafts after a short prompt, not a long one
    growing = VerifyCost.from_table({1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3}, contexts=(0, 100),
                                    far={1: {1: 1.5, 2: 3.0, 3: 4.5, 4: 6.0}})
    assert policy.may_draft(NGram(k=3), rule([0.9] * 3, growing), 1, 10)
    assert not policy.may_draft(NGram(k=3), rule([0.9] * 3, growing), 1, 5000)


def test_plain_steps_keep_every_speculator_lossless(tiny_target, tiny_draft, greedy_ref,
                                                    monkeypatch):
    """With verification priced out so far that no probe could pay, every row is settled
    at k = 0 for good: steps run as plain decode steps in a nested loop and the
    speculator does no work at all, not even the draft calls that empty a full queue
    (the draft model's and EAGLE's queues, k + 1 + QUEUE_SLACK = 11-12 pairs, fill within
    these 15 steps).
    Greedy output stays target-only, one target call per token. (The commit of each
    plain step's pair, for rows that may still probe, is
    test_no_call_while_no_row_drafts_stays_lossless's.)"""
    from specjax.decoding import generate as generate_module
    from specjax.speculators import Eagle

    # start the loop anyway (generate would run plain decoding's programs outright): the
    # rows settle at the first decision and the loop's plain steps run
    monkeypatch.setattr(generate_module, "may_draft", lambda *a: True)
    never = VerifyCost(per_token=100.0)
    # the queueless n-gram, the draft model's queue and the EAGLE head's queue (Medusa
    # and EAGLE-1 take the same paths as EAGLE-3 here)
    for spec in (NGram(k=3), DraftModel.create(tiny_draft, k=3),
                 Eagle.random(tiny_target, top_k=2, depth=3, total_tokens=6)):
        out = specjax.generate(tiny_target, PROMPTS, max_new_tokens=16, ignore_eos=True,
                               speculator=spec, verify_cost=never)
        assert out.tokens == greedy_ref, type(spec).__name__
        st = out.stats
        assert st.drafted == 0 and st.draft_calls == 0, (type(spec).__name__, st.draft_calls)
        assert st.target_calls == (16 - 1) * len(PROMPTS)
    # every step ran as a plain step: sampling consumed the key exactly as plain
    # decoding does (a k = 0 speculative step splits it differently), so at T = 1 the
    # tokens equal plain decoding's with the same seed
    plain = specjax.generate(tiny_target, PROMPTS, max_new_tokens=16, ignore_eos=True,
                             temperature=1.0, seed=3).tokens
    spec_run = specjax.generate(tiny_target, PROMPTS, max_new_tokens=16, ignore_eos=True,
                                temperature=1.0, seed=3, speculator=NGram(k=3),
                                verify_cost=never).tokens
    assert spec_run == plain


def _attention_sensitive_target():
    """A tiny target whose greedy output depends on every cached key: sharp attention
    (q/k projections scaled up) and peaked logits, so a KV slot committed wrongly
    changes the tokens (the random init's near-uniform attention would hide it)."""
    m = specjax.init_model(tiny_llama(vocab_size=128), seed=3)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 4.0 if any(getattr(k, "key", None) in ("q_proj", "k_proj")
                                       for k in path) else x, m.params)
    m.params = params
    return m


def test_probes_must_be_worth_the_loops_upkeep(tiny_target, greedy_ref):
    """A row at k = 0 keeps probing only where the chance that its next four probes are
    all accepted (α₁⁴), times the share of the cost drafting would then save, covers what
    each of its steps costs in the speculative loop (`idle_overhead`) and what its probes
    lose against plain steps, spread over the gap between them (`probe_loss`); else,
    from the prior alone, the call runs plain decoding's programs."""
    import jax.numpy as jnp

    from specjax.decoding import policy
    from specjax.decoding.policy import Rule, probe_loss, probe_value

    assert bool(probe_value(jnp.asarray([0.5]), jnp.asarray([1.25]), 0.01)[0])  # 0.0125
    assert not bool(probe_value(jnp.asarray([0.5]), jnp.asarray([1.25]), 0.02)[0])
    assert bool(probe_value(jnp.asarray([0.0]), jnp.asarray([1.25]), 0.0)[0])
    # a probe costing 1.5 plain steps for 1.3 tokens, every 16 steps; one that gains: 0
    assert float(probe_loss(jnp.asarray([0.3]), 1.5, 16)[0]) == pytest.approx(0.0125)
    assert float(probe_loss(jnp.asarray([0.6]), 1.5, 16)[0]) == 0.0
    # α₁ 0.3 and a verify of 1.5 plain steps: k = 0 (1.42 tokens at depth 3 cost 1.5), but
    # four accepted probes (α₁ 0.65) would draft depth 3 at 1.27x: worth 0.3⁴ · 0.21 =
    # 0.0017 of a step, less than the probes lose every 16 steps (0.0125; a measured
    # upkeep of 0 made this row probe for ever), more than every 256 (0.00078)
    dear = VerifyCost(jump=0.5).validated()
    rule = Rule(jnp.float32(0.0), jnp.bool_(True), dear, jnp.full((3,), 0.3, jnp.float32))
    assert not policy.may_draft(NGram(k=3), rule, 1)
    sparse = rule.replace(probe_gap=jnp.int32(256))
    assert policy.may_draft(NGram(k=3), sparse, 1)
    assert policy.may_draft(NGram(k=3), sparse.replace(idle=jnp.float32(0.0005)), 1)
    assert not policy.may_draft(NGram(k=3), sparse.replace(idle=jnp.float32(0.001)), 1)
    # a row that drafts at once does not need probes
    sure = rule.replace(prior=jnp.full((3,), 0.9, jnp.float32), idle=jnp.float32(1.0))
    assert policy.may_draft(NGram(k=3), sure, 1)
    kw = dict(max_new_tokens=12, ignore_eos=True, speculator=NGram(k=3),
              acceptance_prior=[0.0] * 3, verify_cost=VerifyCost())
    probing = specjax.generate(tiny_target, PROMPTS, **kw)
    idle = specjax.generate(tiny_target, PROMPTS, **kw, idle_overhead=0.5)
    assert probing.stats.speculative_calls == 1 and idle.stats.speculative_calls == 0
    assert idle.tokens == [g[:12] for g in greedy_ref]
    for name, bad in (("idle_overhead", -0.1), ("idle_overhead", float("inf")),
                      ("probe_gap", 0), ("probe_gap", 2.5), ("probe_gap", True)):
        with pytest.raises(ValueError, match=f"{name}="):
            specjax.generate(tiny_target, PROMPTS[:1], **kw, **{name: bad})


def test_the_idle_pass_drafts_nothing_in_the_speculative_loop(tiny_target, tiny_draft,
                                                               greedy_ref):
    """calibrate.idle_kwargs: every row at k = 0, no probe due within the call, and not
    settled, so the speculative loop runs with the speculator's upkeep (its commits and
    queue calls) and the output stays the target's; the first probe waits `probe_gap`
    steps, the gap doubling from there."""
    import jax.numpy as jnp

    from specjax.calibrate import idle_kwargs, idle_overhead
    from specjax.decoding.policy import probe_schedule

    for spec in (NGram(k=3), DraftModel.create(tiny_draft, k=3)):
        out = specjax.generate(tiny_target, PROMPTS, max_new_tokens=16, ignore_eos=True,
                               **idle_kwargs(spec, 16))
        assert out.tokens == greedy_ref, type(spec).__name__
        assert out.stats.speculative_calls == 1 and out.stats.drafted == 0
    probed = specjax.generate(tiny_target, PROMPTS, max_new_tokens=16, ignore_eos=True,
                              **dict(idle_kwargs(DraftModel.create(tiny_draft, k=3), 16),
                                     probe_gap=4))
    assert probed.stats.drafted > 0  # probes from step 3 on
    nxt, gap = probe_schedule(jnp.asarray([39]), jnp.asarray([40]), 39, jnp.asarray([True]),
                              jnp.asarray([True]), jnp.asarray([0]), 40)
    assert (int(nxt[0]), int(gap[0])) == (159, 80)
    _, gap = probe_schedule(nxt, gap, 159, jnp.asarray([True]), jnp.asarray([True]),
                            jnp.asarray([1]), 40)
    assert int(gap[0]) == 40  # an accepted probe resets the gap to the base
    assert idle_overhead(2.2, 20, 0.1) == pytest.approx(0.1)
    # a loop timed no dearer than plain steps (or not at all) reads as the least upkeep
    assert idle_overhead(1.8, 20, 0.1) == MIN_IDLE == idle_overhead(1.0, 0, 0.1) == 0.01


def test_the_least_calibrated_upkeep_keeps_a_probe_in_the_noise_plain(tiny_target):
    """With the least upkeep calibration reports (`MIN_IDLE`) rather than a noisy 0, a
    peeking n-gram whose first drafts are rarely accepted (the docstring prompts' T = 1
    corpus n-gram of docs/benchmarks.md: α₁ 0.21, a draft at 54 % of steps) runs plain
    decoding's programs: its probes were worth less than 0.001 of a step. Priced with
    the batch-1 verify table of the host that measured those priors (pinned: the
    default table is re-measured per host)."""
    from specjax.decoding.generate import expected_gain

    spec = NGram(k=4).with_corpus([[1, 2, 3, 4, 5]])
    kw = dict(acceptance_prior=[0.21, 0.12, 1.0, 0.67], proposal_prior=0.54,
              step_overhead=[0.054, 0.038, 0.022, 0.005], cost_ratio=0.0,
              verify_cost=VerifyCost.from_table({1: 1.0, 2: 1.14, 3: 1.18, 5: 1.35, 9: 1.58,
                                                 17: 2.32, 33: 4.67}))
    out = {idle: specjax.generate(tiny_target, PROMPTS[:1], max_new_tokens=4, speculator=spec,
                                  idle_overhead=idle, **kw) for idle in (0.0, MIN_IDLE)}
    assert out[0.0].stats.speculative_calls == 1 and out[MIN_IDLE].stats.speculative_calls == 0
    assert expected_gain(tiny_target, spec, idle_overhead=MIN_IDLE, **kw) == 1.0


def test_the_choice_to_draft_holds_at_the_priors_lower_confidence_bound(tiny_target):
    """A call runs the speculative loop only where drafting pays at the prior's lower
    confidence bound (`policy.cautious_prior`: the Wilson score bound from the tries the
    calibration measured it from, one standard error down): α₁ 0.2 expects 8 % here, over
    the 5 % margin. From 100 tries its bound is 0.163 and the call runs plain decoding's
    programs; from 1,000 (bound 0.188), or with its tries unknown, the call drafts. Tokens
    are the same either way."""
    import math

    import numpy as np

    from specjax.calibrate import Calibration
    from specjax.decoding.generate import expected_gain
    from specjax.decoding.policy import CALL_CONFIDENCE_Z, cautious_prior

    spec = NGram(k=4).with_corpus([[1, 2, 3, 4, 5]])
    kw = dict(acceptance_prior=[0.2, 0.39, 0.67, 0.25], proposal_prior=0.5,
              step_overhead=[0.0, 0.018, 0.035, 0.052], idle_overhead=0.03, cost_ratio=0.0,
              verify_cost=VerifyCost(jump=0.08))
    assert expected_gain(tiny_target, spec, **kw) == pytest.approx(1.084, abs=1e-3)
    # the gain is priced at the prior itself, however few its tries
    assert expected_gain(tiny_target, spec, prior_tries=[100] * 4, **kw) == \
        expected_gain(tiny_target, spec, **kw)
    out = {n: specjax.generate(tiny_target, PROMPTS[:1], max_new_tokens=8, speculator=spec,
                               prior_tries=n, **kw) for n in (None, (100,) * 4, (1000,) * 4)}
    assert [o.stats.speculative_calls for o in out.values()] == [1, 0, 1]
    assert out[None].tokens == out[(100,) * 4].tokens == out[(1000,) * 4].tokens
    # a calibration hands its tries to generate with the rest
    cal = Calibration(prior=kw["acceptance_prior"], tries=[100, 40, 20, 4])
    assert cal.generate_kwargs()["prior_tries"] == [100, 40, 20, 4]

    def wilson(p, n, z=CALL_CONFIDENCE_Z):  # the score interval's lower end, by hand
        return (p + z * z / (2 * n) - z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))) / (
            1 + z * z / n)

    low = np.asarray(cautious_prior(np.asarray([0.2, 0.3, 1.0, 0.0, np.nan], np.float32),
                                    np.asarray([100, 1000, 50, 50, 50], np.float32)))
    assert low[:4] == pytest.approx([wilson(0.2, 100), wilson(0.3, 1000), wilson(1.0, 50), 0.0],
                                    abs=1e-6)
    assert low[0] == pytest.approx(0.1631, abs=1e-4) and np.isnan(low[4])
    # unknown tries (NaN, 0) keep the prior as given
    kept = np.asarray(cautious_prior(np.asarray([0.2, 0.3], np.float32),
                                     np.asarray([np.nan, 0.0], np.float32)))
    assert kept == pytest.approx([0.2, 0.3])
    for bad in ([-1], [1, 2, 3, 4, 5], 100, ["x"]):
        with pytest.raises(ValueError, match="prior_tries="):
            specjax.generate(tiny_target, PROMPTS[:1], max_new_tokens=2, speculator=spec,
                             prior_tries=bad)


def test_calibrated_tries_count_the_calls_disagreement():
    """`effective_tries`: the pooled tries where the calls agree as independent tries
    would; fewer where they disagree, by the ratio estimator's variance between calls
    (here 50 tries each at 0.1 and 0.5: α 0.3 from 100 tries, worth 2.6 tries); None at a
    depth never tried; all of them where α is 0 or 1 (no spread to measure)."""
    import numpy as np

    from specjax.calibrate import effective_tries
    from specjax.stats import build_stats

    def call(hist, tried):
        one = np.ones(1, np.int64)
        return build_stats(new_tokens=9 * one, target_calls=4 * one, draft_calls=0 * one,
                           drafted=one, accepted=one, cost_ratio=0.0, verify_cost=None,
                           hist=np.asarray([hist]), tried=np.asarray(tried), ttft_s=0.0,
                           decode_s=1.0, compile_s=0.0)

    # hist: steps that accepted exactly 0, 1, 2 drafts; tried: depths 1 and 2
    same = [call([35, 10, 5], [50, 15]), call([35, 10, 5], [50, 15])]
    assert effective_tries(same) == [100.0, 30.0]
    apart = [call([45, 5, 0], [50, 5]), call([25, 25, 0], [50, 25])]
    var = 2 * ((5 - 0.3 * 50) ** 2 + (25 - 0.3 * 50) ** 2) / 100 ** 2
    assert effective_tries(apart)[0] == pytest.approx(0.3 * 0.7 / var)
    assert effective_tries(apart)[1] == 30.0  # depth 2 never accepted: α 0
    assert effective_tries([call([50, 0, 0], [50, 0])]) == [50.0, None]

# The deferred commit (write-kept) is the CPU default, which every other greedy test
# here runs; a chain written and compacted also runs, at the pages' edge, in
# test_pages_take_the_draft_slack_only_where_the_tree_is_written: the default run keeps
# the tree written and compacted, -m slow the rest of the cross
@pytest.mark.parametrize("kv_commit,kind", [
    ("compact", "tree"), pytest.param("compact", "chain", marks=pytest.mark.slow),
    pytest.param("write-kept", "tree", marks=pytest.mark.slow),
    pytest.param("write-kept", "chain", marks=pytest.mark.slow)])
def test_both_kv_commit_paths_are_lossless(kv_commit, kind):
    """The verify forward either defers its cache write (the reference attention
    off-mesh: commit writes the kept tokens) or writes the tree and compacts it (Pallas,
    meshes); both give target-only greedy decoding (checked against cache-free full
    forwards), on a tree and on a chain."""
    from specjax.decoding import commit
    from specjax.speculators import Medusa
    from tests.conftest import greedy_reference

    target = _attention_sensitive_target()
    want = [greedy_reference(target, p, 24) for p in PROMPTS]
    spec = (Medusa.random(target, num_heads=4, seed=0) if kind == "tree"
            else DraftModel.create(target, k=4))
    assert commit.default_commit(None) is commit.WRITE_KEPT  # CPU default: deferred
    out = specjax.generate(target, PROMPTS, max_new_tokens=24, ignore_eos=True,
                           speculator=spec, adaptive=False, kv_commit=kv_commit)
    assert out.tokens == want


def test_pages_take_the_draft_slack_only_where_the_tree_is_written(monkeypatch):
    """The page table takes a draft tree's slack only where the verify forward writes the
    tree (compact), so a speculative program's plain steps attend over what plain
    decoding's do, and generate prices its first step at that table; at the edge (prompt
    + new + 1 = 64, the slack past it) a chain written there stays lossless with drafts
    accepted up to the last token of the budget."""
    from specjax.decoding import generate as generate_module
    from specjax.decoding.generate import _Sizes
    from tests.conftest import greedy_reference

    target = _attention_sensitive_target()
    spec = DraftModel.create(target, k=4)  # the target drafting for itself: all accepted
    prompt, new = [3, 4, 5, 3, 4, 5, 3, 4], 55

    def pages(speculator, tree_in_cache):
        sizes = _Sizes.of([len(prompt)], new, speculator, 256, 16, None, None,
                          tree_in_cache=tree_in_cache)
        return sizes.table.shape[1], sizes.width

    assert pages(None, False) == (4, 64)
    assert pages(spec, False) == (4, 128)  # the token buffer keeps its slack
    assert pages(spec, True) == (8, 128)
    # the chain at the edge, written into the slack (compact); the deferred commit and a
    # tree there: test_both_commit_paths_stay_lossless_at_the_pages_edge (slow)
    out = specjax.generate(target, [prompt], max_new_tokens=new, ignore_eos=True,
                           speculator=spec, adaptive=False, kv_commit="compact")
    assert out.tokens == [greedy_reference(target, prompt, new)]
    # the first step's price: the CPU attention kernel reads the prompt (head dim 64 and
    # float32 or int8 pages, ones it takes); without it the jnp reference attention reads
    # the whole table, slack included, and so it does for pages the kernel does not take
    # (head dim 16)
    seen = []

    def priced(spec, rule, batch, context):  # records the price, then stops generate
        seen.append(int(context))
        raise StopIteration

    monkeypatch.setattr(generate_module, "may_draft", priced)
    wide = specjax.init_model(tiny_llama(vocab_size=128, hidden_size=128, num_heads=2), seed=3)
    assert wide.config.head_dim == 64 and target.config.head_dim == 16

    def price(model, kernel, kv_commit, **kw):
        monkeypatch.setenv(cpu_attention.ENV, kernel)
        with pytest.raises(StopIteration):
            specjax.generate(model, [prompt], max_new_tokens=new, ignore_eos=True,
                             speculator=DraftModel.create(model, k=4), kv_commit=kv_commit,
                             attention_backend="reference", **kw)
        return seen[-1]

    assert [price(wide, k, c) for k in ("on", "off") for c in ("write-kept", "compact")] == [
        len(prompt), len(prompt), 4 * 16, 8 * 16]
    assert price(wide, "on", "write-kept", kv_cache_dtype="int8") == len(prompt)
    assert price(wide, "off", "write-kept", kv_cache_dtype="int8") == 4 * 16
    assert price(target, "on", "write-kept") == 4 * 16
    from specjax.attention import reads_used_slots
    assert reads_used_slots("reference", 64, "float32")
    assert reads_used_slots("reference", 64, "bfloat16")
    assert not reads_used_slots("reference", 96, "float32")
    assert not reads_used_slots("reference", 64, "float16")


def test_speculators_own_caches_take_the_kv_dtype():
    """`kv_cache_dtype` sets the draft model's and the EAGLE head's own caches too (vLLM's
    engine-wide setting): their `init` with an int8 `kv_dtype` builds an int8 cache."""
    import jax.numpy as jnp

    from specjax.speculators import Eagle

    target = _attention_sensitive_target()
    for spec in (DraftModel.create(target, k=4),
                 Eagle.random(target, top_k=2, depth=3, total_tokens=6)):
        state = spec.init(target.config, 2, 64, kv_dtype=jnp.dtype(jnp.int8))
        assert state.cache.quantized and state.cache.k_pages.dtype == jnp.int8
        assert not spec.init(target.config, 2, 64).cache.quantized


@pytest.mark.slow
def test_both_commit_paths_stay_lossless_at_the_pages_edge():
    """The edge of test_pages_take_the_draft_slack_only_where_the_tree_is_written (prompt
    + new + 1 = 64): the chain, all accepted, through the deferred commit, and Medusa's
    tree written into the slack."""
    from specjax.speculators import Medusa
    from tests.conftest import greedy_reference

    target = _attention_sensitive_target()
    prompt, new = [3, 4, 5, 3, 4, 5, 3, 4], 55
    want = greedy_reference(target, prompt, new)
    for s, kv_commit in ((DraftModel.create(target, k=4), "write-kept"),
                         (Medusa.random(target, num_heads=4, seed=0), "compact")):
        out = specjax.generate(target, [prompt], max_new_tokens=new, ignore_eos=True,
                               speculator=s, adaptive=False, kv_commit=kv_commit)
        assert out.tokens == [want], (kv_commit, type(s).__name__)


# By default int8 speculation runs in tests/sharding_cases.py (Medusa's tree written and
# compacted, its scales moved per shard) and tests/test_bench_suite.py (the draft's chain
# through the CPU's deferred commit), both lossless against the int8 target
@pytest.mark.slow
def test_int8_cache_speculation_is_lossless_against_the_int8_target(monkeypatch):
    """With an int8 KV cache, greedy speculative output equals target-only greedy decoding
    over the same int8 cache, through both commit paths: a tree written and compacted
    (its keys' scales moved with them), and one verified with its keys kept out of the
    cache (seen fake-quantized, then written; tests/test_kv_quant.py checks that step's
    logits). `generate` hands `kv_cache_dtype` to the draft's and the EAGLE head's
    `init`, and the target as its own draft, both over int8, accepts every draft."""
    import jax.numpy as jnp

    from specjax.decoding.generate import PROGRAMS
    from specjax.speculators import Eagle, Medusa

    target = _attention_sensitive_target()
    medusa = Medusa.random(target, num_heads=4, seed=0)
    eagle = Eagle.random(target, top_k=2, depth=3, total_tokens=6)
    asked = []
    for cls in (DraftModel, Eagle):
        def spy(self, *args, _init=cls.init, **kwargs):
            asked.append((type(self).__name__, kwargs.get("kv_dtype")))
            return _init(self, *args, **kwargs)
        monkeypatch.setattr(cls, "init", spy)
    kw = dict(max_new_tokens=16, ignore_eos=True, kv_cache_dtype="int8")
    want = specjax.generate(target, PROMPTS, **kw).tokens
    PROGRAMS.clear()  # so that every run traces its speculators' `init` again
    jax.clear_caches()
    # each commit path once over int8 for a tree (Medusa, EAGLE) and for the chain;
    # test_both_kv_commit_paths_are_lossless crosses every path with both at float32
    runs = {type(spec).__name__: specjax.generate(target, PROMPTS, speculator=spec,
                                                  adaptive=False, kv_commit=kv_commit, **kw)
            for spec, kv_commit in ((medusa, "compact"),
                                    (DraftModel.create(target, k=4), "write-kept"),
                                    (eagle, "compact"))}
    for name, out in runs.items():
        assert out.tokens == want, name
    assert runs["Medusa"].stats.acceptance_rate > 0.3  # drafts were kept
    assert runs["DraftModel"].stats.acceptance_rate == 1.0
    assert asked == [("DraftModel", jnp.int8), ("Eagle", jnp.int8)], asked
    PROGRAMS.clear()
    jax.clear_caches()


def test_expected_speedup_uses_acceptance_per_position():
    """All-or-nothing acceptance (half the steps accept all 4 drafts, half none): α is
    0.5 either way, but per position E[tokens] = 1 + 2 = 3, which the i.i.d. closed form
    undercounts ((1 - 0.5^5) / 0.5 = 1.94)."""
    from specjax.stats import build_stats

    c, v = 0.05, 1.8
    stats = build_stats(new_tokens=[31], target_calls=[10], draft_calls=[40], drafted=[40],
                        accepted=[20], hist=[[5, 0, 0, 0, 5]], cost_ratio=c, ttft_s=0.1,
                        decode_s=1.0, compile_s=0.0, verify_cost=[10 * v])
    assert stats.acceptance_rate == 0.5 and stats.mean_k == 4.0
    assert stats.expected_speedup == pytest.approx(3.0 / (4 * c + v))
    assert stats.expected_speedup_iid == pytest.approx((1 - 0.5 ** 5) / 0.5 / (4 * c + v))
    assert stats.expected_speedup_free_verify == pytest.approx(3.0 / (4 * c + 1))
    assert stats.rows[0]["expected_speedup"] == pytest.approx(stats.expected_speedup)
    # c is per draft call: heads that draft all 4 positions in one call per step
    heads = build_stats(new_tokens=[31], target_calls=[10], draft_calls=[10], drafted=[40],
                        accepted=[20], hist=[[5, 0, 0, 0, 5]], cost_ratio=c, ttft_s=0.1,
                        decode_s=1.0, compile_s=0.0, verify_cost=[10 * v])
    assert heads.expected_speedup == pytest.approx(3.0 / (c + v))


def test_batch_expected_speedup_waits_for_its_last_row():
    """At batch > 1 the loop runs until its last row finishes: the analytical figure is
    plain decoding's steps over the longest-running row's modelled cost, not the mean
    row's tokens per cost; merged calls add up their steps and costs."""
    from specjax.stats import build_stats, merge_stats

    c = 0.05
    stats = build_stats(new_tokens=[64, 64], target_calls=[8, 24], draft_calls=[64, 192],
                        drafted=[64, 192], accepted=[55, 39], hist=[[0] * 9, [0] * 9],
                        cost_ratio=c, ttft_s=0.1, decode_s=1.0, compile_s=0.0,
                        verify_cost=[16.0, 48.0])
    assert stats.expected_speedup == pytest.approx(63 / (48 + 192 * c))
    assert stats.rows[0]["expected_speedup"] == pytest.approx(63 / 8 / (8 * c + 2))
    single = build_stats(new_tokens=[64], target_calls=[8], draft_calls=[64], drafted=[64],
                         accepted=[55], hist=[[0] * 9], cost_ratio=c, ttft_s=0.1,
                         decode_s=1.0, compile_s=0.0, verify_cost=[16.0])
    merged = merge_stats([stats, single])
    assert merged.expected_speedup == pytest.approx((63 + 63) / (48 + 192 * c + 16 + 64 * c))


def test_rule_prices_draft_calls_not_positions():
    """Medusa's heads cost one call whatever the depth, a chain draft one per position:
    at the same c, acceptance and verify cost, deep drafting pays for the one and not
    the other."""
    import jax.numpy as jnp
    import numpy as np

    from specjax.decoding.policy import leviathan_optimal_k

    alpha = jnp.asarray([[0.8, 0.8, 0.8, 0.8]])
    v = np.asarray([1.0, 1.6, 1.7, 1.8, 1.8])
    c = 0.4
    assert int(leviathan_optimal_k(alpha, c, 4, v)[0]) == 0  # k = 4: 3.36 / 3.4
    one_call = np.asarray([0, 1, 1, 1, 1])
    assert int(leviathan_optimal_k(alpha, c, 4, v, one_call)[0]) == 4  # 3.36 / 2.2


def test_probes_back_off_while_rejected():
    """Rows the adaptive rule keeps at k = 0 probe with k = 1 at step 15, then at least a
    gap later, the gap doubling per rejected probe (capped) and resetting when a draft is
    accepted, always on a clock that rows of a batch share."""
    import jax.numpy as jnp
    import numpy as np

    from specjax.decoding.policy import PROBE_GAP, PROBE_GAP_MAX, probe_schedule

    def run(accept_at, steps=800):
        nxt, gap, probes = jnp.asarray([PROBE_GAP - 1]), jnp.asarray([PROBE_GAP]), []
        for step in range(steps):
            probed = step >= int(nxt[0])
            acc = jnp.asarray([int(probed and step in accept_at)])
            if probed:
                probes.append(step)
            nxt, gap = probe_schedule(nxt, gap, step, jnp.asarray([probed]),
                                      jnp.asarray([probed]), acc)
        return probes

    # gap 32 after step 15: the first step from 47 on the 32-step clock is 63
    assert run(accept_at=set())[:6] == [15, 63, 127, 255, 511, 511 + PROBE_GAP_MAX]
    always = run(accept_at=set(range(800)))
    assert np.all(np.diff(always) == PROBE_GAP)  # accepted probes keep the short gap
    reset = run(accept_at={127})
    assert reset[:5] == [15, 63, 127, 127 + PROBE_GAP, 127 + 4 * PROBE_GAP]
    # every probe falls on the shared clock, so rows of a batch probe together
    assert all((t + 1) % PROBE_GAP == 0 for t in always + reset)


def test_a_step_with_every_row_finished_runs_no_forward(tiny_target):
    """When every row finished inside the plain-step loop, the speculative step that
    follows in the same iteration takes its `idle` branch: no target forward (its kept
    keys/values are zeros), the cache untouched; with a row active, a real forward."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax.decoding import commit
    from specjax.decoding.cost import VerifyCost
    from specjax.decoding.loop import DecodeLoop
    from specjax.decoding.policy import Rule
    from specjax.inspect import params_for, prefilled_state

    spec = NGram(k=3)
    state, sampling = prefilled_state(tiny_target, PROMPTS[0], spec)
    rule = Rule(jnp.float32(0.0), jnp.bool_(True), VerifyCost(),
                jnp.full((spec.shape.max_depth,), jnp.nan, jnp.float32))
    loop = DecodeLoop.create(tiny_target.config, spec)
    run = jax.jit(lambda st: loop.speculate(
        params_for(tiny_target.params, spec, sampling, rule), st))
    assert loop.commit is commit.WRITE_KEPT  # the reference backend: kept K/V come out
    live = run(state)
    assert np.any(np.asarray(live.kept_kv[0]) != 0)
    done = run(state.replace(done=jnp.ones_like(state.done)))
    assert int(done.width) == 0
    assert not np.any(np.asarray(done.kept_kv[0])) and not np.any(np.asarray(done.kept_kv[1]))


def test_acceptance_prior_starts_the_rule_where_calibration_left_it(tiny_target, greedy_ref):
    """The target as its own draft (α = 1) under a verify cost where depth 4 pays only
    if α is near 1: from the default prior (0.75) the rule never drafts within 16
    tokens; from a calibrated prior of 1.0 it drafts full depth from the first step.
    A prior of 0 keeps n-gram from drafting at all. Output is greedy's either way."""
    spec = DraftModel.create(tiny_target, k=4)
    # batch 1 (a batch's plain step has T = rows > 1 too): v(T > 1) = 4, so depth 4
    # pays at E = 5 tokens, not at the default prior's 3.05
    kw = dict(max_new_tokens=16, ignore_eos=True, cost_ratio=0.0,
              verify_cost=VerifyCost(jump=3.0))
    default = specjax.generate(tiny_target, PROMPTS[:1], speculator=spec, **kw)
    sure = specjax.generate(tiny_target, PROMPTS[:1], speculator=spec, **kw,
                            acceptance_prior=[1.0] * 4)
    assert default.tokens == greedy_ref[:1] and sure.tokens == greedy_ref[:1]
    assert default.stats.drafted == 0
    assert sure.stats.acceptance_rate == 1.0 and sure.stats.mean_accepted_length > 3.5
    assert sure.stats.acceptance_by_position == [1.0] * 4
    assert sure.stats.tried_hist == [sure.stats.target_calls] * 4
    off = specjax.generate(tiny_target, PROMPTS, speculator=NGram(k=4), max_new_tokens=16,
                           ignore_eos=True, acceptance_prior=[0.0, None])
    assert off.tokens == greedy_ref and off.stats.drafted == 0
    assert off.stats.acceptance_by_position == [None] * 4
    for bad in ([1.5], [0.5] * 5, ["x"]):
        with pytest.raises(ValueError, match="acceptance_prior="):
            specjax.generate(tiny_target, PROMPTS, max_new_tokens=4, speculator=spec,
                             acceptance_prior=bad)


def test_step_overhead_prices_the_speculative_step(tiny_target, greedy_ref):
    """generate(step_overhead=) adds its cost to every speculative step: the target as
    its own draft (α = 1, prior 1.0) drafts full depth when a step is free beyond its
    forward, and not at all when each step costs 10 plain steps more (5 tokens for 11
    steps); the analytical figure counts it (v rises by exactly the overhead), greedy
    output never changes, and a bad value is refused by name."""
    spec = DraftModel.create(tiny_target, k=4)
    kw = dict(max_new_tokens=16, ignore_eos=True, cost_ratio=0.0, verify_cost=VerifyCost(),
              acceptance_prior=[1.0] * 4, speculator=spec)
    free = specjax.generate(tiny_target, PROMPTS[:1], **kw)
    dear = specjax.generate(tiny_target, PROMPTS[:1], **kw, step_overhead=10.0)
    assert free.tokens == greedy_ref[:1] and dear.tokens == greedy_ref[:1]
    assert free.stats.mean_accepted_length > 3.5 and dear.stats.drafted == 0
    full = dict(kw, adaptive=False)
    base = specjax.generate(tiny_target, PROMPTS[:1], **full).stats
    more = specjax.generate(tiny_target, PROMPTS[:1], **full, step_overhead=0.5).stats
    assert more.verify_cost == pytest.approx(base.verify_cost + 0.5)
    assert more.expected_speedup < base.expected_speedup
    # per depth: a one-level step free beyond its forward, deeper ones dear: depth 1 only
    shallow = specjax.generate(tiny_target, PROMPTS[:1], **kw,
                               step_overhead=[0.0, 10.0, 10.0, 10.0])
    assert shallow.tokens == greedy_ref[:1] and shallow.stats.drafted > 0
    assert sum(shallow.stats.accepted_hist[2:]) == 0 and shallow.stats.accepted_hist[1] > 0
    for bad in (-1.0, float("nan"), "x", True, [0.1, 0.2], [0.1, 0.2, 0.3, -1.0]):
        with pytest.raises(ValueError, match="step_overhead="):
            specjax.generate(tiny_target, PROMPTS[:1], **kw, step_overhead=bad)


def test_the_default_verify_cost_follows_the_matmuls_the_model_runs(tiny_target, monkeypatch):
    """On CPU the default verify-cost table is the one measured with the matmul the
    model's decode step runs: the transposed-weight kernel's, the [I, O] kernel's, or
    XLA's (a bf16 model, or a host where neither kernel won its race); generate prices a
    speculative call with the table for its model."""
    import dataclasses

    from specjax import rows_matmul
    from specjax.decoding import generate as generate_module
    from specjax.decoding.cost import VERIFY_COST, default_verify_cost

    cfg = tiny_target.config
    assert len({id(VERIFY_COST[k]) for k in ("cpu", "cpu-rows", "cpu-xla")}) == 3
    assert default_verify_cost() is VERIFY_COST["cpu"]
    assert default_verify_cost(cfg) is VERIFY_COST["cpu"]  # the tests take the kernels
    # bfloat16 weights stream through the transposed kernel too; float16 ones through XLA's
    assert default_verify_cost(dataclasses.replace(cfg, dtype="bfloat16")) is VERIFY_COST["cpu"]
    assert default_verify_cost(dataclasses.replace(cfg, dtype="float16")) is VERIFY_COST[
        "cpu-xla"]
    monkeypatch.setattr(rows_matmul, "kernel_wins", lambda shape: False)
    assert default_verify_cost(cfg) is VERIFY_COST["cpu"]  # the transposed kernel still wins
    monkeypatch.setattr(rows_matmul, "transposed_wins", lambda shape, dtype=None: False)
    assert default_verify_cost(cfg) is VERIFY_COST["cpu-xla"]
    monkeypatch.setattr(rows_matmul, "kernel_wins", lambda shape: True)
    assert default_verify_cost(cfg) is VERIFY_COST["cpu-rows"]
    asked = []

    def spy(config=None):
        asked.append(config)
        return default_verify_cost(config)

    monkeypatch.setattr(generate_module, "default_verify_cost", spy)
    # the call test_greedy_is_lossless makes at batch 1 (the module's compiled programs)
    specjax.generate(tiny_target, PROMPTS[1:2], max_new_tokens=16, ignore_eos=True,
                     speculator=NGram(k=4))
    assert asked == [cfg]


def test_step_overhead_is_the_measured_step_less_the_modelled_one():
    """calibrate.step_overhead: 10 full-depth calls of 2 draft calls at c = 0.1 and a
    modelled verify of 1.2 steps (1.4 in all) that took 16 plain steps' time leave 0.2
    steps unmodelled; a faster-than-modelled step leaves 0, never less."""
    import numpy as np

    from specjax.calibrate import step_overhead
    from specjax.stats import build_stats

    ones = np.ones(1, np.int64)
    full = build_stats(new_tokens=31 * ones, target_calls=10 * ones, draft_calls=20 * ones,
                       drafted=30 * ones, accepted=20 * ones, hist=np.zeros((1, 4), np.int64),
                       cost_ratio=0.1, ttft_s=0.0, decode_s=1.6, compile_s=0.0,
                       verify_cost=np.asarray([12.0]))
    assert step_overhead(full, 1.6, 0.1) == pytest.approx(0.2)
    assert step_overhead(full, 1.0, 0.1) == 0.0
    assert step_overhead(full, 1.6, 0.0) == 0.0
    # charged to the 2 steps of the 10 that drafted: 2 steps' excess over 10, 1.0 each;
    # less 0.05 for each of the 8 that did not: (2 - 0.4) / 2
    assert step_overhead(full, 1.6, 0.1, drafting=2) == pytest.approx(1.0)
    assert step_overhead(full, 1.6, 0.1, drafting=2, empty=0.05) == pytest.approx(0.8)
    assert step_overhead(full, 1.6, 0.1, drafting=2, empty=0.5) == 0.0
    assert step_overhead(full, 1.6, 0.1, drafting=0) == 0.0


def test_a_peeking_speculator_s_overhead_is_its_drafting_steps():
    """At batch 1 a speculator that peeks runs plain steps where it has no draft, so the
    calibration charges a pass's excess to the steps that drafted (tried depth 1);
    elsewhere, and for one that cannot peek, to every loop step."""
    import numpy as np

    from specjax.calibrate import drafting_steps
    from specjax.stats import build_stats

    ones = np.ones(1, np.int64)
    full = build_stats(new_tokens=31 * ones, target_calls=10 * ones, draft_calls=0 * ones,
                       drafted=12 * ones, accepted=6 * ones, hist=np.zeros((1, 5), np.int64),
                       tried=np.asarray([[3, 2, 2, 1]]), cost_ratio=0.0, ttft_s=0.0,
                       decode_s=1.6, compile_s=0.0, verify_cost=np.asarray([12.0]))
    assert drafting_steps(full, NGram(k=4), 1) == 3
    assert drafting_steps(full, NGram(k=4), 4) is None
    assert drafting_steps(full, NGram(k=4, peek=False), 1) is None


def _pass_kind(speculator, kw) -> str:
    """Which of `calibrations`' passes a generate call is, from its arguments."""
    if speculator is None:
        return "plain"
    if not kw.get("adaptive", True):
        return "full"
    return "shallow" if kw["acceptance_prior"][0] == 1.0 else "idle"


def test_calibration_times_warm_programs(monkeypatch):
    """calibrations runs every pass once untimed: a program's first run after compiling
    (here 1 s slower) would otherwise move the step overhead. Timed warm: 16 plain steps
    in 1.6 s; 10 full-depth steps of 2 draft calls at c = 0.1 and a 1.2-step verify in
    2 s leave 0.6 steps unmodelled (the first runs would give 0.45). A program is keyed
    by the call's shapes, so the warm-up runs the first call of each shape: here the
    two one-row calls of 2 tokens share a warm-up and the 3-token call has its own.
    The depth-1 pass ran 10 steps of one draft call and a 1.2-step verify in 1.8 s: 0.5
    unmodelled, so the overhead per depth runs 0.5 to 0.6. The idle pass (every row at
    k = 0, no probe due) ran its 16 steps in 1.76 s: 0.1 of a plain step more each."""
    import numpy as np

    import specjax.decoding.generate as generate_mod
    from specjax.calibrate import calibrations, warmup_calls
    from specjax.stats import build_stats

    assert warmup_calls([[[1, 2]], [[3, 4]], [[5, 6, 7]], [[8, 9, 1]]]) == [
        (0, [[1, 2]]), (2, [[5, 6, 7]])]
    assert warmup_calls([[[1], [2, 3]], [[4, 5], [6]]]) == [(0, [[1], [2, 3]]),
                                                             (1, [[4, 5], [6]])]
    ones, seen, ran = np.ones(1, np.int64), set(), []
    spec = NGram(k=4, peek=False)  # its overhead over every step

    def fake_generate(target, prompts, *, speculator=None, seed=0, **kw):
        kind = _pass_kind(speculator, kw)
        ran.append((seed, kind))
        key = (tuple(map(len, prompts)), kind)
        cold = 1.0 if key not in seen else 0.0
        seen.add(key)
        if kind in ("plain", "idle"):
            counts = dict(target_calls=16 * ones, draft_calls=0 * ones, drafted=0 * ones,
                          accepted=0 * ones, cost_ratio=0.0, verify_cost=None)
        elif kind == "shallow":
            counts = dict(target_calls=10 * ones, draft_calls=10 * ones, drafted=10 * ones,
                          accepted=6 * ones, cost_ratio=0.1, verify_cost=np.asarray([12.0]))
        else:
            counts = dict(target_calls=10 * ones, draft_calls=20 * ones, drafted=30 * ones,
                          accepted=20 * ones, cost_ratio=0.1, verify_cost=np.asarray([12.0]))
        decode = dict(plain=1.6, idle=1.76, shallow=1.8, full=2.0)[kind]
        stats = build_stats(new_tokens=31 * ones, hist=np.zeros((1, 4), np.int64),
                            ttft_s=0.0, decode_s=decode + cold, compile_s=0.0, **counts)
        return SimpleNamespace(stats=stats)

    monkeypatch.setattr(generate_mod, "generate", fake_generate)
    # the fake generate runs nothing; the target's config only picks the default cost model
    # (whose free form the idle pass takes)
    target = SimpleNamespace(config=None)
    out = calibrations(target, {"spec": spec}, [[1, 2], [3, 4], [5, 6, 7]], new_tokens=32)
    assert out[0.0]["spec"].overhead == pytest.approx([0.5, 0.5 + 0.1 / 3, 0.5 + 0.2 / 3,
                                                       0.6])
    assert out[0.0]["spec"].idle == pytest.approx(0.1)
    assert out[0.0]["spec"].generate_kwargs()["idle_overhead"] == pytest.approx(0.1)
    kinds = ("plain", "full", "shallow", "idle")
    passes = lambda *seeds, closing=("plain",): [(s, kind) for s in seeds
                                                 for kind in kinds + closing]
    # warm-up passes (the closing plain pass runs the opening one's program), then timed
    # ones: 5 calls (`MIN_TIMED_CALLS`), the prompts repeated, plain decoding last again
    assert ran == passes(0, 2, closing=()) + passes(0, 1, 2, 3, 4)


@pytest.mark.parametrize("load, slowed", [
    ({0: 1.0, 1: 1.25, 2: 1.5, 3: 1.75, 4: 2.0},
     {(0, "full"): 2.0, (1, "full"): 2.0, (4, "plain"): 3.0}),
    ({i: 1.0 for i in range(5)},
     {(0, "plain"): 0.65, (2, "plain"): 0.65, (1, "full"): 1.5, (3, "full"): 1.5}),
    ({i: 1.0 for i in range(5)},
     {(0, "plain"): 0.65, (1, "plain"): 0.7, (3, "plain"): 0.65, (2, "full"): 1.5}),
], ids=["load-rising", "plain-sped-up", "three-openings-sped-up"])
def test_calibration_prices_each_pass_against_its_calls_fitted_plain_step(monkeypatch, load,
                                                                           slowed):
    """Each call's passes are priced against that call's plain step as fitted from all its
    passes (`calibrate.fitted_plain_steps`), and the median over the 5 calls counts.
    Quiet, 16 plain steps take 1.6 s and 10 full-depth steps 2 s, 0.6 unmodelled past 2
    draft calls at c = 0.1 and a 1.2-step verify. load-rising: the host's load rises
    across the calls (every pass of call i at 1 + i / 4 times its time) and the
    full-depth passes of calls 0 and 1 are slowed twice more; the fastest of each pass
    would compare call 0's plain pass with call 2's full-depth one and read 1.6, and call
    4's plain pass, slowed 3 times alone, prices none of its call's passes; against the
    median plain step over the calls (1.5 times quiet) the median would read 1.27.
    plain-sped-up: the plain passes of calls 0 and 2 alone run at 0.65 of their time and
    the full-depth passes of calls 1 and 3 are slowed by half; priced against its own
    call's plain pass, each of the four would read 1.6 or more.
    three-openings-sped-up: the plain passes that open calls 0, 1 and 3 run at 0.65-0.7
    of their time, more than a median of the five openings leaves out; the plain passes
    that close the calls count as well. Each calibration keeps what it was priced from:
    per call, every pass's seconds per loop step and the fitted plain step."""
    import numpy as np

    import specjax.decoding.generate as generate_mod
    from specjax.calibrate import calibrations
    from specjax.stats import build_stats

    # load: seed -> the host's factor over the call; slowed: (seed, pass) -> time factor
    ones, spec = np.ones(1, np.int64), NGram(k=4, peek=False)  # its overhead over every step
    plains = []

    def fake_generate(target, prompts, *, speculator=None, seed=0, **kw):
        kind = _pass_kind(speculator, kw)
        if kind == "plain":  # the warm-up's, then each timed call's opening and closing
            plains.append(seed)
            kind = "closing" if len(plains) > 1 and len(plains) % 2 else "plain"
        if kind == "full":
            counts = dict(target_calls=10 * ones, draft_calls=20 * ones, drafted=30 * ones,
                          accepted=20 * ones, cost_ratio=0.1, verify_cost=np.asarray([12.0]))
        else:  # plain, and the depth-1 and idle passes timed as plain steps here
            counts = dict(target_calls=16 * ones, draft_calls=0 * ones, drafted=0 * ones,
                          accepted=0 * ones, cost_ratio=0.0, verify_cost=None)
        decode = dict(plain=1.6, closing=1.6, full=2.0, shallow=1.6, idle=1.76)[kind]
        decode *= load[seed] * slowed.get((seed, kind), 1.0)
        stats = build_stats(new_tokens=31 * ones, hist=np.zeros((1, 4), np.int64),
                            ttft_s=0.0, decode_s=decode, compile_s=0.0, **counts)
        return SimpleNamespace(stats=stats)

    monkeypatch.setattr(generate_mod, "generate", fake_generate)
    cal = calibrations(SimpleNamespace(config=None), {"spec": spec}, [[1], [2], [3]],
                       new_tokens=32)[0.0]["spec"]
    assert cal.overhead[-1] == pytest.approx(0.6) and cal.idle == pytest.approx(0.1)
    assert plains == [0] + [seed for seed in range(5) for _ in "oc"]
    assert cal.timing["fitted"] == pytest.approx([0.1 * load[i] for i in range(5)])
    assert sorted(cal.timing) == ["closing", "fitted", "full", "idle", "plain", "shallow"]
    assert cal.timing["full"] == pytest.approx(
        [0.2 * load[i] * slowed.get((i, "full"), 1.0) for i in range(5)])
    assert cal.timing["plain"] == pytest.approx(
        [0.1 * load[i] * slowed.get((i, "plain"), 1.0) for i in range(5)])


def test_fitted_plain_steps_leave_out_passes_that_ran_no_step():
    """[calls, passes] seconds per loop step, plain first: a pass that ran no step in one
    call (nan) leaves that cell out, one that ran none in any call is no pass, quietly;
    the calls' loads (1, 1.5, 2) come back times the plain step. With no plain step at
    all there is nothing to price against (nan: `priced_median` leaves such calls out)."""
    import warnings

    import numpy as np

    from specjax.calibrate import fitted_plain_steps

    step_s = np.array([[0.1, 0.2, np.nan, 0.11],
                       [0.15, 0.3, np.nan, np.nan],
                       [0.2, 0.4, np.nan, 0.22]])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # numpy's all-nan median warns
        np.testing.assert_allclose(fitted_plain_steps(step_s, plain=1), [0.1, 0.15, 0.2])
        assert np.isnan(fitted_plain_steps(np.full((3, 2), np.nan), plain=1)).all()


def test_calibration_at_a_batch_fills_it_and_times_loop_steps(monkeypatch):
    """At batch 2, three prompts fill two calls (the first repeated; the two calls again
    as the third to fifth timed calls, `MIN_TIMED_CALLS`), and the overhead
    is per loop step, which runs until the call's slowest row: rows of 10 and 6 target
    calls in 2 s are 10 steps of 0.2 s (0.1 s plain), so 2 steps against a modelled 1.2
    verify and 0.2 of draft calls leave 0.6 (per row-call it would read 0.1). The
    proposal rate is the passes' found drafts over asked steps."""
    import numpy as np

    import specjax.decoding.generate as generate_mod
    from specjax.calibrate import calibrations, filled_batches
    from specjax.stats import build_stats

    assert filled_batches([[1], [2], [3]], 2) == [[[1], [2]], [[3], [1]]]
    assert filled_batches([[1]], 4) == [[[1]] * 4] and filled_batches([], 4) == []
    calls, spec = [], NGram(k=4)

    def fake_generate(target, prompts, *, speculator=None, seed=0, **kw):
        if _pass_kind(speculator, kw) != "full":
            speculator = None  # the depth-1 and idle passes: timed as plain steps here
        calls.append((speculator, seed, prompts))
        if speculator is None:
            counts = dict(target_calls=np.asarray([16, 16]), draft_calls=np.zeros(2),
                          drafted=np.zeros(2), accepted=np.zeros(2), cost_ratio=0.0,
                          verify_cost=None)
        else:
            counts = dict(target_calls=np.asarray([10, 6]), draft_calls=np.asarray([20, 12]),
                          drafted=np.asarray([30, 18]), accepted=np.asarray([20, 12]),
                          cost_ratio=0.1, verify_cost=np.asarray([12.0, 7.2]),
                          asked=np.asarray([10, 6]), proposed=np.asarray([8, 4]))
        stats = build_stats(new_tokens=np.asarray([17, 17]), hist=np.zeros((2, 4), np.int64),
                            ttft_s=0.0, decode_s=1.6 if speculator is None else 2.0,
                            compile_s=0.0, **counts)
        return SimpleNamespace(stats=stats)

    monkeypatch.setattr(generate_mod, "generate", fake_generate)
    cal = calibrations(SimpleNamespace(config=None), {"spec": spec}, [[1], [2], [3]],
                       new_tokens=17, batch=2)[0.0]["spec"]
    assert cal.overhead[-1] == pytest.approx(0.6) and cal.proposal == pytest.approx(0.75)
    assert cal.generate_kwargs()["proposal_prior"] == pytest.approx(0.75)
    assert cal.idle == MIN_IDLE  # the idle pass ran as fast as the plain one: the least
    assert [(s, seed) for s, seed, _ in calls[:4]] == [(None, 0), (spec, 0), (None, 0),
                                                        (None, 0)]
    timed = calls[4:]  # after the warm-up passes of the first call (both have one shape)
    # per call: plain, full depth, depth 1, idle (the last two timed as plain here) and
    # plain again, the two calls taking turns
    assert [(s, seed, p) for s, seed, p in timed] == [
        (s, seed, [[[1], [2]], [[3], [1]]][seed % 2]) for seed in range(5)
        for s in (None, spec, None, None, None)]


def test_calibration_times_one_filled_call_five_times(monkeypatch):
    """Four prompts at batch 4 fill one call; each pass is still timed in five calls
    (the call repeated, seeded 0 to 4), so two slowed calls (the first two full-depth ones
    at three times their time) do not become the step's overhead: 16 plain steps in 1.6 s, 10
    full-depth steps in 2 s, 0.6 past 2 draft calls at c = 0.1 and a 1.2-step verify.
    The repeats are the same prompts, so the acceptance's tries are one call's."""
    import numpy as np

    import specjax.decoding.generate as generate_mod
    from specjax.calibrate import calibrations, timed_calls
    from specjax.stats import build_stats

    assert timed_calls([["a"]]) == [["a"]] * 5 and timed_calls([]) == []
    assert timed_calls([["a"], ["b"], ["c"]]) == [["a"], ["b"], ["c"], ["a"], ["b"]]
    assert timed_calls([["a"]] * 6) == [["a"]] * 6
    ones, spec, ran = np.ones(4, np.int64), NGram(k=4), []

    def fake_generate(target, prompts, *, speculator=None, seed=0, **kw):
        kind = _pass_kind(speculator, kw)
        ran.append((seed, kind, len(prompts)))
        if kind == "full":
            counts = dict(target_calls=10 * ones, draft_calls=20 * ones, drafted=30 * ones,
                          accepted=20 * ones, cost_ratio=0.1, verify_cost=12.0 * ones)
        else:  # plain, and the depth-1 and idle passes timed as plain steps here
            counts = dict(target_calls=16 * ones, draft_calls=0 * ones, drafted=0 * ones,
                          accepted=0 * ones, cost_ratio=0.0, verify_cost=None)
        decode = 2.0 if kind == "full" else 1.6
        if kind == "full" and seed < 2 and len(ran) > 4:  # the first two timed full passes
            decode *= 3.0
        # each row: 10 steps, 5 accepting nothing, 3 one draft, 2 two; depth 3 never tried
        hist = np.tile([5, 3, 2, 0], (4, 1)) if kind == "full" else np.zeros((4, 4), np.int64)
        tried = np.tile([10, 5, 0], (4, 1)) if kind == "full" else None
        stats = build_stats(new_tokens=31 * ones, hist=hist, tried=tried,
                            ttft_s=0.0, decode_s=decode, compile_s=0.0, **counts)
        return SimpleNamespace(stats=stats)

    monkeypatch.setattr(generate_mod, "generate", fake_generate)
    cal = calibrations(SimpleNamespace(config=None), {"spec": spec}, [[1], [2], [3], [4]],
                       new_tokens=32, batch=4)[0.0]["spec"]
    assert cal.overhead[-1] == pytest.approx(0.6)
    assert cal.prior[:2] == pytest.approx([0.5, 0.4]) and cal.prior[2] is None
    assert cal.tries == [40.0, 20.0, None]  # one call's 4 rows, not five calls' 20
    kinds = ("plain", "full", "shallow", "idle")
    # the warm-up first, then each call closed by plain decoding again
    assert ran == [(0, kind, 4) for kind in kinds] + [
        (seed, kind, 4) for seed in range(5) for kind in kinds + ("plain",)]


def test_the_batch_rule_counts_the_steps_a_row_finds_no_draft():
    """At batch > 1 a row asked to draft pays the batch's verify whether or not its
    speculator finds a draft. Rows that found one in 4 of 40 asked steps (α 0.8 where
    they did) keep a batch of 4 plain; rows that always found one draft, as does the
    rarely-finding row alone (a step without a draft runs no wider forward), and so
    does the batch when its prior says the speculator always finds one."""
    import jax.numpy as jnp
    import numpy as np

    from specjax.decoding.policy import Rule, decide_from, proposal_rate
    from specjax.decoding.state import Counters

    spec = NGram(k=4)
    rule = Rule(jnp.float32(0.0), jnp.bool_(True), VerifyCost(slope=0.5).validated(),
                jnp.full((4,), 0.8, jnp.float32))
    buckets = ((0, 0), (1, 1), (2, 2), (4, 4))

    def limit(batch, proposed, asked=40, r=rule):
        c = Counters.zeros(batch, 4)
        c = c.replace(asked=jnp.full((batch,), asked, jnp.int32),
                      proposed=jnp.full((batch,), proposed, jnp.int32))
        ones = jnp.ones((batch,), jnp.int32)
        return np.asarray(decide_from(spec, r, buckets, c, ones > 0, 32 * ones, 32).limit)

    assert (limit(4, 40) > 0).all() and (limit(4, 4) == 0).all()
    assert (limit(1, 4) > 0).all()
    assert (limit(4, 4, asked=4, r=rule.replace(proposal=jnp.float32(1.0))) > 0).all()
    assert (limit(4, 0, asked=0, r=rule.replace(proposal=jnp.float32(0.1))) == 0).all()
    np.testing.assert_allclose(proposal_rate(jnp.asarray([4]), jnp.asarray([40])),
                               [20 / 56], rtol=1e-6)


def test_a_row_s_first_misses_do_not_outweigh_the_calibrated_proposal_rate():
    """A row whose speculator cannot tell before drafting whether it finds a draft
    (`NGram(peek=False)`) may find few until its output repeats itself: 20 asks without a
    match leave a calibrated proposal rate of 0.3 at 4.8 / 36 (its 16 pseudo-asks), and
    the row keeps drafting (α 0.7-0.8 by depth, a verify of 1 + 0.5 log2 T steps); at 4
    pseudo-asks (1.2 / 24) it would stop. 200 misses stop it; a speculator that peeks
    (the n-gram) drafts wherever it finds a match, however rarely that is."""
    import jax.numpy as jnp

    from specjax.decoding.policy import PROPOSAL_PRIOR_TRIES, Rule, decide_from
    from specjax.decoding.state import Counters

    assert PROPOSAL_PRIOR_TRIES == 16
    spec = NGram(k=4, peek=False)
    rule = Rule(jnp.float32(0.0), jnp.bool_(True), VerifyCost(slope=0.5).validated(),
                jnp.asarray([0.7, 0.75, 0.8, 0.8], jnp.float32), proposal=jnp.float32(0.3))
    buckets = ((0, 0), (1, 1), (2, 2), (4, 4))

    def limit(asked, spec=spec):
        c = Counters.zeros(1, 4).replace(asked=jnp.asarray([asked], jnp.int32))
        one = jnp.ones((1,), jnp.int32)
        return int(decide_from(spec, rule, buckets, c, one > 0, 32 * one, 32).limit[0])

    assert limit(20) > 0 and limit(200) == 0
    assert limit(200, NGram(k=4)) > 0


def test_a_rarely_finding_row_alone_weighs_its_empty_steps():
    """At batch 1 a step whose speculator finds no draft verifies only its root, one
    token, yet pays the step's measured overhead: a row whose speculator (one that
    cannot peek) finds a draft at 3 % of its asked steps gains little from a deep prior
    (α 0.25, then 1, 0.5, 1) and stays plain, where one that always finds drafts.
    Without the overhead and the rule's margin, asking costs nothing where nothing is
    found, and it drafts too."""
    import jax.numpy as jnp
    import numpy as np

    from specjax.decoding.policy import Rule, decide_from, leviathan_gain
    from specjax.decoding.state import Counters

    a = jnp.asarray([[0.25, 1.0, 0.5, 1.0]] * 2)
    v, calls = jnp.asarray([1.0, 1.1, 1.2, 1.25, 1.3]), jnp.arange(5)
    over = jnp.asarray([0.0, 0.03, 0.03, 0.03, 0.03])
    sure = leviathan_gain(a, 0.0, 4, v, calls, overhead=over)[0]
    # 1.75 tokens for 1.33 at depth 4; mixed at p = 0.03: 1.0225 for 1.039
    np.testing.assert_allclose(sure[4], 1.75 / 1.33, rtol=1e-6)
    mixed = leviathan_gain(a, 0.0, 4, v, calls, jnp.asarray([0.03, 1.0]), over)
    np.testing.assert_allclose(mixed[0, 4], 1.0225 / 1.039, rtol=1e-5)
    np.testing.assert_allclose(mixed[1], sure, rtol=1e-6)
    np.testing.assert_allclose(mixed[:, 0], 1.0)  # k = 0: a plain step either way

    spec = NGram(k=4, peek=False)
    rule = Rule(jnp.float32(0.0), jnp.bool_(True), VerifyCost(jump=0.1).validated(),
                jnp.asarray([0.25, 1.0, 0.5, 1.0], jnp.float32),
                overhead=jnp.float32(0.03), proposal=jnp.float32(0.03))
    buckets = ((0, 0), (1, 1), (2, 2), (4, 4))

    def limit(r):
        ones = jnp.ones((1,), jnp.int32)
        return int(decide_from(spec, r, buckets, Counters.zeros(1, 4), ones > 0, 32 * ones,
                               32).limit[0])

    assert limit(rule) == 0
    assert limit(rule.replace(proposal=jnp.float32(1.0))) > 0
    assert limit(rule.replace(overhead=jnp.float32(0.0))) == 0  # 1.019x: in the margin
    assert limit(rule.replace(overhead=jnp.float32(0.0), margin=jnp.float32(0.0))) > 0


def test_a_rarely_finding_row_pays_the_switch_for_its_empty_steps():
    """An asked step that gets no draft still runs the verify switch's one-token forward
    (1 + branch plain steps), and a probe is accepted only where the speculator
    proposes: with the loop's upkeep calibrated at 0, a speculator that cannot peek and
    finds a draft at 3 % of steps runs plain decoding's programs, where one that always
    finds drafts (or finds them at 30 %) may draft. One that peeks skips the switch
    where it has no draft, so it would draft; yet over the call its drafts at 3 % of
    steps gain under the 5 % margin (`Decision.call_pays`), so it runs plain decoding's
    programs too, unless the margin is 0."""
    import jax.numpy as jnp

    from specjax.decoding.policy import Rule, may_draft

    def rule(proposal, branch):
        return Rule(jnp.float32(0.0), jnp.bool_(True),
                    VerifyCost(jump=0.1, branch=branch).validated(),
                    jnp.asarray([0.25, 1.0, 0.5, 1.0], jnp.float32), overhead=jnp.float32(0.0),
                    proposal=jnp.float32(proposal), idle=jnp.float32(0.0))

    spec = NGram(k=4, peek=False)
    assert not may_draft(spec, rule(0.03, 0.08), 1, 64)
    assert may_draft(spec, rule(0.3, 0.08), 1, 64)
    assert may_draft(spec, rule(1.0, 0.08), 1, 64)
    assert not may_draft(NGram(k=4), rule(0.03, 0.08), 1, 64)
    assert may_draft(NGram(k=4), rule(0.03, 0.08).replace(margin=jnp.float32(0.0)), 1, 64)


def test_a_peeking_row_pays_the_loop_s_upkeep_at_its_steps_without_a_match():
    """`peeking_gain`: where its lookup matches at every step and the loop costs nothing
    idle, the gain is the drafting step's over the margin; at a 14 % match rate, with
    the loop 5 % dearer than plain decoding at the other steps, drafts that gain 30 %
    on their own steps lose over the call, and the call runs plain decoding's programs
    (`may_draft`); at a 50 % match rate they still pay. With no upkeep the call gains
    4 % at a 14 % match rate, inside the 5 % margin, so it runs plain decoding's
    programs too, though every drafting step would gain (no margin: it drafts); at
    30 % it gains 9 % and drafts."""
    import jax.numpy as jnp
    import numpy as np

    from specjax.decoding.policy import Rule, leviathan_gain, may_draft, peeking_gain

    a = jnp.full((1, 4), 0.3, jnp.float32)
    v, calls, over = jnp.asarray([1.0] + [1.1] * 4), jnp.arange(5), jnp.zeros(5)
    sure = leviathan_gain(a, 0.0, 4, v, calls, overhead=over)[0]
    always = peeking_gain(a, 0.0, 4, v, calls, jnp.ones(1), over, 0.0, margin=0.05)[0]
    np.testing.assert_allclose(always[1:], sure[1:] / 1.05, rtol=1e-6)
    assert float(always[0]) == 1.0
    rare = peeking_gain(a, 0.0, 4, v, calls, jnp.asarray([0.14]), over, 0.05, margin=0.05)[0]
    e4 = 1 + 0.3 + 0.3 ** 2 + 0.3 ** 3 + 0.3 ** 4
    np.testing.assert_allclose(rare[4], (0.14 * e4 + 0.86) / (0.14 * 1.1 * 1.05 + 0.86 * 1.05),
                               rtol=1e-6)
    assert float(sure[4]) > 1.29 and float(jnp.max(rare[1:])) < 1.0

    def rule(match, idle):
        return Rule(jnp.float32(0.0), jnp.bool_(True), VerifyCost(jump=0.1).validated(),
                    jnp.full((4,), 0.3, jnp.float32), overhead=jnp.float32(0.0),
                    proposal=jnp.float32(match), idle=jnp.float32(idle))

    assert not may_draft(NGram(k=4), rule(0.14, 0.05), 1, 64)
    whole = peeking_gain(a, 0.0, 4, v, calls, jnp.asarray([0.14]), over, 0.0)[0]
    assert 1.0 < float(jnp.max(whole)) < 1.05
    assert not may_draft(NGram(k=4), rule(0.14, 0.0), 1, 64)
    assert may_draft(NGram(k=4), rule(0.14, 0.0).replace(margin=jnp.float32(0.0)), 1, 64)
    assert may_draft(NGram(k=4), rule(0.3, 0.0), 1, 64)
    assert may_draft(NGram(k=4), rule(0.5, 0.05), 1, 64)
    assert may_draft(NGram(k=4), rule(float("nan"), 0.05), 1, 64)  # uncalibrated: 1


def test_ngram_has_draft_where_it_proposes_one():
    """`has_draft` (the loop's peek) agrees with `propose` on random rows, short and
    long, repetitive and not."""
    import jax.numpy as jnp
    import numpy as np

    from specjax.speculators.base import ProposeContext

    rng = np.random.default_rng(0)
    toks = jnp.asarray(rng.integers(0, 5, (64, 24)), jnp.int32)
    lens = jnp.asarray(rng.integers(1, 25, 64), jnp.int32)
    for spec in (NGram(k=4), NGram(k=2, n_max=4, n_min=3), NGram(k=3, n_min=1)):
        ctx = ProposeContext(toks, lens, lens > 0, None, None, jnp.full((64,), spec.k))
        tree, _ = spec.propose(None, ctx, None)
        found = np.asarray(spec.has_draft(None, toks, lens))
        np.testing.assert_array_equal(found, np.asarray(tree.valid).any(axis=1))
        assert 0 < found.sum() < 64
    assert NGram(k=4).peeks and not NGram(k=4, peek=False).peeks


def test_a_peeking_row_drafts_only_where_its_lookup_finds_a_match(tiny_target, greedy_ref):
    """With a speculator that peeks, the loop runs plain steps until the lookup finds a
    match: every step that asks for a draft has one (without peeking, some do not), and
    the tokens are plain decoding's either way."""
    free = VerifyCost.from_table({1: 1.0, 10_000: 1.0})
    kw = dict(max_new_tokens=16, ignore_eos=True, acceptance_prior=[0.9] * 4,
              cost_ratio=0.0, verify_cost=free)
    peeking = specjax.generate(tiny_target, PROMPTS[:1], speculator=NGram(k=4), **kw)
    assert peeking.tokens == greedy_ref[:1]
    assert peeking.stats.asked == peeking.stats.proposed > 0
    blind = specjax.generate(tiny_target, PROMPTS[:1], speculator=NGram(k=4, peek=False),
                             **kw)
    assert blind.tokens == greedy_ref[:1]
    assert blind.stats.asked > blind.stats.proposed


def test_generate_counts_asked_and_proposed_drafts(tiny_target):
    """Every full-depth step asks each active row for a draft; at batch 1 the row's
    draft is verified whenever it found one, so found drafts are the steps that tried
    depth 1. A bad proposal prior is refused by name."""
    # k = 4 at these shapes: test_greedy_is_lossless[ngram]'s programs, not two more
    out = specjax.generate(tiny_target, PROMPTS[:1], max_new_tokens=16, ignore_eos=True,
                           speculator=NGram(k=4), adaptive=False).stats
    assert out.asked == out.target_calls > 0
    assert out.proposed == out.tried_hist[0] <= out.asked
    assert out.proposal_rate == out.proposed / out.asked
    batch = specjax.generate(tiny_target, PROMPTS, max_new_tokens=16, ignore_eos=True,
                             speculator=NGram(k=4), adaptive=False).stats
    assert batch.asked == batch.target_calls and batch.proposed >= batch.tried_hist[0]
    for bad in (-0.1, 1.5, float("nan"), "x", True):
        with pytest.raises(ValueError, match="proposal_prior="):
            specjax.generate(tiny_target, PROMPTS[:1], max_new_tokens=4,
                             speculator=NGram(k=3), proposal_prior=bad)


def test_position_acceptance_takes_a_prior_mean_per_depth():
    """A prior mean replaces the defaults where given (NaN: the default, chained)."""
    import jax.numpy as jnp
    import numpy as np

    from specjax.decoding.policy import position_acceptance

    none = (jnp.zeros((1, 4)), jnp.zeros((1, 3)))
    np.testing.assert_allclose(
        position_acceptance(*none, mean=jnp.asarray([0.2, jnp.nan, 0.9]))[0],
        [0.2, 0.2, 0.9], rtol=1e-6)
    # with data: 4 pseudo-tries at the prior, then the row's counts
    hist, tried = jnp.asarray([[2, 0, 0, 2]]), jnp.asarray([[4, 2, 2]])
    np.testing.assert_allclose(
        position_acceptance(hist, tried, mean=jnp.asarray([0.0, 1.0, 1.0]))[0],
        [2 / 8, 6 / 6, 6 / 6], rtol=1e-6)


def test_probes_run_only_where_their_outcome_could_change_the_rule(tiny_target):
    """A k = 0 row probes depth 1 only if accepted probes could make it draft. With
    verifies of 2, 3 and 5 tokens at 1.8, 2.6 and 3.0 steps, the default prior (0.75,
    chained) keeps n-gram off (3.05 tokens for 3.0 steps at k = 4, under the 5 % margin)
    but four accepted probes (α₁ 0.875) would draft k = 4 (3.39 tokens), worth more than
    the probes lose (1.8 steps for 1.75 tokens, every 16 steps), so it probes (steps 15,
    ...); a calibrated prior with deeper acceptance 0 leaves one-token drafts (at most
    1.875 tokens for 1.8 steps) as the best case: no probes at all."""
    cost = VerifyCost.from_table({1: 1.0, 2: 1.8, 3: 2.6, 5: 3.0})
    kw = dict(max_new_tokens=40, ignore_eos=True, verify_cost=cost)
    plain = specjax.generate(tiny_target, PROMPTS[:1], **kw)
    spec = NGram(k=4, n_min=1)  # a random model rarely repeats a pair of tokens
    default = specjax.generate(tiny_target, PROMPTS[:1], speculator=spec, **kw)
    known = specjax.generate(tiny_target, PROMPTS[:1], speculator=spec, **kw,
                             acceptance_prior=[None, 0.0, 0.0, 0.0])
    assert default.tokens == plain.tokens and known.tokens == plain.tokens
    assert default.stats.mean_verified > 1.0  # the probes (any n-gram match) verified
    assert known.stats.mean_verified == 1.0 and known.stats.drafted == 0


def test_verification_option_is_checked(tiny_target, tiny_draft):
    """generate(verification=): an unknown name, block on a speculator that proposes trees,
    or no speculator at all are refused by name; a tree that carries draft_probs without
    declaring its nodes sampled is refused where the loop checks the proposal."""
    from flax import struct

    from specjax.speculators import Eagle, Medusa
    from specjax.tree import DraftTree

    assert NGram(k=2).shape.proposes_chains
    assert DraftModel.create(tiny_draft, k=2).shape.proposes_chains
    assert not DraftModel.create(tiny_draft, k=2, tree_top_k=2).shape.proposes_chains
    assert Eagle.random(tiny_target, version=1, tree=[[0], [0, 0]]).shape.proposes_chains
    assert not Eagle.random(tiny_target, top_k=2, depth=2, total_tokens=3).shape.proposes_chains
    kw = dict(max_new_tokens=4, temperature=1.0)
    with pytest.raises(ValueError, match="verification='fast'"):
        specjax.generate(tiny_target, PROMPTS, speculator=NGram(k=2), verification="fast", **kw)
    with pytest.raises(ValueError, match="DraftModel proposes trees"):
        specjax.generate(tiny_target, PROMPTS, verification="block", **kw,
                         speculator=DraftModel.create(tiny_draft, k=2, tree_top_k=2))
    with pytest.raises(ValueError, match="needs a speculator"):
        specjax.generate(tiny_target, PROMPTS, verification="block", **kw)
    with pytest.raises(ValueError, match="has siblings"):
        Medusa.random(tiny_target, num_heads=2, tree=[[0], [1]], verification="block")

    @struct.dataclass
    class TopKWithQ(NGram):  # records a q for its deterministic drafts: lossy, refused
        def propose(self, state, ctx, target_params):
            tree, state = super().propose(state, ctx, target_params)
            q = jax.nn.one_hot(tree.tokens, tiny_target.config.vocab_size) * 0.5 + 0.5 / 128
            return DraftTree(tree.tokens, tree.parents, tree.depth, tree.valid, q,
                             max_depth=tree.max_depth), state

    with pytest.raises(ValueError, match="must declare sampled=True"):
        specjax.generate(tiny_target, PROMPTS, speculator=TopKWithQ(k=2), **kw)


@pytest.mark.parametrize("tree_top_k", [0, 2])
def test_a_full_queue_flush_skips_the_draft_lm_head(tiny_target, tiny_draft, tree_top_k):
    """While no row drafts and the queue is full, the draft runs its layers over the queue
    (its cache catches up) but not its LM head (most of a small draft's cost) and draws
    nothing: the root's logits are computed only when a row drafts."""
    import jax.numpy as jnp
    import numpy as np

    from specjax.sampling import Sampling
    from specjax.speculators.base import ProposeContext

    spec = DraftModel.create(tiny_draft, k=3, tree_top_k=tree_top_k,
                             total_tokens=4 if tree_top_k else None).for_decoding()
    heads = []
    lm_head = DraftModel._logits

    def counted(self, h):
        jax.debug.callback(lambda: heads.append(1))
        return lm_head(self, h)

    state = spec.init(tiny_target.config, batch=2, capacity=64)
    q = state.queue.items[0].shape[1]
    full = state.queue.replace(count=jnp.full((2,), q - 1, jnp.int32))  # no room for one more
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 128, (2, 64)), jnp.int32)
    lengths = jnp.array([q + 2, q + 5], jnp.int32)
    # the draft's cache ends where the queue starts: q - 1 pairs, then the root
    state = state.replace(queue=full, cache=state.cache.replace(lengths=lengths - q))

    def propose(limit):
        ctx = ProposeContext(tokens, lengths, jnp.ones((2,), bool), Sampling.create(),
                             jax.random.split(jax.random.key(0), 2), jnp.full((2,), limit))
        return jax.jit(lambda s, c: spec.propose(s, c, None))(state, ctx)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DraftModel, "_logits", counted)
        tree, new = propose(0)
        jax.effects_barrier()
        assert heads == [] and not bool(tree.valid.any())
        np.testing.assert_array_equal(new.cache.lengths, lengths)  # queue + root consumed
        tree, _ = propose(3)
        jax.effects_barrier()
        assert heads and bool(tree.valid.all(axis=1).any())


def test_a_speculator_is_laid_out_once_across_generate_calls(tiny_target, tiny_draft,
                                                             monkeypatch):
    """`generate` converts a speculator's weights to the decode layout once per speculator
    object and layout (`decoding.programs.LayoutCache`), not on every call; another
    layout, or another speculator object, is converted anew."""
    from specjax.decoding.generate import LAYOUTS

    LAYOUTS.clear()
    calls = []
    lay_out = DraftModel.for_decoding
    monkeypatch.setattr(DraftModel, "for_decoding",
                        lambda self, layout="auto": calls.append(layout) or lay_out(self, layout))
    spec = DraftModel.create(tiny_draft, k=3)
    # test_greedy_is_lossless[draft]'s settings: its compiled programs serve these calls
    outs = [specjax.generate(tiny_target, PROMPTS, max_new_tokens=16, ignore_eos=True,
                             speculator=spec).tokens for _ in range(2)]
    assert calls == ["auto"] and outs[0] == outs[1]
    # the cache generate reads (`_for_decoding`), asked as generate asks it; a draft
    # decoding in the scan layout is tests/sharding_cases.py's (meshes decode scanned)
    assert LAYOUTS.get(spec, "auto") is LAYOUTS.get(spec, "auto")
    LAYOUTS.get(spec, "scan")
    LAYOUTS.get(DraftModel.create(tiny_draft, k=3), "auto")
    assert calls == ["auto", "scan", "auto"]


def test_programs_past_the_memory_map_budget_are_dropped_with_jaxs_caches(tiny_target,
                                                                          monkeypatch):
    """XLA:CPU programs hold memory maps that jax's caches keep alive; past the budget a
    compile first clears generate's programs and jax's caches (a long run in one process
    otherwise dies at the OS limit), and decoding gives the same tokens after it."""
    import jax

    from specjax.decoding import programs
    from specjax.decoding.generate import PROGRAMS

    maps = programs.memory_maps()
    assert maps is not None and maps > 0  # Linux: /proc/self/maps
    limit = int(open("/proc/sys/vm/max_map_count").read())
    assert programs.map_budget() == int(limit * 0.75)
    # plain decoding: the cache's bookkeeping is the same for any program, and each
    # recompile below retraces the loop (a speculative one takes seconds to trace)
    kw = dict(max_new_tokens=8, ignore_eos=True)
    want = specjax.generate(tiny_target, PROMPTS, **kw).tokens
    clears = []
    real = jax.clear_caches
    monkeypatch.setattr(jax, "clear_caches", lambda: (clears.append(1), real())[1])
    PROGRAMS.clear()
    monkeypatch.setattr(PROGRAMS, "budget", None)  # no limit known: nothing is cleared
    assert specjax.generate(tiny_target, PROMPTS, **kw).tokens == want and not clears
    assert len(PROGRAMS.items()) == 2  # its prefill and decode loop
    monkeypatch.setattr(PROGRAMS, "budget", 0)  # every compile finds the budget spent
    PROGRAMS.clear()
    assert specjax.generate(tiny_target, PROMPTS, **kw).tokens == want
    assert len(clears) == 2 and len(PROGRAMS.items()) == 1  # the loop's compile dropped
    monkeypatch.setattr(PROGRAMS, "budget", programs.memory_maps() + 10**6)
    assert specjax.generate(tiny_target, PROMPTS, **kw).tokens == want  # prefill again
    assert len(clears) == 2 and len(PROGRAMS.items()) == 2


def test_expected_gain_is_the_rules_price_at_its_prior(tiny_target, tiny_draft):
    """`expected_gain`: tokens per unit of cost at the depth the rule picks from its
    prior, over plain decoding's. With free draft calls and verifies a chain of 3 at
    α 0.8 expects 1 + 0.8 + 0.64 + 0.512 tokens a step; an overhead of half a step
    divides that by 1.5; a prior that cannot pay gains nothing (1.0)."""
    from specjax.decoding.generate import expected_gain

    chain = DraftModel.create(tiny_draft, k=3)
    kw = dict(cost_ratio=0.0, verify_cost=VerifyCost())
    assert expected_gain(tiny_target, chain, acceptance_prior=[0.8] * 3, **kw) == \
        pytest.approx(2.952, rel=1e-5)
    assert expected_gain(tiny_target, chain, acceptance_prior=[0.8] * 3, step_overhead=0.5,
                         **kw) == pytest.approx(2.952 / 1.5, rel=1e-5)
    assert expected_gain(tiny_target, chain, acceptance_prior=[0.0] * 3, **kw) == 1.0
    # a draft call at 0.3 of a step: 3 calls for 2.952 tokens still beat 1 for 1.8 or 2
    # for 2.44; at 0.7 one call pays best (1.8 / 1.7), at 0.9 none
    at = lambda c: expected_gain(tiny_target, chain, acceptance_prior=[0.8] * 3,  # noqa: E731
                                 cost_ratio=c, verify_cost=VerifyCost())
    assert at(0.3) == pytest.approx(2.952 / 1.9, rel=1e-5)
    assert at(0.7) == pytest.approx(1.8 / 1.7, rel=1e-5)
    assert at(0.9) == 1.0
    with pytest.raises(ValueError, match="batch=0"):
        expected_gain(tiny_target, chain, batch=0)
    with pytest.raises(ValueError, match="speculator=None"):
        expected_gain(tiny_target, None)


def test_best_calibrated_picks_the_tree_that_pays_on_this_verify_cost(tiny_target):
    """Of one head's tree shapes, each with its calibration, the one the rule expects to
    gain most: a wide tree that accepts more wins where a verify is nearly free, the
    chain where each verified token costs (as on a CPU); ties go to the first."""
    from specjax.calibrate import Calibration, best_calibrated
    from specjax.speculators import Eagle

    shapes = {"wide": Eagle.random(tiny_target, top_k=4, depth=3, total_tokens=12),
              "chain": Eagle.random(tiny_target, top_k=1, depth=3, total_tokens=3)}
    cal = {"wide": Calibration(prior=[0.7, 0.6, 0.5]),
           "chain": Calibration(prior=[0.5, 0.4, 0.3])}
    costs = {"wide": 0.05, "chain": 0.05}
    cheap, steep = VerifyCost(), VerifyCost(per_token=0.3)

    def pick(verify_cost):
        return best_calibrated(tiny_target, shapes, cal, cost_ratios=costs,
                               verify_cost=verify_cost)

    best, gains = pick(cheap)
    assert best == "wide" and gains["wide"] > gains["chain"] > 1.0
    best, gains = pick(steep)
    assert best == "chain" and gains["chain"] > gains["wide"]
    same = {"a": shapes["chain"], "b": shapes["chain"]}
    both = {"a": cal["chain"], "b": cal["chain"]}
    assert best_calibrated(tiny_target, same, both, cost_ratios=None)[0] == "a"
    # a shape without a calibration is left out; none at all is an error
    assert best_calibrated(tiny_target, shapes, {"chain": cal["chain"]})[0] == "chain"
    with pytest.raises(ValueError, match="no calibration"):
        best_calibrated(tiny_target, shapes, {})
