"""Exact target distributions and a chi-square comparison, for losslessness tests."""


import jax.numpy as jnp
import numpy as np
from scipy import stats

import specjax
from specjax.sampling import Sampling, probs


def exact_joint(model, prompt, n, temperature, top_p=1.0, top_k=0, min_p=0.0):
    """{(t1..tn): probability} of the target's first n sampled tokens, by enumeration."""
    v = model.config.vocab_size
    s = Sampling.create(temperature, top_k, top_p, min_p)
    out = {(): 1.0}
    for _ in range(n):
        seqs = list(out)
        batch = np.asarray([list(prompt) + list(x) for x in seqs])
        logits = specjax.forward(model, batch)[:, -1]
        p = np.asarray(probs(jnp.asarray(logits), s), np.float64)
        nxt = {}
        for i, x in enumerate(seqs):
            for t in range(v):
                if p[i, t] > 0:
                    nxt[x + (t,)] = out[x] * p[i, t]
        out = nxt
    return out


def _cells(exact, n, min_expected):
    """The chi-square cells: each outcome of expectation >= min_expected on its own, the
    rest pooled. Returns a function from {outcome: weight} to the cells' weights."""
    big = [x for x, p in exact.items() if p * n >= min_expected]
    small = [x for x, p in exact.items() if p * n < min_expected]

    def group(weights):
        out = [weights.get(x, 0) for x in big]
        return out + [sum(weights.get(x, 0) for x in small)] if small else out

    return group


def assert_same_distribution(samples, exact, min_expected=5.0, alpha=1e-3):
    """Chi-square goodness of fit; cells with small expectation pooled into one."""
    n = len(samples)
    counts = {}
    for x in samples:
        counts[x] = counts.get(x, 0) + 1
    outside = [x for x in counts if x not in exact]
    assert not outside, f"samples outside the target's support: {outside[:5]}"
    group = _cells(exact, n, min_expected)
    obs = group(counts)
    exp = np.asarray(group(exact), np.float64) * n
    exp = exp * (n / np.sum(exp))
    chi2, pval = stats.chisquare(obs, exp)
    assert pval > alpha, f"chi-square p={pval:.2e} (chi2={chi2:.1f}, {len(obs)} cells)"
    return pval


def chi_square_power(exact, alt, n, min_expected=5.0, alpha=1e-3):
    """Probability that `assert_same_distribution` on n samples drawn from `alt` fails
    against `exact`: the noncentral chi-square with noncentrality n·Σ(alt - exact)²/exact
    over the test's own cells (the standard large-sample power of Pearson's test)."""
    group = _cells(exact, n, min_expected)
    p0, p1 = np.asarray(group(exact), np.float64), np.asarray(group(alt), np.float64)
    df = len(p0) - 1
    nc = n * np.sum((p1 - p0) ** 2 / p0)
    return float(stats.ncx2.sf(stats.chi2.isf(alpha, df), df, nc))
