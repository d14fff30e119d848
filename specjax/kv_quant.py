"""int8 KV: symmetric per-token quantization of keys and values, one float32 scale each.

An int8 cache (`generate(..., kv_cache_dtype="int8")`) stores every key and value
vector [H] of one token and KV head as int8 with one float32 scale, max|x| / 127: about
half the bytes of bf16 (H + 4 against 2H), so twice the tokens fit and attention reads
half as much. Attention dequantizes to the compute dtype (`dequantize`), in the Pallas
kernel block by block and in the jnp reference after the gather.

The same token is seen the same way on every path: a step that keeps its new keys out
of the cache (`fake_quantize`) sees what a step that wrote and read them back sees, so
speculative decoding stays exactly lossless against the int8-cache target.
"""

from __future__ import annotations

import jax.numpy as jnp

from specjax.typing import FloatVectors, Int8Vectors, VectorScales

INT8_MAX = 127.0
KV_CACHE_DTYPES = ("int8",)  # besides float dtypes (which store the values as they are)


def quantize(x: FloatVectors) -> tuple[Int8Vectors, VectorScales]:
    """[..., H] float -> (int8 [..., H], float32 scales [...]): symmetric, per vector."""
    xf = x.astype(jnp.float32)
    scales = jnp.max(jnp.abs(xf), axis=-1) / INT8_MAX
    q = jnp.round(xf / jnp.where(scales > 0, scales, 1.0)[..., None])
    return jnp.clip(q, -INT8_MAX, INT8_MAX).astype(jnp.int8), scales


def dequantize(q: Int8Vectors, scales: VectorScales, dtype) -> FloatVectors:
    """int8 [..., H] x scales [...] -> `dtype` (float32 product, then the cast)."""
    return (q.astype(jnp.float32) * scales[..., None]).astype(dtype)


def fake_quantize(x: FloatVectors) -> FloatVectors:
    """`x` as an int8 cache hands it back: quantized, then dequantized to x's dtype."""
    return dequantize(*quantize(x), x.dtype)


def as_cached(x: FloatVectors, page_dtype) -> FloatVectors:
    """`x` as pages of `page_dtype` hand it back, in x's dtype: int8 quantized and
    dequantized (`fake_quantize`), a float dtype cast to it and back (bfloat16 pages
    under float32 keys round them)."""
    if is_quantized(page_dtype):
        return fake_quantize(x)
    return x.astype(page_dtype).astype(x.dtype)


def is_quantized(dtype) -> bool:
    """Whether a cache of `dtype` stores int8 with scales ("int8"), not the values as is."""
    return jnp.dtype(dtype) == jnp.int8


def check_kv_cache_dtype(kv_cache_dtype) -> jnp.dtype | None:
    """None (the model's dtype), a float dtype, or "int8"; anything else raises naming it."""
    if kv_cache_dtype is None:
        return None
    try:
        dt = jnp.dtype(kv_cache_dtype)
    except TypeError:
        dt = None
    if dt is None or not (is_quantized(dt) or jnp.issubdtype(dt, jnp.floating)):
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} must be None, a float dtype "
                         f"(float32, bfloat16, ...) or one of {KV_CACHE_DTYPES}")
    return dt
