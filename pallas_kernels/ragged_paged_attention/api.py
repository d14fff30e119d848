"""The public entry point: picks the lowering and block sizes, then runs the jitted kernel.

`ragged_paged_attention` has the signature and contract of
`specjax.attention.reference_paged_attention` (see that module's docstring). Lowering:
GPU -> Triton, TPU -> Mosaic, CPU -> the Triton kernel in interpret mode (the faster of
the two interpreters on CPU by about 10x on the test shapes: it discharges to plain XLA
loops, while TPU interpret mode simulates DMAs and semaphores; `lowering="mosaic"`
still runs the TPU kernel on CPU, under `pltpu.InterpretParams`).
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention import _common as common
from pallas_kernels.ragged_paged_attention import gpu, tpu
from pallas_kernels.ragged_paged_attention import tuned_block_sizes as tuned
from pallas_kernels.ragged_paged_attention import validation

Lowering = Literal["triton", "mosaic"]
_MIN_ROWS = {"triton": 16, "mosaic": 8}  # Triton dots need >= 16; TPU sublanes are 8


def default_lowering() -> tuple[Lowering, bool]:
    """(lowering, interpret) for `jax.default_backend()`."""
    backend = jax.default_backend()
    if backend == "tpu":
        return "mosaic", False
    if backend in ("gpu", "cuda", "rocm"):
        return "triton", False
    return "triton", True


@functools.partial(jax.jit, static_argnames=(
    "scale", "soft_cap", "sliding_window", "lowering", "block_rows", "pages_per_block",
    "kv_splits", "num_warps", "num_stages", "interpret", "debug"))
def _ragged_paged_attention(
    q: jax.Array,  # [B, T, N, H]
    k_pages: jax.Array,  # [K, P, Z, H]
    v_pages: jax.Array,  # [K, P, Z, H]
    page_table: jax.Array,  # [B, M] int32
    kv_lens: jax.Array,  # [B] int32
    q_lens: jax.Array,  # [B] int32
    mask: jax.Array | None,  # [B, T, T] bool
    *,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    lowering: Lowering,
    block_rows: int,
    pages_per_block: int,
    kv_splits: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
    debug: bool,
) -> jax.Array:  # [B, T, N, H]
    b, t, n, h = q.shape
    kh, p, _, _ = k_pages.shape
    group = n // kh
    rows_pad = common.cdiv(t * group, block_rows) * block_rows
    q_rows = common.rows_from_q(q, kh, rows_pad)  # [B, K, R_pad, H]
    words = None if mask is None else common.mask_words(mask, group, rows_pad)
    table = common.pad_page_table(page_table, p, pages_per_block)  # [B, M_pad]
    args = (q_rows, k_pages, v_pages, table, kv_lens, q_lens, words)
    opts = dict(group=group, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
                block_rows=block_rows, pages_per_block=pages_per_block, debug=debug)
    if lowering == "triton":
        out = gpu.ragged_paged_attention_gpu(*args, **opts, splits=kv_splits,
                                             num_warps=num_warps, num_stages=num_stages,
                                             interpret=interpret)
    else:
        out = tpu.ragged_paged_attention_tpu(
            *args, **opts, interpret=pltpu.InterpretParams() if interpret else False)
    return common.q_from_rows(out, t, n)


def ragged_paged_attention(
    q: jax.Array,  # [B, T, N, H]
    k_pages: jax.Array,  # [K, P, Z, H]
    v_pages: jax.Array,  # [K, P, Z, H]
    page_table: jax.Array,  # [B, M] int32
    kv_lens: jax.Array,  # [B] int32
    q_lens: jax.Array,  # [B] int32
    mask: jax.Array | None = None,  # [B, T, T] bool, None = causal
    *,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    lowering: Lowering | None = None,
    interpret: bool | None = None,
    block_rows: int | None = None,
    pages_per_block: int | None = None,
    kv_splits: int | None = None,
    debug: bool = False,
    validate: bool = False,
) -> jax.Array:  # [B, T, N, H]
    """Tree/causal attention of T new tokens per row over a paged KV cache (Pallas).

    Same contract as `specjax.attention.reference_paged_attention`. Options left None
    come from `default_lowering()` and the tuned table for this device and T;
    `block_rows` is an upper bound (a small T x G uses the next power of 2 above it).
    `validate=True` also runs `check_inputs` on the values (concrete arrays only).
    """
    validation.static_check(q, k_pages, v_pages, page_table, kv_lens, q_lens, mask,
                            scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
    if validate:
        validation.check_inputs(q, k_pages, v_pages, page_table, kv_lens, q_lens, mask)
    default, default_interpret = default_lowering()
    lowering = lowering or default
    if lowering not in _MIN_ROWS:
        raise ValueError(f"{lowering=} must be one of {tuple(_MIN_ROWS)}")
    interpret = default_interpret if interpret is None else interpret
    b, t, n, _ = q.shape
    kh, _, z, h = k_pages.shape
    sizes = tuned.get_block_sizes(t, "cpu" if interpret else None)
    block_rows = block_rows or sizes.block_rows
    pages_per_block = pages_per_block or common.prev_pow2(sizes.block_kv // z)
    validation.check_block_sizes(
        lowering=lowering, interpret=interpret, block_rows=block_rows,
        pages_per_block=pages_per_block, kv_splits=kv_splits or 1, page_size=z,
        head_dim=h)
    # Shrink blocks to the problem: T x G rows, M pages.
    rows = t * (n // kh)
    block_rows = min(block_rows, max(_MIN_ROWS[lowering], common.next_pow2(rows)))
    pages_per_block = min(pages_per_block, common.next_pow2(page_table.shape[1]))
    if kv_splits is None:
        kv_splits = 1
        if lowering == "triton":
            programs = b * kh * common.cdiv(rows, block_rows)
            kv_blocks = common.cdiv(page_table.shape[1], pages_per_block)
            kv_splits = max(1, min(common.cdiv(sizes.min_programs, programs), kv_blocks))
    return _ragged_paged_attention(
        q, k_pages, v_pages, page_table, kv_lens, q_lens, mask, scale=float(scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=sliding_window, lowering=lowering, block_rows=block_rows,
        pages_per_block=pages_per_block, kv_splits=kv_splits, num_warps=sizes.num_warps,
        num_stages=sizes.num_stages, interpret=bool(interpret), debug=debug)
