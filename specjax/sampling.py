"""Logit processing and sampling: temperature, top-k, top-p and min-p, all with traced
parameters.

`Sampling` holds the four knobs as arrays, so changing them never recompiles. The
distribution a row samples from is `probs(logits, sampling)`; speculative verification
applies the very same function to target and draft logits, which is what keeps
rejection sampling lossless with top-k/top-p/min-p.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class Sampling:
    temperature: jax.Array  # [] float32; 0 = greedy
    top_k: jax.Array  # [] int32; 0 = off
    top_p: jax.Array  # [] float32; 1 = off
    min_p: jax.Array  # [] float32; 0 = off

    @classmethod
    def create(cls, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               min_p: float = 0.0) -> "Sampling":
        validate_sampling(temperature, top_k, top_p, min_p)
        return cls(jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p),
                   jnp.float32(min_p))

    @property
    def greedy(self) -> jax.Array:
        return self.temperature <= 0


def validate_sampling(temperature: float, top_k: int, top_p: float,
                      min_p: float = 0.0) -> None:
    if not temperature >= 0:
        raise ValueError(f"temperature={temperature} must be >= 0")
    if int(top_k) != top_k or top_k < 0:
        raise ValueError(f"top_k={top_k} must be a non-negative integer")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
    if not 0 <= min_p <= 1:
        raise ValueError(f"min_p={min_p} must be in [0, 1]")


def argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (the first maximal index; NaN counts as maximal), int32.

    Why not jnp.argmax: XLA:CPU lowers it to one variadic (value, index) reduce that runs
    several times slower over a 49k vocabulary than the two plain reductions here (a max,
    then the smallest index holding it), and greedy decoding takes one per step and row.
    """
    v = x.shape[-1]
    hit = (x == jnp.max(x, axis=-1, keepdims=True)) | jnp.isnan(x)
    return jnp.min(jnp.where(hit, jnp.arange(v, dtype=jnp.int32), v), axis=-1)


