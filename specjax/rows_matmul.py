"""Few-row float32 matmuls on XLA:CPU through a small C++ kernel (an XLA FFI handler).

A decode step multiplies each weight matrix by one row per sequence and a verify
forward by a few. XLA:CPU's GEMM of a few rows costs far more than its one-row GEMV
although both read the same weights, and that, more than anything, makes a verify dear
on CPU (`python -m specjax.bench.matmul_rows`; figures in docs/benchmarks.md).
`specjax/csrc/rows_matmul.cc` streams each weight row once for all rows (up to
`MAX_ROWS`); the CPU decode layout's dense layers and LM head call it through `matmul` /
`dot_general` (`specjax.models.transformer`), and so do a draft model's trimmed head and
an EAGLE head beside a target in that layout.

It is built on first use and falls back to XLA's matmul where it cannot be
(`specjax.cpu_kernels`; `SPECJAX_CPU_MATMUL=off` turns it off).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax import cpu_kernels

ENV = "SPECJAX_CPU_MATMUL"  # "off" (or 0, false, none): XLA's matmul everywhere
TARGET = "specjax_rows_matmul"
# Rows per call the kernel takes; above this XLA's GEMM is about as fast (`python -m
# specjax.bench.matmul_rows --kernel-max-rows 64 --rows 1,17,25,33,49`, docs/benchmarks.md).
MAX_ROWS = 32
KERNEL = cpu_kernels.FfiKernel(TARGET, cpu_kernels.CSRC / "rows_matmul.cc", ENV,
                               "few-row CPU matmul kernel", "XLA's matmul")


def available() -> bool:
    """Whether the kernel is registered with XLA:CPU (`cpu_kernels.FfiKernel.available`)."""
    return KERNEL.available()


def applies(x: jax.Array, w: jax.Array, max_rows: int = MAX_ROWS) -> bool:
    """x [..., I] @ w [I, O] goes to the kernel: float32 both, at most `max_rows` rows,
    on the CPU backend, with the kernel available."""
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    return (x.dtype == jnp.float32 and w.dtype == jnp.float32 and w.ndim == 2
            and x.shape[-1] == w.shape[0] and 1 <= rows <= max_rows
            and jax.default_backend() == "cpu" and available())


@jax.custom_jvp
def _kernel(x: jax.Array, w: jax.Array) -> jax.Array:  # [R, I] @ [I, O] -> [R, O]
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x, w)


@_kernel.defjvp
def _kernel_jvp(primals, tangents):  # differentiable: tangents through XLA's matmul
    (x, w), (dx, dw) = primals, tangents
    return _kernel(x, w), dx @ w + x @ dw


def _rows(x: jax.Array, w: jax.Array) -> jax.Array:  # [..., I] @ [I, O] by the kernel
    return _kernel(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[1])


def matmul(x: jax.Array, w: jax.Array, preferred_element_type=None,
           max_rows: int = MAX_ROWS) -> jax.Array:
    """x [..., I] @ w [I, O] -> [..., O]: the kernel where it `applies` (float32 in and
    out), else XLA's. `max_rows` above `MAX_ROWS` is for measuring where it stops paying
    (`specjax.bench.matmul_rows --kernel-max-rows`)."""
    if not applies(x, w, max_rows):
        return jnp.matmul(x, w, preferred_element_type=preferred_element_type)
    return _rows(x, w)


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                **kwargs):
    """`jax.lax.dot_general` for `flax.linen.Dense(dot_general=)`: its product (the last
    axis of lhs with the first of a 2-D rhs, no batch axes) goes to `matmul`."""
    (lc, rc), (lb, rb) = dimension_numbers
    dense = (tuple(lc) == (lhs.ndim - 1,) and tuple(rc) == (0,) and not lb and not rb
             and preferred_element_type in (None, jnp.float32))
    if dense and applies(lhs, rhs):
        return _rows(lhs, rhs)
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type, **kwargs)

