"""GPU lowering (Pallas Triton): one program per (row, KV head, row block, KV split).

Grid (B, K, row_blocks, splits). A program keeps its R query rows [R, H] in registers
and loops (`fori_loop`, dynamic bounds from the row's lengths) over KV blocks of
`pages_per_block` pages: the page ids come from the row's page table, the pages are
gathered straight from the pool (`k_pages_ref[pages]`, a Triton gather load), and the
block is folded into a float32 online softmax. Blocks a row cannot see (past its
length, past the last causal token, before the sliding window) are never loaded.

With `splits > 1` (flash-decoding: small batch x long context would leave most SMs
idle) each program walks a contiguous share of the row's blocks and writes its
unnormalised state; `_common.combine_splits` merges the shares under XLA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from specjax.pallas_kernels.ragged_paged_attention import _common as common


def _kernel(
    kv_lens_ref,  # [1] int32, this row's KV length
    q_lens_ref,  # [1] int32, this row's new tokens
    page_table_ref,  # [M_pad] int32, this row's page ids
    q_ref,  # [R, H] query rows of KV head k
    k_pages_ref,  # [P, Z, H] KV head k's key pages (the whole pool)
    v_pages_ref,  # [P, Z, H]
    *refs,  # if int8: k/v scales [P, Z, 1] f32; if tree mask: words [R, W] int32; then
    # out [R, H], or with splits > 1 the state: acc [R, H], m [R, 1], l [R, 1] (float32)
    pages_per_block: int,
    group: int,
    splits: int,
    has_mask: bool,
    quantized: bool,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
):
    k_scales_ref, v_scales_ref, words_ref, out_refs = _split_refs(refs, quantized, has_mask)
    rows, head_dim = q_ref.shape
    page_size = k_pages_ref.shape[1]
    block_kv = pages_per_block * page_size
    row0 = pl.program_id(2) * rows
    kv_len = kv_lens_ref[0]
    q_len = q_lens_ref[0]
    q = q_ref[...]
    words = common.load_words(words_ref)  # W x [R, 1]

    lo, hi = common.kv_block_range(
        kv_len, q_len, row0, block_rows=rows, block_kv=block_kv, group=group,
        causal=not has_mask, sliding_window=sliding_window)
    per_split = common.cdiv(hi - lo, splits)
    first = lo + pl.program_id(3) * per_split
    last = jnp.minimum(first + per_split, hi)

    def body(blk, state):
        pages = page_table_ref[pl.ds(blk * pages_per_block, pages_per_block)]  # [ppb]
        k = k_pages_ref[pages].reshape(block_kv, head_dim)  # [C, H]
        v = v_pages_ref[pages].reshape(block_kv, head_dim)
        k_scales = v_scales = None  # int8 pages: per-slot scales [C, 1]
        if quantized:
            k_scales = k_scales_ref[pages].reshape(block_kv, 1)
            v_scales = v_scales_ref[pages].reshape(block_kv, 1)
        k = common.to_compute(k, k_scales, q.dtype)
        v = common.to_compute(v, v_scales, q.dtype)
        col0 = blk * block_kv
        ok = common.allowed((rows, block_kv), row0, col0, kv_len, q_len, words,
                            group=group, sliding_window=sliding_window)
        return common.attend_block(q, k, v, state, ok, kv_len, col0, scale=scale,
                                   soft_cap=soft_cap)

    m, l, acc = lax.fori_loop(first, last, body, common.init_state(rows, head_dim))
    _write_result(out_refs, splits, m, l, acc)


def _split_refs(refs, quantized: bool, has_mask: bool):
    """The kernel's optional refs by role: (k scales, v scales, tree-mask words, outputs),
    None for what this launch does not pass."""
    refs = list(refs)
    k_scales_ref, v_scales_ref = (refs.pop(0), refs.pop(0)) if quantized else (None, None)
    words_ref = refs.pop(0) if has_mask else None
    return k_scales_ref, v_scales_ref, words_ref, refs


def _write_result(out_refs, splits: int, m, l, acc) -> None:
    """Stores the program's result: the normalised output, or with `splits > 1` the
    unnormalised state that `combine_splits` merges."""
    if splits == 1:
        (o_ref,) = out_refs
        o_ref[...] = common.finalize(l, acc).astype(o_ref.dtype)
    else:
        acc_ref, m_ref, l_ref = out_refs
        acc_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l


def _inputs(q_rows, k_pages, v_pages, page_table, kv_lens, q_lens, words, kv_scales,
            row_spec, block_rows: int) -> tuple[list, list]:
    """The kernel's inputs and their BlockSpecs: lengths, the row's page table, its query
    rows, KV head k's whole page pool, then the int8 scales and tree-mask words if any."""
    h = q_rows.shape[-1]
    _, p, z, _ = k_pages.shape
    m_pad = page_table.shape[1]
    pages_spec = pl.BlockSpec((None, p, z, h), lambda b, k, i, s: (k, 0, 0, 0))
    len_spec = pl.BlockSpec((1,), lambda b, k, i, s: (b,))
    in_specs = [len_spec, len_spec,
                pl.BlockSpec((None, m_pad), lambda b, k, i, s: (b, 0)),
                row_spec, pages_spec, pages_spec]
    operands = [kv_lens, q_lens, page_table, q_rows, k_pages, v_pages]
    if kv_scales is not None:
        scale_spec = pl.BlockSpec((None, p, z, 1), lambda b, k, i, s: (k, 0, 0, 0))
        in_specs += [scale_spec, scale_spec]
        operands += list(kv_scales)
    if words is not None:
        in_specs.append(pl.BlockSpec((None, block_rows, words.shape[-1]),
                                     lambda b, k, i, s: (b, i, 0)))
        operands.append(words)
    return in_specs, operands


