"""`specjax.sampling.categorical`: inverse transform sampling over blocks of the vocabulary
draws each entry with its weight's share, never one of weight 0, for one key or a key
per row."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import sampling
from specjax.sampling import CATEGORICAL_BLOCK, Sampling, categorical, categorical_rows
from tests.stat_utils import assert_same_distribution

DRAWS = 40_000


def _log_weights(v: int, seed: int) -> np.ndarray:
    """[v] log-weights over several blocks (the last one partial): every 7th entry and the
    whole second block -inf, the rest unnormalized and spread over ~8 nats."""
    x = np.random.default_rng(seed).normal(size=v) * 2.0 + 3.0
    x[::7] = -np.inf
    x[CATEGORICAL_BLOCK:2 * CATEGORICAL_BLOCK] = -np.inf
    return x.astype(np.float32)


def _exact(log_w: np.ndarray) -> dict:
    p = np.exp(log_w.astype(np.float64) - np.max(log_w))
    p /= p.sum()
    return {(i,): float(p[i]) for i in np.flatnonzero(p > 0)}


def _draws(log_w: np.ndarray, n: int = DRAWS, seed: int = 0) -> np.ndarray:
    keys = jax.random.split(jax.random.key(seed), n)
    rows = jnp.broadcast_to(jnp.asarray(log_w), (n, log_w.shape[0]))
    return np.asarray(jax.jit(categorical_rows)(keys, rows))


@pytest.mark.parametrize("v", [3 * CATEGORICAL_BLOCK + 88, 2 * CATEGORICAL_BLOCK])
def test_draws_follow_the_weights_and_skip_zero_weights(v):
    log_w = _log_weights(v, seed=v)
    draws = _draws(log_w)
    assert not np.isin(draws, np.flatnonzero(~np.isfinite(log_w))).any()
    assert_same_distribution([(int(t),) for t in draws], _exact(log_w))


def test_a_shifted_draw_fails_the_same_check():
    """The chi-square above can fail on its own: the same draws moved to the next entry
    of positive weight stay inside the support, yet follow the weights one entry off."""
    log_w = _log_weights(3 * CATEGORICAL_BLOCK + 88, seed=1)
    support = np.flatnonzero(np.isfinite(log_w))
    following = np.roll(support, -1)  # each entry of the support -> the next one
    shifted = following[np.searchsorted(support, _draws(log_w))]
    with pytest.raises(AssertionError, match="chi-square"):
        assert_same_distribution([(int(t),) for t in shifted], _exact(log_w))


@pytest.mark.parametrize("at", [0, CATEGORICAL_BLOCK - 1, CATEGORICAL_BLOCK, 700])
def test_a_point_mass_is_always_drawn(at):
    log_w = np.full(701, -np.inf, np.float32)
    log_w[at] = -50.0  # far below 0: the draw does not need normalized weights
    assert set(_draws(log_w, n=500).tolist()) == {at}


def test_a_draw_past_the_rounded_total_lands_on_the_last_positive_weight():
    """Where rounding leaves the target at or past the last running sum, the last entry of
    weight > 0 is drawn, never a zero-weight one after it."""
    weights = jnp.asarray([[0.0, 1.0, 2.0, 0.0, 0.0]])
    ends = jnp.cumsum(weights, axis=-1)
    past = sampling._first_past(ends, jnp.asarray([3.0]), weights)
    inside = sampling._first_past(ends, jnp.asarray([0.5]), weights)
    assert past.tolist() == [2] and inside.tolist() == [1]


def test_one_key_draws_each_leading_index_independently():
    log_w = jnp.zeros((6, 5, 300))  # uniform over 300 entries
    draws = np.asarray(categorical(jax.random.key(4), log_w))
    assert draws.shape == (6, 5) and draws.dtype == np.int32
    assert len(set(draws.ravel().tolist())) > 20  # 30 draws from 300: nearly all distinct
    again = np.asarray(categorical(jax.random.key(4), log_w))
    assert (draws == again).all()


def test_sampled_rows_keep_top_k_and_greedy():
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(64, 1000)), jnp.float32)
    keys = jax.random.split(jax.random.key(5), 64)
    top = np.asarray(sampling.argmax(logits))
    one = sampling.sample_rows(keys, logits, Sampling.create(1.0, top_k=1))
    greedy = sampling.sample_rows(keys, logits, Sampling.create(0.0))
    free = sampling.sample_rows(keys, logits, Sampling.create(1.0))
    assert (np.asarray(one) == top).all() and (np.asarray(greedy) == top).all()
    assert (np.asarray(free) != top).any()
