"""Verification in isolation: greedy walks, and rejection sampling is exactly the target's
distribution — shown by chi-square on many rows, with a wrong verifier failing the same
test (so the test has power)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.sampling import Sampling, argmax, probs
from specjax.tree import DraftTree, ancestor_mask, chain, check_tree, static_tree
from specjax.verify import VerifyResult, _finish, verify, verify_greedy
from tests.stat_utils import assert_same_distribution

V = 6
ROWS = 20000


def _dist(seed, sharp=2.0):
    return np.random.default_rng(seed).normal(size=V) * sharp


def _tree_rows(parents, tokens, rows, draft_probs=None):
    n = len(parents)
    par = np.asarray(parents, np.int32)
    depth = np.zeros(n, np.int32)
    for i, p in enumerate(par):
        depth[i] = 1 if p < 0 else depth[p] + 1
    tile = lambda a: jnp.asarray(np.broadcast_to(a, (rows, n)))
    return DraftTree(jnp.asarray(tokens, jnp.int32), tile(par), tile(depth),
                     jnp.ones((rows, n), bool), draft_probs, max_depth=int(depth.max()),
                     sampled=draft_probs is not None)


def accept_all(logits, tree, sampling, key):
    """A deliberately wrong verifier: accepts every draft of a chain."""
    b = logits.shape[0]
    accepted = jnp.broadcast_to(jnp.arange(tree.max_depth, dtype=jnp.int32), (b, tree.max_depth))
    bonus = jax.random.categorical(key, logits[:, -1])
    return _finish(tree, accepted, bonus)


def _first_tokens(result: VerifyResult) -> list:
    return [(int(t),) for t in np.asarray(result.path_tokens[:, 0])]


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_chain_rejection_sampling_is_the_target(temperature, top_p):
    s = Sampling.create(temperature, 0, top_p)
    target_logits = jnp.asarray(_dist(0))
    draft_logits = jnp.asarray(_dist(1))
    p = np.asarray(probs(target_logits, s), np.float64)
    q = probs(draft_logits, s)
    key_d, key_v = jax.random.split(jax.random.key(0))
    drafts = jax.random.categorical(key_d, jnp.log(q), shape=(ROWS, 1))
    logits = jnp.broadcast_to(jnp.stack([target_logits, jnp.asarray(_dist(2))]), (ROWS, 2, V))
    tree = chain(drafts, draft_probs=jnp.broadcast_to(q, (ROWS, 1, V)), sampled=True)
    res = verify(logits, tree, s, key_v)
    exact = {(t,): p[t] for t in range(V) if p[t] > 0}
    assert_same_distribution(_first_tokens(res), exact)
    assert 0 < float(jnp.mean(res.num_accepted)) < 1
    # The same test rejects a wrong verifier: it has power.
    wrong = accept_all(logits, tree, s, key_v)
    with pytest.raises(AssertionError, match="chi-square|outside"):
        assert_same_distribution(_first_tokens(wrong), exact)


def test_tree_of_point_mass_siblings_is_the_target():
    """Three deterministic siblings (as from top-k expansion), each with a child."""
    s = Sampling.create(1.0)
    target_logits = jnp.asarray(_dist(3))
    p = np.asarray(probs(target_logits, s), np.float64)
    parents, toks = [-1, -1, -1, 0, 1, 2], [4, 0, 2, 1, 1, 5]
    tree = _tree_rows(parents, np.broadcast_to(toks, (ROWS, 6)), ROWS)
    logits = jnp.broadcast_to(jnp.stack([target_logits] + [jnp.asarray(_dist(10 + i))
                                                           for i in range(6)]), (ROWS, 7, V))
    res = verify(logits, tree, s, jax.random.key(1))
    assert_same_distribution(_first_tokens(res), {(t,): p[t] for t in range(V)})
    # Accepted nodes respect the tree: a depth-2 node only after its parent.
    acc = np.asarray(res.accepted)
    both = acc[:, 1] >= 0
    assert np.all(np.asarray(parents)[acc[both, 1]] == acc[both, 0])


def test_iid_sampled_siblings_is_the_target():
    """Siblings drawn i.i.d. from q use SpecInfer's multi-round rejection."""
    s = Sampling.create(1.0)
    target_logits, draft_logits = jnp.asarray(_dist(4)), jnp.asarray(_dist(5))
    p = np.asarray(probs(target_logits, s), np.float64)
    q = probs(draft_logits, s)
    drafts = jax.random.categorical(jax.random.key(2), jnp.log(q), shape=(ROWS, 3))
    tree = _tree_rows([-1, -1, -1], drafts, ROWS, jnp.broadcast_to(q, (ROWS, 3, V)))
    logits = jnp.broadcast_to(jnp.stack([target_logits] + [jnp.asarray(_dist(20 + i))
                                                           for i in range(3)]), (ROWS, 4, V))
    res = verify(logits, tree, s, jax.random.key(3))
    assert_same_distribution(_first_tokens(res), {(t,): p[t] for t in range(V)})


