"""The one attention entry point of specjax, and its plain-jnp reference backend.

Every model call (decode T=1, chain verify T=k+1, tree verify T=nodes, prefill chunk)
goes through `paged_attention`. Its contract, shared by the Pallas backend in
`pallas_kernels/`:

* Row b has `kv_lens[b]` valid KV slots in its pages, the last `q_lens[b]` of which are
  the new tokens this call wrote; query t of row b sits at slot
  `kv_lens[b] - q_lens[b] + t`. Queries t >= q_lens[b] are padding; their output is
  unspecified (finite) and callers ignore it.
* A query sees every prefix slot (`j < kv_lens - q_lens`) and, among the new tokens,
  those its mask allows: causal (`j <= t`) when `mask` is None, else `mask[b, t, j]`
  (a tree mask: a node sees itself and its ancestors).
* Slots at or past `kv_lens[b]`, and pages the table does not name, are never read into
  the output, even if they hold NaN.
* int8 pages come with float32 scales [K, P, Z] (`k_scales`, `v_scales`; one per token
  and KV head, `specjax.kv_quant`) and are attended as `dequantize`d to q's dtype.
* With `new_kv=(k, v)` ([B, T, K, H] each) the new tokens are not in the pages: their
  slots `kv_lens - q_lens + t` may hold anything and are never read; the keys/values
  come from `new_kv` (reference backend, off-mesh: how verify forwards skip writing
  a tree the loop mostly throws away, `reference_attention_with_new`). Beside int8
  pages they are seen as the cache would hand them back (`kv_quant.fake_quantize`),
  so the output is that of writing them and attending, as for float pages.

Axis letters and the shape aliases in the signatures: `specjax.typing`.
"""

from __future__ import annotations

import functools
import os
from typing import Callable

import jax
import jax.numpy as jnp

from specjax import kv_quant
from specjax.typing import (AllowedMask, NewKV, PageTable, Pages, Queries, RowKV, RowLengths,
                            Scales, TreeMask)

BACKENDS = ("reference", "pallas")
_ENV = "SPECJAX_ATTENTION"


def default_backend() -> str:
    """`SPECJAX_ATTENTION` if set, else Pallas on GPU/TPU and the reference on CPU."""
    env = os.environ.get(_ENV)
    if env:
        if env not in BACKENDS:
            raise ValueError(f"{_ENV}={env!r} must be one of {BACKENDS}")
        return env
    return "reference" if jax.default_backend() == "cpu" else "pallas"


def resolve_backend(backend: str | None) -> str:
    if backend is None:
        return default_backend()
    if backend not in BACKENDS:
        raise ValueError(f"attention backend={backend!r} must be one of {BACKENDS}")
    return backend


def allowed_mask(
    t_len: int,
    s_len: int,
    kv_lens: RowLengths,
    q_lens: RowLengths,
    mask: TreeMask | None,
    sliding_window: int | None = None,
) -> AllowedMask:
    """Which KV slot each query may see: [B, T, S] bool (the contract above, spelled out)."""
    t = jnp.arange(t_len)[None, :, None]  # [1, T, 1]
    j = jnp.arange(s_len)[None, None, :]  # [1, 1, S]
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
    b, t, n, h = q.shape
    kh = parts[0][0].shape[2]
    qg = q.reshape(b, t, kh, n // kh, h)
    scores, oks = [], []
    for k, _, ok in parts:
        s = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32) * scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        okb = ok[:, None, None, :, :]
        scores.append(jnp.where(okb, s, -jnp.inf))
        oks.append(okb)
    m = functools.reduce(jnp.maximum, [jnp.max(s, axis=-1, keepdims=True) for s in scores])
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    probs = [jnp.where(okb, jnp.exp(s - m), 0.0) for s, okb in zip(scores, oks)]
    denom = sum(jnp.sum(p, axis=-1, keepdims=True) for p in probs)
    denom = jnp.where(denom > 0, denom, 1.0)
    out = 0.0
    for p, (_, v, ok) in zip(probs, parts):
        # Zero unseen slots of v so garbage (NaN) there cannot leak through 0 * NaN.
        v = jnp.where(jnp.any(ok, axis=1)[:, :, None, None], v, jnp.zeros((), v.dtype))
        # p in the wider of q's and v's dtype (bf16 for bf16 q and v; float32 queries keep
        # float32 p over a bf16 cache, as the kernel computes in the wider dtype)
        dt = jnp.promote_types(q.dtype, v.dtype)
        out = out + jnp.einsum("BKGTS,BSKH->BTKGH", (p / denom).astype(dt), v.astype(dt),
                               preferred_element_type=jnp.float32)
    return out.reshape(b, t, n, h).astype(q.dtype)


def reference_paged_attention(
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
    calling `reference_paged_attention` with kv_lens = prefix_lens + q_lens.

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


def _pallas_backend() -> Callable:
    try:
        from pallas_kernels.ragged_paged_attention import ragged_paged_attention
    except ImportError as e:  # pragma: no cover - depends on the kernel package
        raise ValueError(f"attention backend 'pallas' is not available: {e}") from e
    return ragged_paged_attention


def paged_attention(
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
    backend: str | None = None,
    mesh=None,
    new_kv: tuple[NewKV, NewKV] | None = None,
    k_scales: Scales | None = None,  # float32 when the pages are int8
    v_scales: Scales | None = None,
) -> Queries:
    """Attention of T new query tokens per row against a paged KV cache (see module doc).

    With a mesh (`mesh`, or the one `jax.set_mesh` made active) the backend runs once per
    shard under `shard_map`: KV heads over the model axis, rows over the data axis
    (`specjax.sharding.per_shard`).
    """
    from specjax.sharding import rules as sharding_rules, per_shard

    backend = resolve_backend(backend)
    if new_kv is not None:
        mesh = sharding_rules.active_mesh() if mesh is None else mesh
        if backend != "reference" or mesh is not None:
            raise ValueError("new_kv (keys/values beside the pages) needs the reference "
                             f"backend off-mesh (got backend={backend!r}, mesh={mesh})")
        if k_scales is not None:  # as a write to int8 pages and a read would see them
            new_kv = tuple(kv_quant.fake_quantize(x) for x in new_kv)
        return reference_attention_with_new(
            q, *new_kv, q_lens, mask, k_pages, v_pages, page_table, kv_lens - q_lens,
            scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
            k_scales=k_scales, v_scales=v_scales)
    fn = reference_paged_attention if backend == "reference" else _pallas_backend()
    mesh = sharding_rules.active_mesh() if mesh is None else mesh
    opts = dict(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
    if mesh is not None:
        return per_shard.per_shard_attention(fn, mesh, q, k_pages, v_pages, page_table, kv_lens,
                                             q_lens, mask, k_scales, v_scales, **opts)
    if k_scales is not None:
        opts.update(k_scales=k_scales, v_scales=v_scales)
    return fn(q, k_pages, v_pages, page_table, kv_lens, q_lens, mask, **opts)
