"""A plain jitted sampler for target-generated training text.

It recomputes the whole causal forward for every new token (no KV cache), which
costs O(G * (P + G)^2) attention for G new tokens after a P-token prompt: fine for
the small targets distillation runs here use, and independent of the generation
engine in `specjax/` (which can replace it once it lands).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from specjax.config import ModelConfig
from specjax.train.forward import causal_forward, head_logits


def sample_next(logits: jax.Array, rng: jax.Array, temperature: float) -> jax.Array:
    """Token ids [B] from logits [B, V]; temperature 0 is greedy."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(rng, logits / temperature, axis=-1).astype(jnp.int32)


def sample_continuation(config: ModelConfig, params: Any, prompts: jax.Array, num_new: int,
                        rng: jax.Array, temperature: float = 1.0) -> jax.Array:
    """prompts [B, P] int32 -> [B, P + num_new]: the prompt and the target's continuation."""
    b, p = prompts.shape
    if p < 1:
        raise ValueError("sample_continuation needs a prompt of at least one token")
    buf = jnp.concatenate([prompts.astype(jnp.int32), jnp.zeros((b, num_new), jnp.int32)], 1)

    def body(i, buf):
        _, hidden = causal_forward(config, params, buf, return_logits=False)
        h = jax.lax.dynamic_index_in_dim(hidden.final, p + i - 1, axis=1, keepdims=False)
        tok = sample_next(head_logits(config, params, h), jax.random.fold_in(rng, i), temperature)
        return jax.lax.dynamic_update_slice_in_dim(buf, tok[:, None], p + i, axis=1)

    return jax.lax.fori_loop(0, num_new, body, buf)


sample = functools.partial(jax.jit, static_argnames=("config", "num_new", "temperature"))(
    sample_continuation)
