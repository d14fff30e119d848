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
(`specjax.cpu_kernels`; `SPECJAX_CPU_MATMUL=off` turns it off). Whether streaming 32
weight rows side by side beats XLA's own product depends on the host's memory system
(on some 2-core Xeons it reads at half XLA's rate), so before its first use on a weight
shape the kernel races XLA's matmul on this machine (`kernel_wins`) and takes only the
shapes it wins; `SPECJAX_CPU_MATMUL=on` skips the race.
"""

from __future__ import annotations

import logging
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np

from specjax import cpu_kernels, timing

ENV = "SPECJAX_CPU_MATMUL"  # "off" (or 0, false, none): XLA's matmul everywhere; "on": the
ON = frozenset({"on", "1", "true", "yes"})  # kernel wherever it applies, without a race
TARGET = "specjax_rows_matmul"
# Rows per call the kernel takes; above this XLA's GEMM is about as fast (`python -m
# specjax.bench.matmul_rows --kernel-max-rows 64 --rows 1,17,25,33,49`, docs/benchmarks.md).
MAX_ROWS = 32
KERNEL = cpu_kernels.FfiKernel(TARGET, cpu_kernels.CSRC / "rows_matmul.cc", ENV,
                               "few-row CPU matmul kernel", "XLA's matmul")
# The race: for each weight shape, the kernel against XLA's matmul at a decode step's,
# a short verify's and a tree verify's rows, over copies of the weight filling more than
# a server CPU's last-level cache (64 MB), so both read it from memory as a model's
# layers do. One verdict per shape for every row count: each row's result must not
# depend on how many rows share the call (a verify's token = a decode step's).
RACE_ROWS, RACE_BYTES, RACE_ROUNDS = (1, 5, 17), 64 << 20, 5
_log = logging.getLogger(__name__)
_wins: dict[tuple[int, int], bool] = {}  # (in, out) -> whether the kernel won
_race_lock = threading.Lock()


def available() -> bool:
    """Whether the kernel is registered with XLA:CPU (`cpu_kernels.FfiKernel.available`)."""
    return KERNEL.available()


def applies(x: jax.Array, w: jax.Array, max_rows: int = MAX_ROWS, race: bool = True) -> bool:
    """x [..., I] @ w [I, O] goes to the kernel: float32 both, at most `max_rows` rows,
    on the CPU backend, with the kernel available and, with `race`, faster than XLA's
    matmul for this weight shape on this machine (`kernel_wins`)."""
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    return (x.dtype == jnp.float32 and w.dtype == jnp.float32 and w.ndim == 2
            and x.shape[-1] == w.shape[0] and 1 <= rows <= max_rows
            and jax.default_backend() == "cpu" and available()
            and (not race or kernel_wins(tuple(w.shape))))


def kernel_wins(shape: tuple[int, int]) -> bool:
    """Whether the kernel beats XLA's matmul on weights of `shape` here: raced once per
    process and shape (`race`, a fraction of a second), or True with
    `SPECJAX_CPU_MATMUL=on`."""
    if os.environ.get(ENV, "").strip().lower() in ON:
        return True
    with _race_lock:
        if shape not in _wins:
            _wins[shape] = _race_in_thread(shape)
            _log.info("few-row CPU matmul kernel on %s weights: %s", shape,
                      "faster than XLA's, used" if _wins[shape] else
                      "slower than XLA's, not used")
        return _wins[shape]


def serves(config) -> bool:
    """Whether a decode step of a model of `config` (a `ModelConfig`) multiplies through
    the kernel here: float32, on CPU, and the kernel won on its MLP's down projection
    ([intermediate, hidden], the most common shape of its weights)."""
    return (config.dtype == "float32" and jax.default_backend() == "cpu" and available()
            and kernel_wins((config.intermediate_size, config.hidden_size)))


def _race_in_thread(shape: tuple[int, int]) -> bool:
    """`race` in a thread of its own: `applies` runs while a program is traced, and jax
    would stage the race's calls into that program rather than run them."""
    out: list = []

    def run():
        try:
            out.append(race(shape))
        except Exception as e:  # re-raised in the caller's thread, not lost with this one
            out.append(e)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    if isinstance(out[0], Exception):
        raise out[0]
    return bool(out[0])


def race(shape: tuple[int, int], rows: tuple[int, ...] = RACE_ROWS,
         rounds: int = RACE_ROUNDS, nbytes: int = RACE_BYTES) -> bool:
    """Whether the kernel's products of each of `rows` rows with copies of a `shape`
    weight (at least `nbytes` in all) take less time in sum than XLA's: per row count,
    medians over `rounds` interleaved calls of each, compiled and run once first. Seeded
    inputs. False where the kernel is not available."""
    if not available():
        return False
    rng = np.random.default_rng(0)
    copies = max(1, min(64, -(-nbytes // (4 * shape[0] * shape[1]))))
    ws = jnp.asarray(rng.standard_normal((copies, *shape), np.float32))
    forms = {"kernel": _rows, "xla": jnp.matmul}
    total = dict.fromkeys(forms, 0.0)
    for r in rows:
        x = jnp.asarray(rng.standard_normal((r, shape[0]), np.float32))
        calls = {name: (jax.jit(lambda x, ws, f=f: jax.lax.map(lambda w: f(x, w), ws)),
                        (x, ws)) for name, f in forms.items()}
        for name, seconds in timing.interleaved_medians(calls, rounds).items():
            total[name] += seconds
    return total["kernel"] < total["xla"]


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
           max_rows: int = MAX_ROWS, race: bool = True) -> jax.Array:
    """x [..., I] @ w [I, O] -> [..., O]: the kernel where it `applies` (float32 in and
    out), else XLA's. `max_rows` above `MAX_ROWS` and race=False (the kernel wherever it
    can, won or not) are for measuring it (`specjax.bench.matmul_rows`)."""
    if not applies(x, w, max_rows, race):
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