def test_argmax_is_jnp_argmax_with_ties_infinities_and_nan():
    """The greedy pick (two plain reductions) equals jnp.argmax: the first maximal index,
    NaN counting as maximal, all -inf giving index 0."""
    rng = np.random.default_rng(0)
    x = rng.integers(-3, 4, (64, 50)).astype(np.float32)  # many ties
    x[1] = -np.inf
    x[2, 7] = x[2, 30] = np.inf
    x[3, 11] = x[3, 40] = np.nan
    x[4, :] = np.nan
    x[5, 49] = 100.0
    got = np.asarray(jax.jit(argmax)(jnp.asarray(x)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    assert got[1] == 0 and got[2] == 7 and got[3] == 11 and got[4] == 0 and got[5] == 49
    y = rng.standard_normal((2, 3, 49152)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(argmax(jnp.asarray(y))), y.argmax(-1))


def test_greedy_follows_the_argmax_down_the_tree():
    parents, toks = [-1, -1, 0, 0, 3], [2, 3, 1, 4, 5]
    tree = _tree_rows(parents, np.asarray([toks]), 1)
    logits = np.full((1, 6, V), -5.0, np.float32)
    logits[0, 0, 2] = 5  # root -> node 0 (token 2)
    logits[0, 1, 4] = 5  # node 0 -> node 3 (token 4)
    logits[0, 4, 5] = 5  # node 3 -> node 4 (token 5)
    logits[0, 5, 0] = 5  # node 4 -> bonus 0
    res = verify_greedy(jnp.asarray(logits), tree)
    assert np.asarray(res.accepted).tolist() == [[0, 3, 4]]
    assert np.asarray(res.path_tokens).tolist() == [[2, 4, 5, 0]]
    assert np.asarray(res.path_inputs).tolist() == [[0, 1, 4, 5]]


def test_one_branch_tree_equals_chain():
    toks = jnp.asarray([[3, 1, 2]])
    logits = jax.random.normal(jax.random.key(4), (1, 4, V))
    a = verify_greedy(logits, chain(toks))
    b = verify_greedy(logits, _tree_rows([-1, 0, 1], np.asarray(toks), 1))
    assert np.asarray(a.path_tokens).tolist() == np.asarray(b.path_tokens).tolist()
    s = Sampling.create(1.0)
    a = verify(logits, chain(toks), s, jax.random.key(5))
    b = verify(logits, _tree_rows([-1, 0, 1], np.asarray(toks), 1), s, jax.random.key(5))
    assert np.asarray(a.path_tokens).tolist() == np.asarray(b.path_tokens).tolist()


def test_ancestor_mask_of_a_tree():
    m = np.asarray(ancestor_mask(jnp.asarray([[-1, -1, 0, 2]]), 3))[0].astype(int)
    # inputs: root, n0, n1, n2 (child of n0), n3 (child of n2)
    assert m.tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0],
                          [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]]


