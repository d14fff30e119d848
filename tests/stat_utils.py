"""Exact target distributions and a chi-square comparison, for losslessness tests."""


import jax.numpy as jnp
import numpy as np
from scipy import stats

import specjax
from specjax.sampling import Sampling, probs


def exact_joint(model, prompt, n, temperature, top_p=1.0, top_k=0):
    """{(t1..tn): probability} of the target's first n sampled tokens, by enumeration."""
    v = model.config.vocab_size
    s = Sampling.create(temperature, top_k, top_p)
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


def assert_same_distribution(samples, exact, min_expected=5.0, alpha=1e-3):
    """Chi-square goodness of fit; cells with small expectation pooled into one."""
    n = len(samples)
    counts = {}
    for x in samples:
        counts[x] = counts.get(x, 0) + 1
    outside = [x for x in counts if x not in exact]
    assert not outside, f"samples outside the target's support: {outside[:5]}"
    obs, exp = [], []
    pool_o, pool_e = 0.0, 0.0
    for x, p in exact.items():
        if p * n >= min_expected:
            obs.append(counts.get(x, 0))
            exp.append(p * n)
        else:
            pool_o += counts.get(x, 0)
            pool_e += p * n
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    exp = np.asarray(exp) * (n / np.sum(exp))
    chi2, pval = stats.chisquare(obs, exp)
    assert pval > alpha, f"chi-square p={pval:.2e} (chi2={chi2:.1f}, {len(obs)} cells)"
    return pval
