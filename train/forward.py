"""Plain causal forwards of a specjax model for training (no KV cache)."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

from specjax.config import ModelConfig
from specjax.model import module_for, step
from specjax.models.transformer import Hidden, Transformer


def positions_for(tokens: jax.Array) -> jax.Array:
    """RoPE positions 0..T-1 for every row of tokens [B, T]."""
    b, t = tokens.shape
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


def causal_forward(config: ModelConfig, params: Any, tokens: jax.Array, *,
                   hidden_layers: Sequence[int] = (), return_logits: bool = True
                   ) -> tuple[jax.Array | None, Hidden]:
    """(float32 logits [B, T, V] or None, hidden states) of a causal pass over tokens [B, T]."""
    logits, hidden, _ = step(config, params, None, tokens, positions_for(tokens),
                             hidden_layers=tuple(hidden_layers), return_logits=return_logits)
    return logits, hidden


def causal_logits(config: ModelConfig, params: Any, tokens: jax.Array) -> jax.Array:
    """Float32 logits [B, T, V]."""
    return causal_forward(config, params, tokens)[0]


def head_logits(config: ModelConfig, params: Any, h: jax.Array) -> jax.Array:
    """The LM head on final-normed hidden states [..., D] -> float32 logits [..., V]."""
    return module_for(config).apply({"params": params}, h, method=Transformer.logits)
