"""The public entry point: picks the lowering and block sizes, then runs the jitted kernel.

`ragged_paged_attention` has the signature and contract of its plain-jnp reference,
`reference.reference_ragged_paged_attention` (contract: `specjax.attention`). Lowering:
GPU -> Triton, TPU -> Mosaic, CPU -> the Triton kernel in interpret mode: it
discharges to plain XLA loops and runs far faster per call than the TPU interpreter
(which simulates DMAs and semaphores) on the test shapes (docs/kernels.md).
`lowering="mosaic"` still runs the TPU kernel on CPU, under `pltpu.InterpretParams`.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from specjax.pallas_kernels.ragged_paged_attention import (
    _common as common,
    launch,
    tuned_block_sizes as tuned,
    validation,
)

Lowering = Literal["triton", "mosaic"]
LOWERINGS = ("triton", "mosaic")
_TRITON_MIN_DIM = 16  # every dim of a Triton dot


def resolve_block_sizes(q_shape, pages_shape, pages_per_row: int, dtype, *,
                        lowering: Lowering, interpret: bool, block_rows: int | None = None,
                        pages_per_block: int | None = None,
                        kv_splits: int | None = None, num_warps: int | None = None,
                        num_stages: int | None = None,
                        device_kind: str | None = None) -> dict:
    """Static kernel options: the caller's, else the tuned table's, fitted to the problem.

    The table entry is the one for `device_kind` (default: the first device's; CPU's
    when interpreting), so a GPU's options can be resolved on a CPU host
    (`specjax.pallas_kernels.compile_check`).

    Requested sizes are validated first; then block_rows shrinks to the next power of 2
    above T x G and pages_per_block to the table width (never below what the lowering's
    tiles need), and Triton splits KV until the grid has the table's `min_programs`.
    """
    b, t, n, _ = q_shape
    kh, _, z, h = pages_shape
    sizes = tuned.get_block_sizes(t, "cpu" if interpret else device_kind)
    if block_rows is None:
        block_rows = sizes.block_rows
    if pages_per_block is None:
        pages_per_block = common.prev_pow2(sizes.block_kv // z)
    validation.check_block_sizes(
        lowering=lowering, interpret=interpret, block_rows=block_rows,
        pages_per_block=pages_per_block, kv_splits=1 if kv_splits is None else kv_splits,
        page_size=z, head_dim=h, num_warps=num_warps, num_stages=num_stages)
    if lowering == "triton":
        min_rows, min_pages = _TRITON_MIN_DIM, common.next_pow2(common.cdiv(_TRITON_MIN_DIM, z))
    else:  # TPU sublane tile: 8 rows of 32-bit, 16 of 16-bit values
        min_rows, min_pages = 8 * 4 // jnp.dtype(dtype).itemsize, 1
    rows = t * (n // kh)
    block_rows = min(block_rows, max(min_rows, common.next_pow2(rows)))
    pages_per_block = min(pages_per_block, max(min_pages, common.next_pow2(pages_per_row)))
    if kv_splits is None:
        kv_splits = 1
        if lowering == "triton":
            programs = b * kh * common.cdiv(rows, block_rows)
            kv_blocks = common.cdiv(pages_per_row, pages_per_block)
            kv_splits = max(1, min(common.cdiv(sizes.min_programs, programs), kv_blocks))
    return dict(block_rows=block_rows, pages_per_block=pages_per_block, kv_splits=kv_splits,
                num_warps=num_warps or sizes.num_warps,
                num_stages=num_stages or sizes.num_stages)


_NATIVE = {"gpu": "triton", "cuda": "triton", "rocm": "triton", "tpu": "mosaic"}


def native_lowering() -> Lowering | None:
    """The lowering that compiles for `jax.default_backend()`; None on CPU."""
    return _NATIVE.get(jax.default_backend())


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
    k_scales: jax.Array | None = None,  # [K, P, Z] float32 when the pages are int8
    v_scales: jax.Array | None = None,  # [K, P, Z] float32
    lowering: Lowering | None = None,
    interpret: bool | None = None,
    block_rows: int | None = None,
    pages_per_block: int | None = None,
    kv_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    debug: bool = False,
    validate: bool = False,
) -> jax.Array:  # [B, T, N, H]
    """Tree/causal attention of T new tokens per row over a paged KV cache (Pallas).

    Same contract as `reference_ragged_paged_attention`. Options left None:
    the device's own lowering (CPU: Triton in interpret mode), compiled unless it is
    not the device's, and block sizes from the tuned table for this device and T;
    `block_rows` is an upper bound (a small T x G uses the next power of 2 above it);
    `num_warps` / `num_stages` are Triton's (tuning: `specjax.pallas_kernels.bench --tune`).
    `validate=True` also runs `check_inputs` on the values (concrete arrays only).
    Pages may be another float dtype than q (computed in the wider of the two, as the
    reference), or int8 (`quantize_pages`) with per-slot scales: a block is dequantized
    to q's dtype after it is read, so the pages move half the bytes of bf16 ones.
    """
    validation.static_check(q, k_pages, v_pages, page_table, kv_lens, q_lens, mask,
                            scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
                            k_scales=k_scales, v_scales=v_scales)
    if validate:
        validation.check_inputs(q, k_pages, v_pages, page_table, kv_lens, q_lens)
    native = native_lowering()
    lowering = lowering or native or "triton"
    if lowering not in LOWERINGS:
        raise ValueError(f"{lowering=} must be one of {LOWERINGS}")
    interpret = lowering != native if interpret is None else interpret
    sizes = resolve_block_sizes(
        q.shape, k_pages.shape, page_table.shape[1], q.dtype, lowering=lowering,
        interpret=interpret, block_rows=block_rows, pages_per_block=pages_per_block,
        kv_splits=kv_splits, num_warps=num_warps, num_stages=num_stages)
    return launch.launch(
        q, k_pages, v_pages, page_table, kv_lens, q_lens, mask, k_scales, v_scales,
        scale=float(scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=sliding_window, lowering=lowering, interpret=bool(interpret),
        debug=debug, **sizes)
