"""Losslessness proved exactly: float64 enumeration of every draft draw and every
accept/reject outcome on tiny tabulated models (tests/exact_verify.py), for chains,
i.i.d. sampled trees, top-k point-mass trees and block verification, under temperature,
top-k, top-p and min-p; the realistic wrong variants shown to depart; then specjax's own
`verify` sampled against the exact step distributions, with the power to see the
smallest of those departures."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import verify as verify_lib
from specjax.sampling import Sampling, probs, sample
from specjax.tree import DraftTree
from specjax.verify import verify, verify_greedy, verify_typical
from tests.exact_verify import (
    Spec,
    Table,
    chain_shape,
    draw_rows,
    emitted,
    expected_accepted,
    step_dist,
    target_joint,
    tree_nodes,
    tv,
    warp,
)
from tests.stat_utils import assert_same_distribution, chi_square_power

V = 5
TARGET, DRAFT = Table(0, V), Table(1, V)
WARPS = [dict(temperature=1.0), dict(temperature=0.7), dict(temperature=1.0, top_k=3),
         dict(temperature=0.8, top_p=0.8), dict(temperature=0.9, top_k=4, top_p=0.9),
         dict(temperature=1.0, min_p=0.2), dict(temperature=0.9, top_p=0.9, min_p=0.3)]
TREE = (((), ()), ((),), ())  # three root children: two, one and no children of their own
CASES = {  # (shape, draw, method)
    "chain": (chain_shape(3), "sampled", "rejection"),
    "chain_block": (chain_shape(3), "sampled", "block"),
    "point_chain": (chain_shape(3), "topk", "rejection"),
    "point_chain_block": (chain_shape(3), "topk", "block"),
    "iid_tree": (TREE, "sampled", "rejection"),
    "topk_tree": (TREE, "topk", "rejection"),
}


def _spec(case, warp_kw, **kw):
    shape, draw, method = CASES[case]
    return Spec(TARGET, DRAFT, shape=shape, draw=draw, method=method, **warp_kw, **kw)


@pytest.mark.parametrize("warp_kw", WARPS, ids=lambda w: "-".join(f"{k}{v}" for k, v in
                                                                  w.items()))
@pytest.mark.parametrize("case", list(CASES))
def test_verification_is_exactly_the_target(case, warp_kw):
    spec = _spec(case, warp_kw)
    for n in (1, 2):
        assert tv(emitted(spec, n), target_joint(spec, n)) <= 1e-12, n
    assert 0 < sum(step_dist(spec).values()) == pytest.approx(1.0, abs=1e-12)


def test_the_numpy_warp_is_specjax_s():
    """The enumeration's float64 warp is `sampling.probs` (float32) on every table row."""
    for path in [(), (1,), (2, 3), (4, 0, 1)]:
        logits = TARGET.logits(path)
        for w in WARPS:
            got = np.asarray(probs(jnp.asarray(logits, jnp.float32), Sampling.create(**w)))
            np.testing.assert_allclose(got, warp(logits, **w), atol=1e-6)


@pytest.mark.parametrize("warp_kw", WARPS, ids=lambda w: "-".join(f"{k}{v}" for k, v in
                                                                  w.items()))
def test_block_never_accepts_fewer_than_tokenwise(warp_kw):
    """From every context (each path of up to two tokens), block verification's exact
    expected accepted count over the draft's draws is at least token-wise rejection's
    on a sampled depth-3 chain, and strictly more somewhere; for point-mass chains the
    two are equal. (Per single draft block it can be less: a block whose later drafts
    are unlikely gives up some of its first token's acceptance to keep the output
    exact; the guarantee is in expectation over the draws.)"""
    import itertools

    contexts = [()] + [c for n in (1, 2) for c in itertools.product(range(V), repeat=n)]
    gains = [expected_accepted(_spec("chain_block", warp_kw), c)
             - expected_accepted(_spec("chain", warp_kw), c) for c in contexts]
    assert min(gains) >= -1e-12
    assert max(gains) > 1e-3
    for c in contexts[:6]:
        assert expected_accepted(_spec("point_chain_block", warp_kw), c) == pytest.approx(
            expected_accepted(_spec("point_chain", warp_kw), c), abs=1e-12)


