"""TPU lowering (Pallas Mosaic): the page table walks the KV pipeline through scalar prefetch.

Grid (B, K, row_blocks, kv_blocks); the last axis is the flash reduction ("arbitrary"),
with the online-softmax state in VMEM scratch. The page table and the lengths are
scalar-prefetched into SMEM, so the KV BlockSpecs' index maps can name pages: the
key/value pool is passed `pages_per_block` times, input c of step j fetching page
`page_table[b, j * ppb + c]`. Pallas' pipeline double-buffers those page DMAs with no
hand-written copies. Index maps clamp steps outside the row's visible block range (and
pages past its last page) to an already-fetched page: such steps cost no DMA, compute
is skipped with `pl.when`, and pages the row does not name are never fetched.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from specjax.pallas_kernels.ragged_paged_attention import _common as common

_LANES = 128  # m/l scratch is lane-wide; only lane 0 is read back


def _split_refs(refs, pages_per_block: int, quantized: bool, has_mask: bool):
    """The kernel's refs by role: (key pages, value pages, key scales, value scales, tree-mask
    words, (out, m, l, acc)); None for what this launch does not pass."""
    refs = list(refs)
    take = lambda n: [refs.pop(0) for _ in range(n)]  # noqa: E731
    k_refs, v_refs = take(pages_per_block), take(pages_per_block)
    k_scale_refs = take(pages_per_block) if quantized else None
    v_scale_refs = take(pages_per_block) if quantized else None
    words_ref = refs.pop(0) if has_mask else None
    return k_refs, v_refs, k_scale_refs, v_scale_refs, words_ref, tuple(refs)


def _store_state(state_refs, state) -> None:
    """Writes the online-softmax state (m, l, acc) to its VMEM scratch, m and l broadcast
    across the lane-wide scratch."""
    m_ref, l_ref, acc_ref = state_refs
    m, l, acc = state
    m_ref[...] = jnp.broadcast_to(m, m_ref.shape)
    l_ref[...] = jnp.broadcast_to(l, l_ref.shape)
    acc_ref[...] = acc


def _kernel(
    kv_lens_ref,  # [B] int32 (SMEM, scalar prefetch)
    q_lens_ref,  # [B] int32 (SMEM)
    page_table_ref,  # [B, M_pad] int32 (SMEM)
    q_ref,  # [R, H] query rows of KV head k
    *refs,  # ppb key pages [Z, H], ppb value pages [Z, H]; if int8, ppb key and ppb
    # value scales [Z, 1] f32; if tree mask, words [R, W] int32; o_ref [R, H]; scratch
    # m [R, 128], l [R, 128], acc [R, H] (float32)
    pages_per_block: int,
    group: int,
    has_mask: bool,
    quantized: bool,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
):
    (k_refs, v_refs, k_scale_refs, v_scale_refs, words_ref,
     (o_ref, m_ref, l_ref, acc_ref)) = _split_refs(refs, pages_per_block, quantized, has_mask)
    rows, head_dim = q_ref.shape
    block_kv = pages_per_block * k_refs[0].shape[0]
    b, j = pl.program_id(0), pl.program_id(3)
    row0 = pl.program_id(2) * rows
    kv_len = kv_lens_ref[b]
    q_len = q_lens_ref[b]
    lo, hi = common.kv_block_range(
        kv_len, q_len, row0, block_rows=rows, block_kv=block_kv, group=group,
        causal=not has_mask, sliding_window=sliding_window)

    @pl.when(j == 0)
    def _init():
        _store_state((m_ref, l_ref, acc_ref), common.init_state(rows, head_dim))

    @pl.when((j >= lo) & (j < hi))
    def _step():
        def block(page_refs):  # ppb pages [Z, ...] -> one block [C, ...]
            return None if page_refs is None else jnp.concatenate(
                [r[...] for r in page_refs], axis=0)

        # int8 pages: times per-slot scales [C, 1]
        k = common.to_compute(block(k_refs), block(k_scale_refs), q_ref.dtype)  # [C, H]
        v = common.to_compute(block(v_refs), block(v_scale_refs), q_ref.dtype)
        col0 = j * block_kv
        words = common.load_words(words_ref)  # W x [R, 1]
        ok = common.allowed((rows, block_kv), row0, col0, kv_len, q_len, words,
                            group=group, sliding_window=sliding_window)
        state = (m_ref[...][:, :1], l_ref[...][:, :1], acc_ref[...])
        _store_state((m_ref, l_ref, acc_ref),
                     common.attend_block(q_ref[...], k, v, state, ok, kv_len, col0,
                                         scale=scale, soft_cap=soft_cap))

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        o_ref[...] = common.finalize(l_ref[...][:, :1], acc_ref[...]).astype(o_ref.dtype)


def _page_index_map(c: int, *, block_rows: int, block_kv: int, page_size: int, ppb: int,
                    group: int, causal: bool, sliding_window: int | None):
    """The index map of page input `c` of a KV block: step j fetches the row's page
    j * ppb + c, clamped to the visible block range and the row's last page so that
    skipped steps re-name a fetched page (no DMA)."""
    z = page_size

    def index_map(b, k, i, j, kv_lens_ref, q_lens_ref, page_table_ref):
        kv_len = kv_lens_ref[b]
        lo, hi = common.kv_block_range(
            kv_len, q_lens_ref[b], i * block_rows, block_rows=block_rows,
            block_kv=block_kv, group=group, causal=causal,
            sliding_window=sliding_window)
        blk = jnp.maximum(jnp.minimum(j, hi - 1), lo)
        last_page = jnp.maximum(common.cdiv(kv_len, z) - 1, 0)
        page = jnp.minimum(blk * ppb + c, last_page)
        return (k, page_table_ref[b, page], 0, 0)
    return index_map


def _inputs(q_rows, k_pages, v_pages, words, kv_scales, row_spec, page_map, block_rows: int,
            ppb: int) -> tuple[list, list]:
    """The kernel's inputs after the scalar prefetch, with their BlockSpecs: query rows, the
    key and value pools `ppb` times each (one page input per page of a block), then the
    int8 scales (same index maps as the pages) and tree-mask words if any."""
    h = q_rows.shape[-1]
    z = k_pages.shape[2]
    page_specs = [pl.BlockSpec((None, None, z, h), page_map(c)) for c in range(ppb)]
    in_specs = [row_spec] + page_specs + page_specs
    operands = [q_rows] + [k_pages] * ppb + [v_pages] * ppb
    if kv_scales is not None:  # [K, P, Z, 1]: same index maps as the pages
        in_specs += [pl.BlockSpec((None, None, z, 1), page_map(c))
                     for c in range(ppb)] * 2
        operands += [kv_scales[0]] * ppb + [kv_scales[1]] * ppb
    if words is not None:
        in_specs.append(pl.BlockSpec((None, block_rows, words.shape[-1]),
                                     lambda b, k, i, j, *_: (b, i, 0)))
        operands.append(words)
    return in_specs, operands


def ragged_paged_attention_tpu(
    q_rows: jax.Array,  # [B, K, R_pad, H]
    k_pages: jax.Array,  # [K, P, Z, H]
    v_pages: jax.Array,  # [K, P, Z, H]
    page_table: jax.Array,  # [B, M_pad] int32, clipped to [0, P), M_pad % ppb == 0
    kv_lens: jax.Array,  # [B] int32
    q_lens: jax.Array,  # [B] int32
    words: jax.Array | None,  # [B, R_pad, W] int32 tree-mask bits, None = causal
    kv_scales: tuple | None,  # int8 pages: (k, v) scales, each [K, P, Z, 1] float32
    *,
    group: int,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    block_rows: int,
    pages_per_block: int,
    interpret,  # False, or a `pltpu.InterpretParams`
    debug: bool,
) -> jax.Array:  # [B, K, R_pad, H]
    """Row-layout attention (see `_common`) with the Mosaic kernel above."""
    b, kh, rows_pad, h = q_rows.shape
    _, _, z, _ = k_pages.shape
    m_pad = page_table.shape[1]
    ppb = pages_per_block
    block_kv = ppb * z
    causal = words is None

    page_map = functools.partial(
        _page_index_map, block_rows=block_rows, block_kv=block_kv, page_size=z, ppb=ppb,
        group=group, causal=causal, sliding_window=sliding_window)
    row_spec = pl.BlockSpec((None, None, block_rows, h), lambda b, k, i, j, *_: (b, k, i, 0))
    in_specs, operands = _inputs(q_rows, k_pages, v_pages, words, kv_scales, row_spec,
                                 page_map, block_rows, ppb)
    kernel = functools.partial(
        _kernel, pages_per_block=ppb, group=group, has_mask=words is not None,
        quantized=kv_scales is not None, scale=scale, soft_cap=soft_cap,
        sliding_window=sliding_window)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(b, kh, rows_pad // block_rows, m_pad // ppb),
            in_specs=in_specs,
            out_specs=row_spec,
            scratch_shapes=[pltpu.VMEM((block_rows, _LANES), jnp.float32),
                            pltpu.VMEM((block_rows, _LANES), jnp.float32),
                            pltpu.VMEM((block_rows, h), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q_rows.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        debug=debug,
        name=f"ragged_paged_attention_{block_rows=}_{ppb=}",
    )(kv_lens, q_lens, page_table, *operands)
