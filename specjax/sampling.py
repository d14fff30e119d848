"""Logit processing and sampling: temperature, top-k, top-p, all with traced parameters.

`Sampling` holds the three knobs as arrays, so changing them never recompiles. The
distribution a row samples from is `probs(logits, sampling)`; speculative verification
applies the very same function to target and draft logits, which is what keeps
rejection sampling lossless with top-k/top-p.
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

    @classmethod
    def create(cls, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> "Sampling":
        validate_sampling(temperature, top_k, top_p)
        return cls(jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p))

    @property
    def greedy(self) -> jax.Array:
        return self.temperature <= 0


def validate_sampling(temperature: float, top_k: int, top_p: float) -> None:
    if not temperature >= 0:
        raise ValueError(f"temperature={temperature} must be >= 0")
    if int(top_k) != top_k or top_k < 0:
        raise ValueError(f"top_k={top_k} must be a non-negative integer")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")


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
    """logits [..., V] f32 -> log-probabilities after temperature, top-k and top-p.

    At temperature 0 this is the (log) one-hot of the argmax, so greedy decoding is the
    same distribution machinery with a point mass. The vocabulary sorts of top-k/top-p
    run only when one of them is on (`lax.cond`): they dominate a small model's step.
    """
    logits = logits.astype(jnp.float32)
    v = logits.shape[-1]

    def greedy():
        hot = jnp.arange(v) == argmax(logits)[..., None]
        return jnp.where(hot, 0.0, -jnp.inf)

    def tempered():
        x = logits / sampling.temperature
        filtering = (sampling.top_k > 0) | (sampling.top_p < 1)
        return jax.nn.log_softmax(jax.lax.cond(filtering, lambda: _filter(x, sampling),
                                               lambda: x), axis=-1)

    return jax.lax.cond(sampling.greedy, greedy, tempered)


def _filter(x: jax.Array, sampling: Sampling) -> jax.Array:
    """Top-k then top-p on tempered logits x [..., V]: filtered-out entries -> float min."""
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
    return jnp.where((sampling.top_p < 1) & (x < cutoff), neg, x)


def probs(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """The distribution a row samples from: [..., V] float32."""
    return jnp.exp(log_probs(logits, sampling))


def sample(key: jax.Array, logits: jax.Array, sampling: Sampling) -> jax.Array:
    """One token per leading index of `logits` [..., V]; argmax when greedy.

    `lax.cond` runs only the taken branch, so greedy decoding skips the two vocab sorts
    of top-k/top-p and the Gumbel noise, a large part of a sampled step on CPU.
    """
    def draw(logits):
        return categorical(key, log_probs(logits, sampling))

    def greedy(logits):
        return argmax(logits)

    return jax.lax.cond(sampling.greedy, greedy, draw, logits)


def sample_rows(keys: jax.Array, logits: jax.Array, sampling: Sampling) -> jax.Array:
    """One token per row from logits [B, V] with row b's own key keys[b] ([B] keys): a
    row's draw does not depend on the other rows of its batch. Argmax when greedy."""
    def draw(logits):
        return categorical_rows(keys, log_probs(logits, sampling))

    def greedy(logits):
        return argmax(logits)

    return jax.lax.cond(sampling.greedy, greedy, draw, logits)


def categorical(key: jax.Array, log_p: jax.Array) -> jax.Array:
    """int32 [...]: one draw per leading index of log_p [..., V], the same draw as
    `jax.random.categorical(key, log_p)` (argmax of Gumbel noise plus log_p), with
    `argmax` in place of its slow variadic reduce on XLA:CPU."""
    return argmax(jax.random.gumbel(key, log_p.shape, log_p.dtype) + log_p)


def categorical_rows(keys: jax.Array, log_p: jax.Array) -> jax.Array:
    """[B] int32: row b drawn from log-probabilities log_p[b] [V] with keys[b]."""
    return jax.vmap(categorical)(keys, log_p)


def uniform_rows(keys: jax.Array, n: int) -> jax.Array:
    """[B, n] float32 uniforms in [0, 1): entry (b, i) from keys[b] folded with i, so it
    does not depend on n (a wider draft tree leaves the first nodes' draws unchanged)."""
    def row(k):
        return jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(k, i)))(jnp.arange(n))

    return jax.vmap(row)(keys)
