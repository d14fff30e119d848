"""`Hybrid`: the n-gram's chain where lookup matches, a model's tree elsewhere."""

import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.decoding.policy import verify_buckets
from specjax.decoding.speculate import node_levels
from specjax.inspect import first_draft
from specjax.speculators import DraftModel, Eagle, Hybrid, NGram
from specjax.speculators.hybrid import embed_chain
from specjax.tree import DraftTree, chain

# a row that repeats itself (lookup matches), one that does not
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [40, 3, 77, 12, 90, 21]]


@pytest.fixture(scope="module")
def eagle(tiny_target):
    # a dynamic tree of 2 children per node, depth 4, 8 nodes: widths 2, 6, 8, 8
    return Eagle.random(tiny_target, version=3, hidden_layers=(0, 1, 1),
                        draft_vocab_size=64, top_k=2, depth=4, total_tokens=8)


def test_node_levels_name_the_narrowest_bucket_holding_each_node():
    buckets = verify_buckets((0, 2, 6, 8, 8))
    assert buckets == ((0, 0), (1, 2), (2, 6), (4, 8))
    assert node_levels(buckets) == [1, 1, 2, 2, 2, 2, 4, 4]
    assert node_levels(verify_buckets((0, 1, 2, 3, 4))) == [1, 2, 4, 4]


def test_the_chain_replaces_the_model_tree_in_matching_rows_only():
    model = DraftTree(
        tokens=jnp.arange(12).reshape(2, 6), parents=jnp.array([[-1, -1, 0, 0, 1, 2]] * 2),
        depth=jnp.array([[1, 1, 2, 2, 2, 3]] * 2), valid=jnp.ones((2, 6), bool),
        draft_probs=jnp.full((2, 6, 50), 0.02), max_depth=3, sampled=True)
    found = chain(jnp.array([[30, 31], [40, 41]]), valid=jnp.array([[True, True],
                                                                    [True, False]]))
    out = embed_chain(found, model, jnp.array([True, False]))
    np.testing.assert_array_equal(out.tokens[0, :2], [30, 31])
    np.testing.assert_array_equal(out.parents[0, :2], [-1, 0])
    np.testing.assert_array_equal(out.depth[0, :2], [1, 2])
    np.testing.assert_array_equal(out.valid[0], [True, True, False, False, False, False])
    # the other row keeps the model's tree
    for a, b in ((out.tokens, model.tokens), (out.parents, model.parents),
                 (out.valid, model.valid), (out.draft_probs, model.draft_probs)):
        np.testing.assert_array_equal(a[1], b[1])
    # the chain's nodes are point masses at their tokens
    np.testing.assert_array_equal(out.draft_probs[0, 0], np.eye(50)[30])
    np.testing.assert_array_equal(out.draft_probs[0, 1], np.eye(50)[31])


def test_a_chain_in_a_wider_tree_verifies_the_narrowest_bucket_holding_it(tiny_target,
                                                                           eagle):
    """Every token of the prompt is followed by 4 more, so a one-token match finds a
    whole chain of 4 after any root: it fills nodes 0-3 of the tree's 8, which the
    6-node bucket holds (the bucket of its depth, 4, is all 8)."""
    prompt = list(range(128)) + list(range(4))
    hybrid = Hybrid.create(NGram(k=4, n_min=1), eagle)
    step = first_draft(tiny_target, prompt, hybrid)
    np.testing.assert_array_equal(step["valid"], [True] * 4 + [False] * 4)
    np.testing.assert_array_equal(step["depth"][:4], [1, 2, 3, 4])
    assert step["tokens"][0] == (step["root"] + 1) % 128
    assert step["width"] == 6
    assert first_draft(tiny_target, prompt, eagle)["width"] == 8


def test_greedy_is_lossless_and_the_lookups_chains_are_taken(tiny_target, eagle):
    plain = specjax.generate(tiny_target, PROMPTS, max_new_tokens=24, ignore_eos=True)
    spec = Hybrid.create(NGram(k=4), eagle)
    for adaptive in (False, True):
        out = specjax.generate(tiny_target, PROMPTS, max_new_tokens=24, ignore_eos=True,
                               speculator=spec, adaptive=adaptive)
        assert out.tokens == plain.tokens
    # alone, the repeating row's steps verify the chain's bucket (7 inputs) or the whole
    # tree (9); the bucket itself is the test above's
    alone = specjax.generate(tiny_target, PROMPTS[:1], max_new_tokens=24, ignore_eos=True,
                             speculator=spec, adaptive=False)
    assert alone.tokens == plain.tokens[:1]
    assert 7.0 <= alone.stats.mean_verified < 9.0
    head = specjax.generate(tiny_target, PROMPTS[:1], max_new_tokens=24, ignore_eos=True,
                            speculator=eagle, adaptive=False)
    assert head.stats.mean_verified == 9.0
    assert alone.stats.accepted > head.stats.accepted  # the lookup's chains were taken


def test_a_chain_fills_the_bucket_its_depth_limit_buys(tiny_target, eagle):
    """At depth limit 1 the step verifies the 2-node bucket, which holds a chain's first
    two nodes: they are kept and accepted two at a time, where the head alone (and a cut
    by depth alone) accepts at most one per step. Lossless either way."""
    from specjax.calibrate import shallow_kwargs

    plain = specjax.generate(tiny_target, PROMPTS[:1], max_new_tokens=24, ignore_eos=True)
    runs = {}
    for name, spec in (("hybrid", Hybrid.create(NGram(k=4), eagle)), ("head", eagle)):
        runs[name] = out = specjax.generate(
            tiny_target, PROMPTS[:1], max_new_tokens=24, ignore_eos=True,
            **shallow_kwargs(spec, 24, cost_ratio=0.0))
        assert out.tokens == plain.tokens
        assert out.stats.mean_verified <= 3.0  # the root and the 2-node bucket at most
    assert runs["hybrid"].stats.accepted_hist[2] > 0
    assert not any(runs["head"].stats.accepted_hist[2:])


def test_a_draft_models_chain_with_the_lookups_is_lossless(tiny_target, tiny_draft):
    """The draft's rows carry its distributions, the lookup's one-hot ones (the sampled
    case: test_speculative.py's distribution test)."""
    spec = Hybrid.create(NGram(k=3), DraftModel.create(tiny_draft, k=3))
    plain = specjax.generate(tiny_target, PROMPTS, max_new_tokens=16, ignore_eos=True)
    out = specjax.generate(tiny_target, PROMPTS, max_new_tokens=16, ignore_eos=True,
                           speculator=spec, adaptive=False)
    assert out.tokens == plain.tokens
    assert out.stats.accepted > 0


@pytest.mark.parametrize("lookup,model,error,match", [
    (NGram(k=5), "eagle", ValueError, "k=5 exceeds the model's tree depth 4"),
    ("eagle", "eagle", TypeError, "lookup must be an NGram"),
    (NGram(k=2), NGram(k=4), TypeError, "got NGram"),
])
def test_bad_pairs_are_refused(eagle, lookup, model, error, match):
    pick = lambda x: eagle if x == "eagle" else x  # noqa: E731
    with pytest.raises(error, match=match):
        Hybrid.create(pick(lookup), pick(model))
