"""Rotary position embeddings (RoPE) with the scalings of published Llama-family configs.

Follows Hugging Face's "rotate half" layout (the first and second halves of head_dim
form the rotated pairs), so converted checkpoints need no permutation. Frequencies are
computed in float32 as transformers does, so logits agree to float32 rounding.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig


def inv_frequencies(config: ModelConfig) -> tuple[np.ndarray, float]:
    """Returns (inv_freq [H/2] float32, attention_factor) for the config's RoPE scaling."""
    dim = config.head_dim
    base = config.rope_theta
    inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    inv_freq = inv_freq.astype(np.float32)
    scaling = config.rope_scaling_dict
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32), 1.0
    if rope_type == "dynamic":
        # Dynamic NTK only changes frequencies beyond the original context; within it
        # (all specjax supports for it) it equals the default.
        return inv_freq, 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if rope_type == "yarn":
        return _yarn(config, scaling)
    raise ValueError(f"rope_type={rope_type!r} is not supported")


def _llama3(inv_freq: np.ndarray, s: dict) -> np.ndarray:
    factor = s["factor"]
    low, high = s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(config: ModelConfig, s: dict) -> tuple[np.ndarray, float]:
    dim, base, factor = config.head_dim, config.rope_theta, s["factor"]
    orig = s.get("original_max_position_embeddings") or config.max_position_embeddings

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    extra, inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    inv_freq = inter * (1 - keep) + extra * keep
    return inv_freq.astype(np.float32), float(attention_factor)


def rope_tables(config: ModelConfig, positions: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos, sin for `positions` [B, T] -> each [B, T, H] float32 (attention factor folded in)."""
    inv_freq, factor = inv_frequencies(config)
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, H/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [B, T, H]
    return jnp.cos(emb) * factor, jnp.sin(emb) * factor


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """x [B, T, heads, H] rotated by cos/sin [B, T, H]; computed in float32, returned in x.dtype."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)
