"""Paged attention and cache writes and moves on a mesh: `specjax.attention` and
`specjax.cache` (which know nothing of meshes) run once per shard under `shard_map`.
`paged_attention`, `write_kv`, `write_layer_kv` and `move_slots` take the single-device
functions' arguments and run them as they are off-mesh.

Attention needs no communication when each device holds whole KV heads with their query
groups: queries [B, T, N, H] are split over N, pages [K, P, Z, H] over K (contiguous
blocks, so query head n = k * G + g stays with its KV head k), rows over `batch`. The
pages are split over `data` with the rows (`rules.page_axis`): a data shard's page table
holds ids local to its own block of pages, so the gather in the kernel (Pallas, or the
jnp reference) and the cache writes and moves see an ordinary, smaller problem and stay
on the device. When the rules replicate `kv_heads` (K not divisible by the model axis)
every model shard runs all heads; when they replicate `batch`, every data shard runs all
rows against one replicated pool.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
from jax.sharding import PartitionSpec as P

from specjax import attention, cache as cache_lib
from specjax.models.transformer import CacheOps
from specjax.sharding.rules import CACHE_AXES, RULES, Logical, active_mesh, mesh_axis, page_axis

PAGES = CACHE_AXES["k_pages"]  # [L, K, P, Z, H]


def _spec(logical: Logical, axes: dict) -> P:
    return P(*(None if a is None else axes.get(a) for a in logical))


def per_shard_pages(fn: Callable, mesh, args: Sequence, in_logical: Sequence[Logical],
                    out_logical, *, kv_heads: int, batch: int, rules=RULES):
    """`fn(*args)` once per shard for an op that writes pages (a cache write or move).

    Each argument is split by its logical axes: `kv_heads` over the model axis, `pages`
    and the rows (`batch`) that own them over the page axis, so every data shard updates
    only its own pages (with rows replicated, every shard applies all rows to its copy of
    the one pool, and the copies stay equal). `out_logical`: one logical tuple, or a tuple
    of them for several outputs.
    """
    pages = page_axis(batch, mesh, rules=rules)
    axes = {"kv_heads": mesh_axis("kv_heads", kv_heads, mesh, rules=rules),
            "batch": pages, "pages": pages}
    single = not out_logical or not isinstance(out_logical[0], tuple)
    out_specs = _spec(out_logical, axes) if single else tuple(_spec(o, axes)
                                                              for o in out_logical)
    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(_spec(l, axes) for l in in_logical),
                         out_specs=out_specs, check_vma=False)(*args)


def per_shard_attention(
    fn: Callable,
    mesh,
    q: jax.Array,  # [B, T, N, H]
    k_pages: jax.Array,  # [K, P, Z, H]
    v_pages: jax.Array,  # [K, P, Z, H]
    page_table: jax.Array,  # [B, M] int32, ids local to the row's data shard
    kv_lens: jax.Array,  # [B] int32
    q_lens: jax.Array,  # [B] int32
    mask: jax.Array | None,  # [B, T, T] bool
    k_scales: jax.Array | None = None,  # [K, P, Z] float32 with int8 pages
    v_scales: jax.Array | None = None,  # [K, P, Z]
    *,
    rules=RULES,
    **kwargs,
) -> jax.Array:  # [B, T, N, H]
    """`fn(q, k_pages, ..., mask, **kwargs)` run once per shard of `mesh` (Mesh or
    AbstractMesh); int8 pages' scales are split as the pages and passed as keywords."""
    b = q.shape[0]
    mask_given = mask is not None
    axes = {"kv_heads": mesh_axis("kv_heads", k_pages.shape[0], mesh, rules=rules),
            "batch": mesh_axis("batch", b, mesh, rules=rules),
            "pages": page_axis(b, mesh, rules=rules)}
    q_spec = _spec(("batch", None, "kv_heads", None), axes)  # query heads go with their K
    page_spec = _spec(PAGES[1:], axes)
    args = [q, k_pages, v_pages, page_table, kv_lens, q_lens]
    specs = [q_spec, page_spec, page_spec, _spec(("batch", None), axes),
             _spec(("batch",), axes), _spec(("batch",), axes)]
    if mask is not None:
        args.append(mask)
        specs.append(_spec(("batch", None, None), axes))
    if k_scales is not None:
        args += [k_scales, v_scales]
        specs += [_spec(PAGES[1:-1], axes)] * 2

    def local(q, k_pages, v_pages, page_table, kv_lens, q_lens, *rest):
        rest = list(rest)
        mask = rest.pop(0) if mask_given else None
        scales = dict(k_scales=rest[0], v_scales=rest[1]) if rest else {}
        return fn(q, k_pages, v_pages, page_table, kv_lens, q_lens, mask, **scales, **kwargs)

    # check_vma=False: kernels (pallas_call) carry no varying-axes annotations; outputs
    # over a replicated axis are identical on every shard by construction.
    return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=q_spec,
                         check_vma=False)(*args)


