"""The plain-jnp reference of ragged paged attention, beside the kernels it checks.

Same signature and contract as `ragged_paged_attention` (the contract: `specjax.attention`,
the entry point that picks this or a kernel). XLA runs it on CPU; tests and
`specjax.pallas_kernels.bench` hold the kernels to it.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from specjax import kv_quant
from specjax.typing import (
    AllowedMask,
    NewKV,
    Pages,
    PageTable,
    Queries,
    RowKV,
    RowLengths,
    Scales,
    TreeMask,
)


def allowed_mask(
    t_len: int,
    s_len: int,
    kv_lens: RowLengths,
    q_lens: RowLengths,
    mask: TreeMask | None,
    sliding_window: int | None = None,
    first_slot=0,
) -> AllowedMask:
    """Which KV slot each query may see: [B, T, S] bool (the contract above, spelled out),
    for the S slots from `first_slot` (an int or traced [] int32) on."""
    t = jnp.arange(t_len)[None, :, None]  # [1, T, 1]
    j = first_slot + jnp.arange(s_len)[None, None, :]  # [1, 1, S]
    start = (kv_lens - q_lens)[:, None, None]  # [B, 1, 1]
    rel = j - start  # slot relative to the first new token
    in_new = (rel >= 0) & (rel < q_lens[:, None, None])
    if mask is None:
        new_ok = in_new & (rel <= t)
    else:
        idx = jnp.clip(rel, 0, t_len - 1)
        idx = jnp.broadcast_to(idx, (kv_lens.shape[0], t_len, s_len))
        new_ok = in_new & jnp.take_along_axis(mask.astype(bool), idx, axis=2)
    ok = (rel < 0) | new_ok
    if sliding_window is not None:
        ok &= (start + t - j) < sliding_window
    return ok


def attend(
    q: Queries,
    k: RowKV,
    v: RowKV,
    ok: AllowedMask,
    *,
    scale: float,
    soft_cap: float | None = None,
) -> Queries:
    """Masked softmax attention with float32 scores; queries that see nothing output 0."""
    return attend_parts(q, ((k, v, ok),), scale=scale, soft_cap=soft_cap)


def attend_parts(
    q: Queries,
    parts,  # ((k [B, S_i, K, H], v [B, S_i, K, H], ok [B, T, S_i] bool), ...)
    *,
    scale: float,
    soft_cap: float | None = None,
) -> Queries:
    """`attend` over the concatenation of several KV parts, without concatenating them:
    one softmax across all parts (a shared max and denominator). Used to attend to the
    cached prefix and the step's own new keys/values kept out of the cache."""
    qg = grouped_queries(q, parts[0][0].shape[2])
    scores, oks = [], []
    for k, _, ok in parts:
        s = grouped_scores(qg, k, scale, soft_cap)
        okb = ok[None, :, :, None, :]
        scores.append(jnp.where(okb, s, -jnp.inf))
        oks.append(okb)
    m = functools.reduce(jnp.maximum, [jnp.max(s, axis=-1, keepdims=True) for s in scores])
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    probs = [jnp.where(okb, jnp.exp(s - m), 0.0) for s, okb in zip(scores, oks)]
    denom = sum(jnp.sum(p, axis=-1, keepdims=True) for p in probs)
    denom = jnp.where(denom > 0, denom, 1.0)
    out = sum(weighted_values(p / denom, v, ok, q.dtype) for p, (_, v, ok) in zip(probs, parts))
    return ungrouped(out, q)


