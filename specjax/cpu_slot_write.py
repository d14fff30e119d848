"""Writes into bfloat16 and float16 KV pages on XLA:CPU through a small C++ kernel (an
XLA FFI handler, `specjax/csrc/slot_write.cc`), in place.

XLA:CPU runs a scatter into 2-byte float pages in float32: its float normalization
converts the whole stacked cache [L, K, P, Z, H] to float32 and back around every write,
so a decode step's few new rows cost passes over every page (the compiled HLO of
`specjax.cache.write_kv` over bfloat16 pages shows the two converts). The kernel copies
the rows' bytes into the cache's own buffer (its result aliases the pages). `specjax.cache`
sends it the writes and moves it `applies` to; float32 and int8 pages, other backends,
and a process without a C++ compiler keep XLA's scatter (`SPECJAX_CPU_SLOT_WRITE=off`
turns the kernel off). The pages' contents are the same either way, bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax import cpu_kernels
from specjax.typing import SlotIndex

ENV = "SPECJAX_CPU_SLOT_WRITE"
TARGET = "specjax_write_slots"
# built at its first use only: float32 and int8 caches never write through it
KERNEL = cpu_kernels.FfiKernel(TARGET, cpu_kernels.CSRC / "slot_write.cc", ENV,
                               "CPU KV-slot write kernel", "XLA's scatter", with_others=False)
# the page dtypes XLA:CPU writes through float32 (and the kernel writes as they are)
NORMALIZED = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def applies(pages: jax.Array) -> bool:
    """Writes into `pages` go through the kernel: 2-byte float pages on the CPU backend,
    where the kernel is available."""
    return (pages.dtype in NORMALIZED and jax.default_backend() == "cpu"
            and KERNEL.available())


def _call(pages, rows, layer, dst_page, dst_offset, src_page, src_offset) -> jax.Array:
    """The FFI call (registering the kernel on first use); its result is the pages,
    aliased to the operand."""
    if not KERNEL.available():
        raise RuntimeError(f"specjax's CPU KV-slot write kernel is unavailable ({ENV}=off "
                           "or no C++ compiler): call it only where `applies` holds")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(pages.shape, pages.dtype),
                            input_output_aliases={0: 0}, vmap_method="sequential")
    flat = [jnp.asarray(a, jnp.int32).reshape(-1) for a in (dst_page, dst_offset, src_page,
                                                             src_offset)]
    return call(pages, rows, jnp.asarray(layer, jnp.int32).reshape(()), *flat)


def write(
    pages: jax.Array,  # [L, K, P, Z, H] (or scales [L, K, P, Z])
    layer: jax.Array | None,  # [] int32; None: `new` holds every layer
    new: jax.Array,  # [B, T, K, H] (or [B, T, K]); with layer None [L, B, T, K, H]
    page: SlotIndex,  # [B, T] int32 (outside [0, P) = drop)
    offset: SlotIndex,  # [B, T] int32
) -> jax.Array:
    """`pages` with `new` written at (page, offset) of `layer` (or of every layer), as
    `pages.at[layer, :, page, offset].set(new, mode="drop")` writes them."""
    stacked = new if layer is None else new[None]  # [Lw, B, T, K(, H)]
    lw, b, t = stacked.shape[:3]
    rows = jnp.moveaxis(stacked.reshape(lw, b * t, *stacked.shape[3:]), 1, 2)  # [Lw, K, B*T(, H)]
    none = jnp.zeros((0,), jnp.int32)
    return _call(pages, rows.astype(pages.dtype), 0 if layer is None else layer, page, offset,
                 none, none)


def move(
    pages: jax.Array,  # [L, K, P, Z, H] (or scales [L, K, P, Z])
    src_page: SlotIndex,  # [B, T] int32, in [0, P) where dst_page is
    src_offset: SlotIndex,
    dst_page: SlotIndex,  # [B, T] int32 (outside [0, P) = drop)
    dst_offset: SlotIndex,
) -> jax.Array:
    """`pages` with every layer's slots (src_page, src_offset) copied to (dst_page,
    dst_offset), all sources read before any slot is written (as a gather then scatter)."""
    rows = jnp.zeros((0,), pages.dtype)
    return _call(pages, rows, 0, dst_page, dst_offset, src_page, src_offset)