def paged_attention(q, k_pages, v_pages, page_table, kv_lens, q_lens, mask=None, *,
                    scale: float, soft_cap: float | None = None,
                    sliding_window: int | None = None, backend: str | None = None,
                    mesh=None, new_kv=None, k_scales=None, v_scales=None, layer=None):
    """`specjax.attention.paged_attention` on `mesh` (or the one `jax.set_mesh` made
    active): the backend once per shard, KV heads over the model axis, rows over the data
    axis; without a mesh, that function itself. `layer`: the pages are all layers'."""
    mesh = active_mesh() if mesh is None else mesh
    opts = dict(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
    if mesh is None:
        return attention.paged_attention(q, k_pages, v_pages, page_table, kv_lens, q_lens,
                                         mask, backend=backend, new_kv=new_kv,
                                         k_scales=k_scales, v_scales=v_scales, layer=layer,
                                         **opts)
    if layer is not None:
        k_pages, v_pages, k_scales, v_scales = attention.one_layer(layer, k_pages, v_pages,
                                                                   k_scales, v_scales)
    backend = attention.resolve_backend(backend)
    if new_kv is not None:
        raise ValueError("new_kv (keys/values beside the pages) needs the reference "
                         f"backend off-mesh (got backend={backend!r}, mesh={mesh})")
    return per_shard_attention(attention.kernel(backend), mesh, q, k_pages, v_pages,
                               page_table, kv_lens, q_lens, mask, k_scales, v_scales, **opts)


def write_kv(pages, layer, new, page, offset):
    """`specjax.cache.write_kv` per shard under the active mesh: each data shard writes
    its rows into its own pages, each model shard its KV heads."""
    mesh = active_mesh()
    if mesh is None:
        return cache_lib.write_kv(pages, layer, new, page, offset)
    logical = PAGES[:pages.ndim]
    return per_shard_pages(
        cache_lib.write_kv, mesh, (pages, layer, new, page, offset),
        (logical, (), ("batch", None, "kv_heads", None)[:new.ndim], ("batch", None),
         ("batch", None)), logical, kv_heads=pages.shape[1], batch=new.shape[0])


def write_layer_kv(kv, layer, k, v, page, offset) -> tuple:
    """`specjax.cache.write_layer_kv` with its writes per shard under the active mesh."""
    return cache_lib.write_layer_kv(kv, layer, k, v, page, offset, write=write_kv)


def move_slots(cache, src, dst, valid):
    """`specjax.cache.move_slots` per shard under the active mesh."""
    mesh = active_mesh()
    if mesh is None:
        return cache_lib.move_slots(cache, src, dst, valid)
    arrays = tuple(a for a in cache.kv if a is not None)  # pages, then scales if int8
    rows = ("batch", None)
    logical = tuple(PAGES[:a.ndim] for a in arrays)
    moved = per_shard_pages(
        cache_lib.move_slot_arrays, mesh, (cache.page_table, src, dst, valid) + arrays,
        (rows,) * 4 + logical, logical, kv_heads=cache.k_pages.shape[1], batch=src.shape[0])
    return cache_lib.with_moved(cache, tuple(moved))


# What a model step under a mesh calls (`specjax.model.step_kv`; `.deferred()` when it
# leaves the write to its caller); off-mesh they are the single-device functions.
MESH_OPS = CacheOps(attention=paged_attention, write_layer_kv=write_layer_kv)