def grouped_queries(q: Queries, kv_heads: int):
    """q [B, T, N, H] -> [K, B, T, G, H]. The KV heads lead as the batch dim: [K, B, S, H]
    is the order `_gather_rows` reads pages in, so its transpose and this one cancel and
    the matmuls take the gathered pages as they are, without a transposed copy per layer
    on XLA:CPU."""
    b, t, n, h = q.shape
    return jnp.moveaxis(q.reshape(b, t, kv_heads, n // kv_heads, h), 2, 0)


def ungrouped(out, q: Queries) -> Queries:
    """out [K, B, T, G, H] (float32) -> [B, T, N, H] in q's dtype."""
    return jnp.moveaxis(out, 0, 2).reshape(q.shape).astype(q.dtype)


def weighted_values(p, v: RowKV, ok: AllowedMask, q_dtype):
    """Σ_S p v: float32 [K, B, T, G, H] from probabilities p [K, B, T, G, S] and a row's
    values v [B, S, K, H], the slots no query sees (ok [B, T, S]) zeroed first so that
    garbage (NaN) there cannot leak through 0 * NaN. p is cast to the wider of q's and
    v's dtype (bf16 for bf16 q and v; float32 queries keep float32 p over a bf16 cache,
    as the kernel computes in the wider dtype)."""
    v = jnp.where(jnp.any(ok, axis=1)[None, :, :, None], jnp.moveaxis(v, 2, 0),
                  jnp.zeros((), v.dtype))  # [K, B, S, H]
    dt = jnp.promote_types(q_dtype, v.dtype)
    return jnp.einsum("KBTGS,KBSH->KBTGH", p.astype(dt), v.astype(dt),
                      preferred_element_type=jnp.float32)


def grouped_scores(qg, k: RowKV, scale: float, soft_cap: float | None):
    """float32 scores [K, B, T, G, S] of grouped queries qg [K, B, T, G, H] against a
    row's keys k [B, S, K, H], scaled and soft-capped."""
    s = jnp.einsum("KBTGH,KBSH->KBTGS", qg, jnp.moveaxis(k, 2, 0),
                   preferred_element_type=jnp.float32) * scale
    return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)


def reference_ragged_paged_attention(
    q: Queries,
    k_pages: Pages,
    v_pages: Pages,
    page_table: PageTable,
    kv_lens: RowLengths,
    q_lens: RowLengths,
    mask: TreeMask | None = None,
    *,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scales: Scales | None = None,  # float32 when the pages are int8
    v_scales: Scales | None = None,
) -> Queries:
    """Plain-jnp paged attention: gather each row's pages, then `attend`."""
    k, v = _gather_rows(k_pages, v_pages, page_table, k_scales, v_scales, q.dtype)
    ok = allowed_mask(q.shape[1], k.shape[1], kv_lens, q_lens, mask, sliding_window)
    return attend(q, k, v, ok, scale=scale, soft_cap=soft_cap)


def _gather_rows(k_pages: Pages, v_pages: Pages, page_table: PageTable,
                 k_scales: Scales | None = None, v_scales: Scales | None = None,
                 dtype=None) -> tuple[RowKV, RowKV]:
    """[K, P, Z, H] pages, [B, M] table -> each row's keys and values [B, M*Z, K, H];
    int8 pages dequantized to `dtype` with their scales [K, P, Z]."""
    b, m = page_table.shape

    def gather(x):  # [K, P, Z, ...] -> [B, M*Z, K, ...]
        kh, _, z, *rest = x.shape
        return jnp.moveaxis(x[:, page_table].reshape(kh, b, m * z, *rest), 0, 2)

    if k_scales is None:
        return gather(k_pages), gather(v_pages)
    return (kv_quant.dequantize(gather(k_pages), gather(k_scales), dtype),
            kv_quant.dequantize(gather(v_pages), gather(v_scales), dtype))


def reference_attention_with_new(
    q: Queries,
    k_new: NewKV,  # the T new tokens' keys, not in the pages
    v_new: NewKV,
    q_lens: RowLengths,
    mask: TreeMask | None,  # None = causal
    k_pages: Pages,
    v_pages: Pages,
    page_table: PageTable,
    prefix_lens: RowLengths,  # cached slots each query sees
    *, scale: float, soft_cap: float | None = None, sliding_window: int | None = None,
    k_scales: Scales | None = None,  # float32 when the pages are int8
    v_scales: Scales | None = None,
) -> Queries:
    """The module contract with the new tokens' KV passed beside the pages instead of
    written into them: the same output as writing them at slots `prefix_lens + t` and
    calling `reference_ragged_paged_attention` with kv_lens = prefix_lens + q_lens.

    Why: the speculative loop picks its verify width with `lax.switch`; a cache written
    inside a branch leaves the branch in a new buffer that XLA copies back into the loop
    carry, the whole pool twice per step (~40 % of a plain step at 1k tokens on CPU). The
    verify branches attend this way and the loop writes only the kept tokens afterwards.
    """
    b, t = q.shape[:2]
    k, v = _gather_rows(k_pages, v_pages, page_table, k_scales, v_scales, q.dtype)
    s_len = k.shape[1]
    tq = jnp.arange(t)[None, :, None]  # [1, T, 1]
    j = jnp.arange(s_len)[None, None, :]  # [1, 1, S]
    start = prefix_lens[:, None, None]
    ok_prefix = j < start
    if sliding_window is not None:
        ok_prefix &= (start + tq - j) < sliding_window
    ok_new = allowed_mask(t, t, q_lens, q_lens, mask, sliding_window)  # [B, T, T]
    return attend_parts(q, ((k, v, jnp.broadcast_to(ok_prefix, (b, t, s_len))),
                            (k_new, v_new, ok_new)), scale=scale, soft_cap=soft_cap)
