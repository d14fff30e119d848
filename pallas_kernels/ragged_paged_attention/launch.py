"""The validated call's launch: q laid out as rows per KV head, the mask packed into
words, the page table padded to whole KV blocks, then the lowering's kernel
(`gpu.py` Triton, `tpu.py` Mosaic) and back to [B, T, N, H].

Its own module so that the tests check its shape annotations (specjax.typing) at run
time: `api.ragged_paged_attention` validates its arguments first, with errors that name
the value, and stays unchecked so that those errors are the ones a caller sees.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from specjax.pallas_kernels.ragged_paged_attention import _common as common, gpu, tpu
from specjax.typing import Pages, PageTable, Queries, RowLengths, Scales, TreeMask


@functools.partial(jax.jit, static_argnames=(
    "scale", "soft_cap", "sliding_window", "lowering", "block_rows", "pages_per_block",
    "kv_splits", "num_warps", "num_stages", "interpret", "debug"))
def launch(
    q: Queries,
    k_pages: Pages,
    v_pages: Pages,
    page_table: PageTable,
    kv_lens: RowLengths,
    q_lens: RowLengths,
    mask: TreeMask | None,
    k_scales: Scales | None,  # float32, with int8 pages
    v_scales: Scales | None,
    *,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    lowering: str,  # validated: one of api.LOWERINGS
    block_rows: int,
    pages_per_block: int,
    kv_splits: int,
    num_warps: int | None,  # Triton's; None on Mosaic
    num_stages: int | None,
    interpret: bool,
    debug: bool,
) -> Queries:
    """Attention through the lowering's kernel; the caller has validated the arguments."""
    b, t, n, h = q.shape
    kh, p, _, _ = k_pages.shape
    group = n // kh
    rows_pad = common.cdiv(t * group, block_rows) * block_rows
    # Float pages of another dtype: compute in the wider one, as the reference's einsum.
    compute = q.dtype if k_scales is not None else jnp.promote_types(q.dtype, k_pages.dtype)
    q_rows = common.rows_from_q(q.astype(compute), kh, rows_pad)  # [B, K, R_pad, H]
    words = None if mask is None else common.mask_words(mask, group, rows_pad)
    table = common.pad_page_table(page_table, p, pages_per_block)  # [B, M_pad]
    kv_scales = None if k_scales is None else (k_scales[..., None], v_scales[..., None])
    args = (q_rows, k_pages, v_pages, table, kv_lens, q_lens, words, kv_scales)
    opts = dict(group=group, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
                block_rows=block_rows, pages_per_block=pages_per_block, debug=debug)
    if lowering == "triton":
        out = gpu.ragged_paged_attention_gpu(*args, **opts, splits=kv_splits,
                                             num_warps=num_warps, num_stages=num_stages,
                                             interpret=interpret)
    else:
        out = tpu.ragged_paged_attention_tpu(
            *args, **opts, interpret=pltpu.InterpretParams() if interpret else False)
    return common.q_from_rows(out, t, n).astype(q.dtype)
