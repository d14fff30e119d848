"""Plain causal forwards of a specjax model for training (no KV cache), and the frozen
target's hidden states that head methods read: computed here (online) or carried by the
batch (offline features dumped by `specjax.train.features`)."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

from specjax.config import ModelConfig
from specjax.model import module_for, step
from specjax.models.transformer import Hidden, Transformer
from specjax.speculators.draft_model import trimmed_head

# Batch keys of offline features (`specjax.train.features.OfflineData`), beside tokens and mask:
FINAL_KEY = "target_final"  # [B, T, D] the target's final-normed hidden state
LAYERS_KEY = "target_layers"  # [B, T, K, D] outputs of the K decoder layers a method asks for


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


def frozen_hidden(config: ModelConfig, params: Any, batch: dict, layers: Sequence[int] = ()
                  ) -> Hidden:
    """The frozen target's hidden states over `batch["tokens"]`: the final-normed state and
    the outputs of decoder `layers` (in that order). Read from the batch when it carries
    offline features, else computed by a causal forward of `params`; either way a constant
    for differentiation, in the target's compute dtype."""
    layers = tuple(layers)
    if FINAL_KEY not in batch:
        _, hidden = causal_forward(config, params, batch["tokens"], hidden_layers=layers,
                                   return_logits=False)
        return jax.lax.stop_gradient(hidden)
    dt = jnp.dtype(config.dtype)
    stacked = batch.get(LAYERS_KEY)
    have = 0 if stacked is None else stacked.shape[2]
    if have != len(layers):
        raise ValueError(f"offline features carry {have} decoder layers; {layers=} are needed")
    return Hidden(final=batch[FINAL_KEY].astype(dt),
                  layers=tuple(stacked[:, :, k].astype(dt) for k in range(have)))


def kept_logits(config: ModelConfig, params: Any, h: jax.Array, ids: jax.Array) -> jax.Array:
    """The LM head at target ids `ids` [Vk] only (a draft vocabulary): final-normed hidden
    h [..., D] -> float32 logits [..., Vk], by the head's columns at `ids` as a trimmed
    draft model takes them (`draft_model.trimmed_head`). Their softmax is the whole
    distribution restricted to `ids` and renormalised, for Vk of the V columns' work."""
    head = trimmed_head(config, params, ids)  # [D, Vk]
    return jnp.einsum("...D,DV->...V", h, head.astype(h.dtype),
                      preferred_element_type=jnp.float32)