def test_static_tree_and_tree_errors():
    parents, depth, choice = static_tree([[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    assert parents.tolist() == [-1, -1, 0, 0, 2]
    assert depth.tolist() == [1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="no parent path"):
        static_tree([[0, 1]])
    with pytest.raises(ValueError, match="at least one path"):
        static_tree([])
    with pytest.raises(ValueError, match="at least one node"):
        check_tree(chain(jnp.zeros((2, 1), jnp.int32)).replace(
            tokens=jnp.zeros((2, 0), jnp.int32)))
    with pytest.raises(ValueError, match="k=0"):
        chain(jnp.zeros((2, 0), jnp.int32))
    with pytest.raises(ValueError, match="method='bogus'"):
        verify(jnp.zeros((1, 2, V)), chain(jnp.zeros((1, 1), jnp.int32)), Sampling.create(),
               jax.random.key(0), method="bogus")


@pytest.mark.parametrize("temperature, top_p", [(0.0, 1.0), (1.0, 0.9)])
def test_no_draft_step_is_a_plain_decode_step(temperature, top_p):
    """`verify_no_draft` (a step whose tree has no valid node) equals `verify` on that
    empty tree: nothing accepted, and the root's token is the target's own (greedy:
    its argmax; sampled: its distribution, by chi-square)."""
    from specjax.verify import verify_no_draft

    logits = jnp.asarray(np.broadcast_to(_dist(3, 0.7), (ROWS, V)), jnp.float32)
    tree = _tree_rows([-1, 0], np.tile([1, 2], (ROWS, 1)), ROWS)
    tree = tree.replace(valid=jnp.zeros_like(tree.valid))
    samp = Sampling.create(temperature=temperature, top_p=top_p)
    key = jax.random.PRNGKey(7)
    got = verify_no_draft(logits, tree, samp, key)
    ref = verify(jnp.stack([logits, logits, logits], axis=1), tree, samp, key)
    assert (np.asarray(got.num_accepted) == 0).all() and (np.asarray(got.accepted) == -1).all()
    assert (np.asarray(got.path_inputs) == 0).all()
    assert (np.asarray(got.path_tokens[:, 1:]) == 0).all()
    if temperature == 0:
        np.testing.assert_array_equal(got.path_tokens, ref.path_tokens)
        assert (np.asarray(got.bonus) == int(np.argmax(_dist(3, 0.7)))).all()
    else:
        want = np.asarray(probs(logits[:1], samp))[0]
        assert_same_distribution([int(x) for x in np.asarray(got.bonus)],
                                 {t: float(p) for t, p in enumerate(want) if p > 0})


def test_draft_probs_need_a_sampled_tree():
    """The draft-distribution contract: a tree carries draft_probs only if its builder
    declares every node an independent draw from them (`sampled=True`); top-k children
    with a q attached are refused wherever a tree is built, checked or verified."""
    toks = jnp.zeros((2, 3), jnp.int32)
    q = jnp.full((2, 3, V), 1.0 / V)
    with pytest.raises(ValueError, match="must declare sampled=True"):
        chain(toks, draft_probs=q)
    with pytest.raises(ValueError, match="needs the draft_probs"):
        chain(toks, sampled=True)
    topk = _tree_rows([-1, -1, -1], toks, 2).replace(draft_probs=q)  # sampled=False
    for refuse in (check_tree, lambda t: verify(jnp.zeros((2, 4, V)), t, Sampling.create(1.0),
                                                jax.random.key(0))):
        with pytest.raises(ValueError, match="must declare sampled=True"):
            refuse(topk)
    check_tree(chain(toks, draft_probs=q, sampled=True))  # the honest declaration passes


def test_block_verification_takes_chains_only():
    """Block verification judges a chain: a tree with siblings is refused by name where its
    parents are known; traced, a node off the chain (parent not the node before) is never
    accepted, so the output stays the target's."""
    s = Sampling.create(1.0)
    tree = _tree_rows([-1, -1, 1], np.asarray([[2, 3, 4]] * ROWS), ROWS)
    logits = jnp.broadcast_to(jnp.asarray(np.stack([_dist(30 + i) for i in range(4)])),
                              (ROWS, 4, V))
    with pytest.raises(ValueError, match="block verification needs a chain"):
        verify(logits, tree, s, jax.random.key(0), method="block")
    res = jax.jit(lambda lg, tr, k: verify(lg, tr, s, k, method="block"))(
        logits, tree, jax.random.key(0))
    acc = np.asarray(res.accepted)
    assert set(acc[:, 0].tolist()) == {-1, 0} and np.all(acc[:, 1] == -1)
    p = np.asarray(probs(logits[0, 0], s), np.float64)
    assert_same_distribution([(int(t),) for t in np.asarray(res.path_tokens[:, 0])],
                             {(t,): p[t] for t in range(V)})
