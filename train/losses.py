"""Token-level losses and metrics, each a masked mean over [B, T] positions.

Distillation divergences compare the frozen target's distribution p with the draft's
q at every position (DistillSpec, Zhou et al. 2024):
  forward KL  KL(p || q) = sum p (log p - log q)   mass-covering; the classic KD loss
  reverse KL  KL(q || p) = sum q (log q - log p)   mode-seeking
  TVD         1/2 sum |p - q|                       1 - TVD is the acceptance rate of
                                                    speculative sampling at that position
Logits are float32 [B, T, V]; `temperature` divides both sides' logits.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of x [B, T] over positions where mask [B, T] is 1 (0 if none are)."""
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean next-token CE; logits [B, T, V], targets [B, T] int, mask [B, T]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return masked_mean(nll, mask)


def accuracy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    return masked_mean((jnp.argmax(logits, -1) == targets).astype(jnp.float32), mask)


def _log_probs(target_logits, draft_logits, temperature):
    return (jax.nn.log_softmax(target_logits.astype(jnp.float32) / temperature, axis=-1),
            jax.nn.log_softmax(draft_logits.astype(jnp.float32) / temperature, axis=-1))


def forward_kl(target_logits, draft_logits, mask, temperature: float = 1.0) -> jax.Array:
    logp, logq = _log_probs(target_logits, draft_logits, temperature)
    return masked_mean(jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1), mask)


def reverse_kl(target_logits, draft_logits, mask, temperature: float = 1.0) -> jax.Array:
    logp, logq = _log_probs(target_logits, draft_logits, temperature)
    return masked_mean(jnp.sum(jnp.exp(logq) * (logq - logp), axis=-1), mask)


def total_variation(target_logits, draft_logits, mask, temperature: float = 1.0) -> jax.Array:
    logp, logq = _log_probs(target_logits, draft_logits, temperature)
    return masked_mean(0.5 * jnp.sum(jnp.abs(jnp.exp(logp) - jnp.exp(logq)), axis=-1), mask)


DIVERGENCES: dict[str, Callable[..., jax.Array]] = {
    "forward_kl": forward_kl,
    "reverse_kl": reverse_kl,
    "tvd": total_variation,
}


def divergence(name: str) -> Callable[..., jax.Array]:
    if name not in DIVERGENCES:
        raise ValueError(f"divergence={name!r} is not one of {sorted(DIVERGENCES)}")
    return DIVERGENCES[name]


def top1_agreement(target_logits, draft_logits, mask) -> jax.Array:
    """Share of positions where the draft's argmax is the target's: the greedy acceptance proxy."""
    same = jnp.argmax(target_logits, -1) == jnp.argmax(draft_logits, -1)
    return masked_mean(same.astype(jnp.float32), mask)