def _outputs(q_rows, row_spec, block_rows: int, splits: int):
    """The kernel's outputs and their BlockSpecs: the attention rows, or with `splits > 1`
    each split's float32 state (acc, m, l) for `combine_splits`."""
    b, kh, rows_pad, h = q_rows.shape
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct(q_rows.shape, q_rows.dtype)
        out_specs = row_spec
    else:
        state_spec = lambda n: pl.BlockSpec(  # noqa: E731
            (None, None, None, block_rows, n), lambda b, k, i, s: (s, b, k, i, 0))
        out_shape = [jax.ShapeDtypeStruct((splits, b, kh, rows_pad, n), jnp.float32)
                     for n in (h, 1, 1)]
        out_specs = [state_spec(h), state_spec(1), state_spec(1)]
    return out_shape, out_specs


def ragged_paged_attention_gpu(
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
    splits: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
    debug: bool,
) -> jax.Array:  # [B, K, R_pad, H]
    """Row-layout attention (see `_common`) with the Triton kernel above."""
    b, kh, rows_pad, h = q_rows.shape
    grid = (b, kh, rows_pad // block_rows, splits)
    kernel = functools.partial(
        _kernel, pages_per_block=pages_per_block, group=group, splits=splits,
        has_mask=words is not None, quantized=kv_scales is not None, scale=scale,
        soft_cap=soft_cap, sliding_window=sliding_window)
    row_spec = pl.BlockSpec((None, None, block_rows, h), lambda b, k, i, s: (b, k, i, 0))
    in_specs, operands = _inputs(q_rows, k_pages, v_pages, page_table, kv_lens, q_lens, words,
                                 kv_scales, row_spec, block_rows)
    out_shape, out_specs = _outputs(q_rows, row_spec, block_rows, splits)
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        debug=debug,
        name=f"ragged_paged_attention_{block_rows=}_{pages_per_block=}_{splits=}",
    )(*operands)
    if splits == 1:
        return out
    acc, m, l = out
    return common.combine_splits(m, l, acc).astype(q_rows.dtype)
