"""bfloat16 products of many rows (a prompt's prefill) on XLA:CPU through a small C++
kernel (an XLA FFI handler, `specjax/csrc/bf16_gemm_t.cc`).

XLA:CPU has no bfloat16 matmul: it converts both operands to float32 and, for the
weights of a scan over layers, hoists that conversion out of the loop, so each prefill
of a bfloat16 model converts all of its weights before the first product. The kernel
multiplies the bfloat16 rows by the decode layout's transposed bfloat16 weights ([O, I],
`specjax.model.decode_params`) as they lie, by AVX512-BF16's dot-product instruction,
summing in float32. `rows_matmul.matmul_t` sends it the products of more rows than the
few-row kernel takes, on CPUs with that instruction (`applies`); elsewhere XLA's product
runs (the kernel's portable path is for the tests: XLA's conversion and GEMM beat it).
`SPECJAX_CPU_BF16_GEMM=off` turns it off (XLA's product runs).
"""

from __future__ import annotations

import ctypes
import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax import cpu_kernels
from specjax.cpu_kernels import layer_of, layer_operand

ENV = "SPECJAX_CPU_BF16_GEMM"  # "off" (or 0, false, none): XLA's product
TARGET = "specjax_bf16_gemm_t"
KERNEL = cpu_kernels.FfiKernel(TARGET, cpu_kernels.CSRC / "bf16_gemm_t.cc", ENV,
                               "bfloat16 CPU GEMM kernel", "XLA's matmul", with_others=False)
BF16 = jnp.dtype(jnp.bfloat16)


def available() -> bool:
    """Whether the kernel is registered with XLA:CPU (`cpu_kernels.FfiKernel.available`)."""
    return KERNEL.available()


def native() -> bool:
    """Whether the kernel is available and its build multiplies by the AVX512-BF16
    instruction. Asked of the built library; a CPU that does not list the instruction
    is answered without building it."""
    if "avx512_bf16" not in cpu_kernels.cpu_flags().split():
        return False
    return available() and _built_native()


@functools.cache
def _built_native() -> bool:
    lib = ctypes.cdll.LoadLibrary(str(KERNEL.library_path()))
    return bool(lib.specjax_bf16_gemm_native())


def applies(x: jax.Array, wt: jax.Array, min_rows: int) -> bool:
    """x [..., I] @ wt [O, I]^T goes to the kernel: bfloat16 both, at least `min_rows`
    rows (`rows_matmul.matmul_t` sends fewer to the few-row kernel), on the CPU
    backend, with the kernel built for the instruction."""
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    return (x.dtype == BF16 and wt.dtype == BF16 and rows >= min_rows
            and x.shape[-1] == wt.shape[-1] and jax.default_backend() == "cpu"
            and native())


def _call(x: jax.Array, wt: jax.Array, layer: jax.Array, portable: bool) -> jax.Array:
    """[R, I] @ wt [O, I]^T (or layer `layer` of [L, O, I]) in float32."""
    out = jax.ShapeDtypeStruct((x.shape[0], wt.shape[-2]), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(
        x, wt, layer, native=np.int64(0 if portable else 1))


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _product(x: jax.Array, wt: jax.Array, layer: jax.Array, portable: bool) -> jax.Array:
    rows = x.reshape(-1, x.shape[-1])
    return _call(rows, wt, layer, portable).reshape(*x.shape[:-1], wt.shape[-2])


@_product.defjvp
def _product_jvp(portable, primals, tangents):  # differentiable: tangents through XLA's
    (x, wt, layer), (dx, dwt, _) = primals, tangents
    def xla(a, w):
        return jnp.einsum("...i,oi->...o", a, layer_of(w, layer),
                          preferred_element_type=jnp.float32)

    return _product(x, wt, layer, portable), xla(dx, wt) + xla(x, dwt)


def product(x: jax.Array, wt: jax.Array, layer=None, portable: bool = False) -> jax.Array:
    """x [..., I] @ wt [O, I]^T (or layer `layer` of a stack [L, O, I], read in place)
    -> float32 [..., O] by the kernel, bfloat16 operands. portable: the widened-value
    path (the instruction's sums, bit for bit on normal values) even where the build has
    the instruction."""
    if x.dtype != BF16 or wt.dtype != BF16:
        raise ValueError(f"the bfloat16 GEMM takes bfloat16 operands, got x {x.dtype} "
                         f"and wt {wt.dtype}")
    if wt.ndim not in (2, 3) or (wt.ndim == 3) != (layer is not None):
        raise ValueError(f"wt {wt.shape} must be [O, I], or [L, O, I] with a layer")
    if x.shape[-1] != wt.shape[-1]:
        raise ValueError(f"x {x.shape} and wt {wt.shape} differ in I")
    if not available():
        raise RuntimeError(f"specjax's bfloat16 CPU GEMM kernel is unavailable ({ENV}=off "
                           "or no C++ compiler): call it only where `applies` holds")
    return _product(x, wt, layer_operand(layer), portable)