# Realistic bugs and the smallest exact departure (two-token TV) each must show here.
WRONG = [
    ("shared_uniform", "iid_tree", dict(temperature=1.0), 5e-3),
    ("shared_uniform", "iid_tree", dict(temperature=0.7), 2e-3),
    ("no_residual", "chain", dict(temperature=1.0), 0.1),
    ("no_residual", "iid_tree", dict(temperature=1.0, top_k=3), 0.1),
    ("raw_q", "chain", dict(temperature=0.7), 0.02),
    ("raw_q", "iid_tree", dict(temperature=0.8, top_p=0.8), 0.1),
    ("q_for_topk", "topk_tree", dict(temperature=1.0), 0.2),
    ("q_for_topk", "topk_tree", dict(temperature=0.9, top_k=4, top_p=0.9), 0.1),
]


@pytest.mark.parametrize("bug,case,warp_kw,bound", WRONG)
def test_wrong_variants_depart_from_the_target(bug, case, warp_kw, bound):
    spec = _spec(case, warp_kw, bug=bug)
    assert tv(emitted(spec, 2), target_joint(spec, 2)) > bound


def test_q_recorded_for_top_k_children_is_lossy_on_a_small_example():
    """p = (0.6, 0.3, 0.1), q = p, the two top-k children 0 and 1 verified as if drawn
    from q: child 0 is accepted surely, and the first token is never 2."""
    logits = jnp.log(jnp.asarray([[[0.6, 0.3, 0.1]] * 3]))
    tree = DraftTree(jnp.asarray([[0, 1]]), jnp.asarray([[-1, -1]]), jnp.asarray([[1, 1]]),
                     jnp.ones((1, 2), bool), jnp.exp(logits[:, 1:]), max_depth=1, sampled=True)
    res = jax.jit(lambda k: verify(jnp.broadcast_to(logits, (4000, 3, 3)), jax.tree.map(
        lambda x: jnp.broadcast_to(x, (4000,) + x.shape[1:]), tree), Sampling.create(1.0),
        k))(jax.random.key(0))
    assert np.all(np.asarray(res.path_tokens[:, 0]) == 0)  # 0.6 expected
    honest = tree.replace(draft_probs=None, sampled=False)
    res = verify(jnp.broadcast_to(logits, (4000, 3, 3)), jax.tree.map(
        lambda x: jnp.broadcast_to(x, (4000,) + x.shape[1:]), honest), Sampling.create(1.0),
        jax.random.key(0))
    assert_same_distribution([int(t) for t in np.asarray(res.path_tokens[:, 0])],
                              {0: 0.6, 1: 0.3, 2: 0.1})


def test_greedy_ties_take_the_first_argmax():
    """Equal top logits: greedy verification keeps the lower token id, as target-only
    greedy decoding (`jnp.argmax`) does, whichever sibling comes first."""
    logits = jnp.asarray([[[0.0, 2.0, -1.0, 2.0, 1.0], [0.0] * 5, [0.0] * 5]])
    greedy = Sampling.create(0.0)
    plain = int(sample(jax.random.key(0), logits[:, 0], greedy)[0])
    assert plain == 1
    tree = DraftTree(jnp.asarray([[3, 1]]), jnp.asarray([[-1, -1]]), jnp.asarray([[1, 1]]),
                     jnp.ones((1, 2), bool), max_depth=1)
    for res in (verify_greedy(logits, tree), verify(logits, tree, greedy, jax.random.key(0))):
        assert np.asarray(res.path_tokens[0]).tolist()[:1] == [plain]
        assert int(res.accepted[0, 0]) == 1  # the sibling holding token 1


