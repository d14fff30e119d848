"""Paged attention of a few float32 (or bfloat16) queries per row on XLA:CPU through a small C++
kernel (an XLA FFI handler, `specjax/csrc/paged_attention.cc`).

The plain-jnp form (`reference_ragged_paged_attention`) gathers every page the table
names into a fresh copy per layer and softmaxes over all of them; the kernel reads only
each row's used slots, straight from the stacked cache [L, K, P, Z, H] (the layer is an
operand, not a slice), with the step's own keys/values either in the pages or beside
them (`new_kv`). Pages may be float32, bfloat16 or int8 with their scales (widened to
the float32 values `kv_quant.dequantize` gives, a chunk of slots at a time).
`specjax.attention.paged_attention` sends it the calls it `applies` to (decode steps
and verify forwards, single device); prefill chunks, other query dtypes and meshes keep
the jnp forms. It is built on first use and falls back to those
where it cannot be (`specjax.cpu_kernels`; `SPECJAX_CPU_ATTENTION=off` turns it off).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax import cpu_kernels, kv_quant
from specjax.typing import LayerIndex, NewKV, PageTable, Queries, RowLengths, TreeMask

ENV = "SPECJAX_CPU_ATTENTION"
TARGET = "specjax_paged_attention"
HEAD_MULTIPLE = 64  # head dims the kernel takes (its value pass works 64 columns at a time)
PAGE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.int8))
# queries it takes: bfloat16 ones (a bfloat16 model's) are widened, their output rounded
QUERY_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
KERNEL = cpu_kernels.FfiKernel(TARGET, cpu_kernels.CSRC / "paged_attention.cc", ENV,
                               "CPU paged-attention kernel", "the jnp attention")


def available() -> bool:
    """Whether the kernel is registered with XLA:CPU (`cpu_kernels.FfiKernel.available`)."""
    return KERNEL.available()


def takes(head_dim: int | None = None, kv_dtype=None) -> bool:
    """The kernel takes pages of `head_dim` (a multiple of 64) and `kv_dtype` (one of
    `PAGE_DTYPES`; None for either: taken to be one it takes), on the CPU backend, where
    it is available."""
    return ((head_dim is None or head_dim % HEAD_MULTIPLE == 0)
            and (kv_dtype is None or jnp.dtype(kv_dtype) in PAGE_DTYPES)
            and jax.default_backend() == "cpu" and available())


def _scaled_as_stored(pages: jax.Array, scales) -> bool:
    """Scales come with the pages exactly where they are int8 (`kv_quant`)."""
    return (scales is not None) == kv_quant.is_quantized(pages.dtype)


def applies(q: Queries, k_pages: jax.Array, scales) -> bool:
    """The kernel takes this call: float32 or bfloat16 queries, pages it `takes`, and
    `scales` exactly where the pages are int8. (Which calls to offer it is
    `specjax.attention`'s choice: decode and verify widths.)"""
    return (q.dtype in QUERY_DTYPES and _scaled_as_stored(k_pages, scales)
            and takes(q.shape[-1], k_pages.dtype))


def paged_attention(
    q: Queries,
    k_pages: jax.Array,  # [L, K, P, Z, H] float32, bfloat16 or int8
    v_pages: jax.Array,
    layer: LayerIndex,  # which of the L layers
    page_table: PageTable,
    kv_lens: RowLengths,
    q_lens: RowLengths,
    mask: TreeMask | None = None,
    *,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    new_kv: tuple[NewKV, NewKV] | None = None,
    k_scales: jax.Array | None = None,  # [L, K, P, Z] float32 for int8 pages
    v_scales: jax.Array | None = None,
) -> Queries:
    """`specjax.attention.paged_attention`'s contract (kv_lens counts the new tokens
    whether they are in the pages or in `new_kv`, which are float32 as the cache hands
    them back), on one layer of stacked pages, in float32 (bfloat16 queries widened, the
    output rounded to their dtype). Call it where `applies` holds (it registers the
    kernel on first use)."""
    if not available():
        raise RuntimeError(f"specjax's CPU paged-attention kernel is unavailable ({ENV}=off "
                           "or no C++ compiler): call it only where `applies` holds")
    if (k_pages.dtype not in PAGE_DTYPES or v_pages.dtype != k_pages.dtype
            or not _scaled_as_stored(k_pages, k_scales)
            or not _scaled_as_stored(v_pages, v_scales)):
        raise ValueError(
            f"pages of {k_pages.dtype} (keys) and {v_pages.dtype} (values) with"
            f"{'out' if k_scales is None else ''} scales: the kernel takes keys and values "
            f"of one of {[str(d) for d in PAGE_DTYPES]}, with scales exactly where int8")
    start = (kv_lens - q_lens).astype(jnp.int32)
    if new_kv is None:
        page_lens = kv_lens.astype(jnp.int32)
        k_new = v_new = jnp.zeros((0,), jnp.float32)
    else:  # the pages hold the prefix only; the new tokens follow it from new_kv
        page_lens = start
        k_new, v_new = (x.astype(jnp.float32) for x in new_kv)
    mask = jnp.zeros((0,), bool) if mask is None else mask.astype(bool)
    if k_scales is None:
        k_scales = v_scales = jnp.zeros((0,), jnp.float32)
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    call = jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")
    return call(q.astype(jnp.float32), k_pages, v_pages, k_scales.astype(jnp.float32),
                v_scales.astype(jnp.float32), jnp.asarray(layer, jnp.int32).reshape(()),
                page_table.astype(jnp.int32), page_lens, start, q_lens.astype(jnp.int32),
                mask, k_new, v_new, scale=np.float32(scale),
                soft_cap=np.float32(soft_cap or 0.0),
                window=int(sliding_window or 0)).astype(q.dtype)
