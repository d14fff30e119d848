"""Paged attention per shard under `shard_map`: the hook the attention entry point uses.

Attention needs no communication when each device holds whole KV heads with their query
groups: queries [B, T, N, H] are split over N, pages [K, P, Z, H] over K (contiguous
blocks, so query head n = k * G + g stays with its KV head k), rows over `batch`. The
kernel (Pallas, or the jnp reference) then sees an ordinary, smaller problem. When the
rules replicate `kv_heads` (K not divisible by the model axis) every model shard runs
all heads; when they replicate `batch`, every data shard runs all rows.
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import PartitionSpec as P

from specjax.sharding.rules import RULES, mesh_axis


def per_shard_attention(
    fn: Callable,
    mesh,
    q: jax.Array,  # [B, T, N, H]
    k_pages: jax.Array,  # [K, P, Z, H]
    v_pages: jax.Array,  # [K, P, Z, H]
    page_table: jax.Array,  # [B, M] int32
    kv_lens: jax.Array,  # [B] int32
    q_lens: jax.Array,  # [B] int32
    mask: jax.Array | None,  # [B, T, T] bool
    *,
    rules=RULES,
    **kwargs,
) -> jax.Array:  # [B, T, N, H]
    """`fn(q, k_pages, ..., mask, **kwargs)` run once per shard of `mesh` (Mesh or AbstractMesh)."""
    heads = mesh_axis("kv_heads", k_pages.shape[0], mesh, rules=rules)
    rows = mesh_axis("batch", q.shape[0], mesh, rules=rules)
    q_spec = P(rows, None, heads, None)
    page_spec = P(heads, None, None, None)
    args = [q, k_pages, v_pages, page_table, kv_lens, q_lens]
    specs = [q_spec, page_spec, page_spec, P(rows, None), P(rows), P(rows)]
    if mask is not None:
        args.append(mask)
        specs.append(P(rows, None, None))

    def local(q, k_pages, v_pages, page_table, kv_lens, q_lens, *maybe_mask):
        return fn(q, k_pages, v_pages, page_table, kv_lens, q_lens,
                  maybe_mask[0] if maybe_mask else None, **kwargs)

    # check_vma=False: kernels (pallas_call) carry no varying-axes annotations; outputs
    # over a replicated axis are identical on every shard by construction.
    return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=q_spec,
                         check_vma=False)(*args)