def test_typical_acceptance_departs_and_is_never_the_default():
    """Medusa's typical acceptance is lossy by name: on a top-k tree its first token is
    the most probable passing child, with certainty, not a draw from the target."""
    import inspect

    import specjax
    from specjax.speculators.base import Speculator

    spec = _spec("topk_tree", dict(temperature=1.0))
    parents, ordinal, _ = tree_nodes(TREE)
    tokens, target_logits, _ = draw_rows(spec, 1, seed=0)
    tree = DraftTree(jnp.asarray(tokens, jnp.int32), jnp.asarray([parents], jnp.int32),
                     jnp.asarray([[1, 1, 1, 2, 2, 2]], jnp.int32), jnp.ones((1, 6), bool),
                     max_depth=2)
    res = verify_typical(jnp.asarray(target_logits, jnp.float32), tree, Sampling.create(1.0),
                         jax.random.key(0))
    first = np.zeros(V)
    if int(res.num_accepted[0]):
        first[int(res.path_tokens[0, 0])] = 1.0
    else:
        first = spec.p(())
    assert 0.5 * np.abs(first - spec.p(())).sum() > 0.1
    assert inspect.signature(verify).parameters["method"].default == "rejection"
    assert Speculator.verification == "rejection"
    assert inspect.signature(specjax.generate).parameters["verification"].default is None


# ---- specjax's verify, sampled, against the exact step distributions ------------------
ROWS = 120_000


def _run_verify(spec, rows, seed):
    """specjax's jitted `verify` on `rows` drafts of `spec` in one call; returns each
    row's emitted tokens (accepted drafts, then the bonus)."""
    parents, _, _ = tree_nodes(spec.shape)
    tokens, target_logits, draft_logits = draw_rows(spec, rows, seed)
    depth = np.zeros(len(parents), np.int32)
    for i, par in enumerate(parents):
        depth[i] = 1 if par < 0 else depth[par] + 1
    s = Sampling.create(*spec.warp_args)
    tile = lambda a: jnp.asarray(np.broadcast_to(a, tokens.shape), jnp.int32)  # noqa: E731
    q = probs(jnp.asarray(draft_logits, jnp.float32), s) if spec.draw == "sampled" else None
    tree = DraftTree(jnp.asarray(tokens, jnp.int32), tile(parents), tile(depth),
                     jnp.ones(tokens.shape, bool), q, max_depth=int(depth.max()),
                     sampled=q is not None)
    run = jax.jit(lambda lg, tr, key: verify(lg, tr, s, key, spec.method))
    res = run(jnp.asarray(target_logits, jnp.float32), tree, jax.random.key(seed))
    path, num = np.asarray(res.path_tokens), np.asarray(res.num_accepted)
    return [tuple(row[:k + 1]) for row, k in zip(path.tolist(), num.tolist())]


@pytest.mark.parametrize("case,warp_kw", [
    ("chain", dict(temperature=1.0)), ("chain_block", dict(temperature=0.7)),
    ("chain_block", dict(temperature=1.0, top_k=3)), ("iid_tree", dict(temperature=1.0)),
    ("topk_tree", dict(temperature=0.8, top_p=0.8))])
def test_specjax_verify_samples_the_exact_step(case, warp_kw):
    spec = _spec(case, warp_kw)
    assert_same_distribution(_run_verify(spec, ROWS, seed=1), step_dist(spec))


def test_the_sampling_test_sees_a_shared_uniform(monkeypatch):
    """Three sampled leaf siblings, verified with one uniform for all of them: the exact
    step distributions differ (TV > 0.01), and at ROWS samples the chi-square test has
    power >= 0.999 against that difference (noncentral chi-square over the test's own
    cells), so the same test that passes the honest verifier must reject this one."""
    spec = Spec(TARGET, DRAFT, shape=((), (), ()))
    wrong = Spec(TARGET, DRAFT, shape=((), (), ()), bug="shared_uniform")
    exact, alt = step_dist(spec), step_dist(wrong)
    assert tv(exact, alt) > 0.01
    assert chi_square_power(exact, alt, ROWS) >= 0.999
    assert_same_distribution(_run_verify(spec, ROWS, seed=2), exact)
    shared = lambda keys, n: jnp.repeat(verify_lib.sampling_lib.uniform_rows(keys, 1), n,  # noqa: E731
                                        axis=1)
    monkeypatch.setattr(verify_lib, "_uniforms", shared)
    with pytest.raises(AssertionError, match="chi-square"):
        assert_same_distribution(_run_verify(spec, ROWS, seed=2), exact)
