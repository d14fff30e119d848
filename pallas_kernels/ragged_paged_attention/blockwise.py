"""Ragged paged attention in plain jnp over blocks of pages, for long query chunks on
XLA:CPU: the same contract and signature as `reference_ragged_paged_attention`.

Why: the reference gathers every page of a row's table and materialises the scores over
all of them, the slots past the chunk masked rather than skipped. A prompt of n tokens
prefilled in chunks then attends over about twice the causal work, and its score
tensors grow with chunk × table. This reads the table in blocks of pages, stops after
the block holding the batch's last valid slot (a traced trip count, so one compiled
program serves every chunk), and folds the blocks with flash attention's online softmax
(float32 running max, denominator and output).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.pallas_kernels.ragged_paged_attention.reference import (
    _gather_rows,
    allowed_mask,
    grouped_queries,
    grouped_scores,
    ungrouped,
    weighted_values,
)
from specjax.typing import Pages, PageTable, Queries, RowLengths, Scales, TreeMask

BLOCK_PAGES = 16  # pages per block: 256 slots at the default page size of 16


def blockwise_ragged_paged_attention(
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
    block_pages: int = BLOCK_PAGES,
) -> Queries:
    """`reference_ragged_paged_attention`'s output, reading only the blocks of
    `block_pages` pages up to the batch's longest row (module doc)."""
    b, t, n, h = q.shape
    kh, z = k_pages.shape[0], k_pages.shape[2]
    bp = min(block_pages, page_table.shape[1])
    num_blocks = -(-page_table.shape[1] // bp)
    # pad the table to whole blocks; the padded slots lie past every row's kv_lens
    table = jnp.pad(page_table, ((0, 0), (0, num_blocks * bp - page_table.shape[1])))
    qg = grouped_queries(q, kh)  # [K, B, T, G, H]
    slots = bp * z

    def block(i, carry):
        run_max, denom, out = carry  # [K, B, T, G, 1] x2, [K, B, T, G, H] float32
        tab = jax.lax.dynamic_slice_in_dim(table, i * bp, bp, axis=1)
        k, v = _gather_rows(k_pages, v_pages, tab, k_scales, v_scales, q.dtype)
        ok = allowed_mask(t, slots, kv_lens, q_lens, mask, sliding_window,
                          first_slot=i * slots)  # [B, T, S]
        okb = ok[None, :, :, None, :]
        s = jnp.where(okb, grouped_scores(qg, k, scale, soft_cap), -jnp.inf)
        new_max = jnp.maximum(run_max, jnp.max(s, axis=-1, keepdims=True))
        safe = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        p = jnp.where(okb, jnp.exp(s - safe), 0.0)
        rescale = jnp.where(jnp.isfinite(run_max), jnp.exp(run_max - safe), 0.0)
        return (new_max, denom * rescale + jnp.sum(p, axis=-1, keepdims=True),
                out * rescale + weighted_values(p, v, ok, q.dtype))

    g = n // kh
    init = (jnp.full((kh, b, t, g, 1), -jnp.inf, jnp.float32),
            jnp.zeros((kh, b, t, g, 1), jnp.float32), jnp.zeros((kh, b, t, g, h), jnp.float32))
    needed = (jnp.max(kv_lens) + slots - 1) // slots  # blocks holding a valid slot
    _, denom, out = jax.lax.fori_loop(0, jnp.minimum(needed, num_blocks), block, init)
    out = out / jnp.where(denom > 0, denom, 1.0)  # queries that see nothing output 0
    return ungrouped(out, q)
