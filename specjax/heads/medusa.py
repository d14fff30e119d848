"""Medusa heads (Cai et al. 2024): extra next-next-token heads on the target's last hidden.

Head m (0-based) reads the target's final-normed hidden state h_i of position i and
predicts the token at i + 2 + m (the target's own LM head predicts i + 1). Each head is
`num_residual_layers` ResBlocks `x + silu(x W + b)` followed by its own LM head, as in
the Medusa repo. W and b start at zero and the LM heads as copies of the target's, so
an untrained head predicts what the target's own head predicts; training moves it.

Params are a plain pytree separate from the target (stacked over heads M):
  res_kernel [M, R, D, D], res_bias [M, R, D], lm_head [M, D, V]
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from specjax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class MedusaConfig:
    num_heads: int = 4  # M: head m predicts the token m + 2 after the hidden's position
    num_residual_layers: int = 1  # R: ResBlocks per head (Medusa-1 uses 1)

    def __post_init__(self):
        if self.num_heads < 1 or self.num_residual_layers < 0:
            raise ValueError(f"MedusaConfig needs num_heads >= 1 and num_residual_layers >= 0; "
                             f"got {self.num_heads=}, {self.num_residual_layers=}")


class MedusaHeads(nn.Module):
    """hidden [B, T, D] -> float32 logits [B, T, M, V]."""

    config: MedusaConfig
    hidden_size: int  # D
    vocab_size: int  # V
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, hidden):
        m, r = self.config.num_heads, self.config.num_residual_layers
        d, v = self.hidden_size, self.vocab_size
        w = self.param("res_kernel", nn.initializers.zeros, (m, r, d, d), jnp.float32)
        b = self.param("res_bias", nn.initializers.zeros, (m, r, d), jnp.float32)
        lm = self.param("lm_head", nn.initializers.normal(0.02), (m, d, v), jnp.float32)
        x = jnp.broadcast_to(hidden[:, :, None, :], hidden.shape[:2] + (m, d)).astype(self.dtype)
        for i in range(r):
            y = (jnp.einsum("BTMD,MDE->BTME", x, w[:, i].astype(self.dtype))
                 + b[:, i].astype(self.dtype))
            x = x + nn.silu(y)
        return jnp.einsum("BTMD,MDV->BTMV", x, lm.astype(self.dtype),
                          preferred_element_type=jnp.float32)


def medusa_module(config: MedusaConfig, target_config: ModelConfig) -> MedusaHeads:
    return MedusaHeads(config, target_config.hidden_size, target_config.vocab_size,
                       jnp.dtype(target_config.dtype))


def target_lm_head(target_config: ModelConfig, target_params) -> jax.Array:
    """The target's LM head as a [D, V] matrix (the embedding transposed when tied)."""
    if target_config.tie_word_embeddings:
        return jnp.asarray(target_params["embed_tokens"]["embedding"]).T
    return jnp.asarray(target_params["lm_head"]["kernel"])


def init_medusa_params(config: MedusaConfig, target_config: ModelConfig, target_params,
                       key: jax.Array | int = 0, init_scale: float = 0.0) -> Any:
    """Fresh heads: LM heads copied from the target's; ResBlock kernels zero (Medusa's
    init), or normal(init_scale) to get distinct random heads (tests, ablations)."""
    if isinstance(key, int):
        key = jax.random.key(key)
    m, r, d = config.num_heads, config.num_residual_layers, target_config.hidden_size
    head = target_lm_head(target_config, target_params).astype(jnp.float32)  # [D, V]
    res = jnp.zeros((m, r, d, d), jnp.float32)
    if init_scale > 0:
        res = jax.random.normal(key, res.shape) * init_scale
    return {"res_kernel": res, "res_bias": jnp.zeros((m, r, d), jnp.float32),
            "lm_head": jnp.broadcast_to(head, (m,) + head.shape)}


def medusa_logits(config: MedusaConfig, target_config: ModelConfig, params,
                  hidden: jax.Array) -> jax.Array:
    """hidden [B, T, D] (target final-normed) -> logits [B, T, M, V] float32."""
    return medusa_module(config, target_config).apply({"params": params}, hidden)