def log_probs(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """logits [..., V] f32 -> log-probabilities after temperature, top-k, top-p, min-p.

    At temperature 0 this is the (log) one-hot of the argmax, so greedy decoding is the
    same distribution machinery with a point mass. The vocabulary sorts of top-k/top-p
    run only when one of them is on (`lax.cond`): they dominate a small model's step.
    """
    logits = logits.astype(jnp.float32)
    v = logits.shape[-1]

    def greedy():
        hot = jnp.arange(v) == argmax(logits)[..., None]
        return jnp.where(hot, 0.0, -jnp.inf)

    return jax.lax.cond(sampling.greedy, greedy,
                        lambda: jax.nn.log_softmax(_tempered(logits, sampling), axis=-1))


def _tempered(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """logits [..., V] over the temperature, top-k, top-p and min-p applied: the
    log-weights a sampled row draws from (unnormalized; `categorical` needs no
    log-softmax)."""
    x = logits.astype(jnp.float32) / sampling.temperature
    filtering = (sampling.top_k > 0) | (sampling.top_p < 1) | (sampling.min_p > 0)
    return jax.lax.cond(filtering, lambda: _filter(x, sampling), lambda: x)


def _filter(x: jax.Array, sampling: Sampling) -> jax.Array:
    """Top-k, top-p, then min-p (transformers' order) on tempered logits x [..., V]:
    filtered-out entries -> float min."""
    v = x.shape[-1]
    neg = jnp.finfo(jnp.float32).min
    # top-k: keep logits >= the k-th largest (ties kept), k = 0 disables.
    desc = -jnp.sort(-x, axis=-1)
    k = jnp.clip(sampling.top_k, 1, v)
    kth = jnp.take(desc, k - 1, axis=-1)[..., None]
    x = jnp.where((sampling.top_k > 0) & (x < kth), neg, x)
    # top-p: keep the smallest prefix of the sorted distribution whose mass reaches p.
    desc = -jnp.sort(-x, axis=-1)
    p_desc = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(p_desc, axis=-1) - p_desc  # mass strictly above each sorted entry
    keep_sorted = before < sampling.top_p
    cutoff = jnp.min(jnp.where(keep_sorted, desc, jnp.inf), axis=-1, keepdims=True)
    x = jnp.where((sampling.top_p < 1) & (x < cutoff), neg, x)
    # min-p: keep entries whose probability is at least min_p times the largest one's
    # (p_i >= min_p p_max, i.e. x_i >= x_max + log min_p; the largest is always kept).
    floor = jnp.max(x, axis=-1, keepdims=True) + jnp.log(sampling.min_p)
    return jnp.where((sampling.min_p > 0) & (x < floor), neg, x)


def probs(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """The distribution a row samples from: [..., V] float32."""
    return jnp.exp(log_probs(logits, sampling))


def sample(key: jax.Array, logits: jax.Array, sampling: Sampling) -> jax.Array:
    """One token per leading index of `logits` [..., V]; argmax when greedy.

    `lax.cond` runs only the taken branch, so greedy decoding skips the two vocab sorts
    of top-k/top-p and the draw, a large part of a sampled step on CPU.
    """
    def draw(logits):
        return categorical(key, _tempered(logits, sampling))

    def greedy(logits):
        return argmax(logits)

    return jax.lax.cond(sampling.greedy, greedy, draw, logits)


def sample_rows(keys: jax.Array, logits: jax.Array, sampling: Sampling) -> jax.Array:
    """One token per row from logits [B, V] with row b's own key keys[b] ([B] keys): a
    row's draw does not depend on the other rows of its batch. Argmax when greedy."""
    def draw(logits):
        return categorical_rows(keys, _tempered(logits, sampling))

    def greedy(logits):
        return argmax(logits)

    return jax.lax.cond(sampling.greedy, greedy, draw, logits)


# Vocabulary entries per block of `categorical`'s two-level search: about the square root
# of a 49k-152k vocabulary, so both levels' prefix sums stay short.
CATEGORICAL_BLOCK = 256


def categorical(key: jax.Array, log_p: jax.Array) -> jax.Array:
    """int32 [...]: one draw per leading index of log_p [..., V] (log-weights; -inf never
    drawn, no need to normalize), by inverse transform sampling with one uniform per draw.

    Why not `jax.random.categorical`: its Gumbel-max draws a random number and takes two
    logarithms per vocabulary entry, a large part of a sampled step on XLA:CPU at batch
    16. One uniform, the weights' block sums and two short prefix sums (the block, then
    the entry within it, as FlashInfer's sorting-free samplers search) cost a fraction
    of that (docs/benchmarks.md, "Where a decode step's time goes").
    An entry is drawn with its weight's share of the total, up to float32 rounding of the
    sums; an entry of weight 0 is never drawn."""
    lead, v = log_p.shape[:-1], log_p.shape[-1]
    u = jax.random.uniform(key, lead, jnp.float32)
    blocks = -(-v // CATEGORICAL_BLOCK)
    x = log_p.astype(jnp.float32).reshape(-1, v)
    top = jnp.max(x, axis=-1, keepdims=True)
    w = jnp.exp(x - jnp.where(jnp.isfinite(top), top, 0.0))  # [R, V], the largest 1
    w = jnp.pad(w, ((0, 0), (0, blocks * CATEGORICAL_BLOCK - v)))
    w = w.reshape(-1, blocks, CATEGORICAL_BLOCK)  # [R, blocks, block]
    sums = jnp.sum(w, axis=-1)  # [R, blocks]
    ends = jnp.cumsum(sums, axis=-1)
    target = u.reshape(-1) * ends[:, -1]  # [R]: where the draw falls in the total mass
    b = _first_past(ends, target, sums)
    start = jnp.where(b > 0, jnp.take_along_axis(ends, jnp.maximum(b - 1, 0)[:, None],
                                                 axis=1)[:, 0], 0.0)
    inner = jnp.take_along_axis(w, b[:, None, None], axis=1)[:, 0]  # [R, block]
    i = _first_past(jnp.cumsum(inner, axis=-1), target - start, inner)
    return (b * CATEGORICAL_BLOCK + i).reshape(lead)


def _first_past(ends: jax.Array, target: jax.Array, weights: jax.Array) -> jax.Array:
    """[R] int32: the first index whose running sum ends [R, N] exceeds target [R] (an
    entry of weight 0 ends where the one before it does, so it is never the first past),
    or, where rounding left target at or past the last sum, the last entry of weight >
    0 (0 if none)."""
    idx = jnp.arange(ends.shape[-1], dtype=jnp.int32)
    first = jnp.sum(ends <= target[:, None], axis=-1, dtype=jnp.int32)
    last = jnp.max(jnp.where(weights > 0, idx, 0), axis=-1)
    return jnp.minimum(first, last)


def categorical_rows(keys: jax.Array, log_p: jax.Array) -> jax.Array:
    """[B] int32: row b drawn from log-probabilities log_p[b] [V] with keys[b]."""
    return jax.vmap(categorical)(keys, log_p)


def uniform_rows(keys: jax.Array, n: int) -> jax.Array:
    """[B, n] float32 uniforms in [0, 1): entry (b, i) from keys[b] folded with i, so it
    does not depend on n (a wider draft tree leaves the first nodes' draws unchanged)."""
    def row(k):
        return jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(k, i)))(jnp.arange(n))

    return jax.vmap(row)(keys)
