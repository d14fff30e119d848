"""Few-row float32 matmuls on XLA:CPU through a small C++ kernel (an XLA FFI handler).

A decode step multiplies each weight matrix by one row per sequence and a verify
forward by a few. XLA:CPU's GEMM of a few rows costs far more than its one-row GEMV
although both read the same weights, and that, more than anything, makes a verify dear
on CPU (`python -m specjax.bench.matmul_rows`; figures in docs/benchmarks.md).
`specjax/csrc/rows_matmul.cc` streams each weight row once for all rows (up to
`MAX_ROWS`); the CPU decode layout's dense layers and LM head call it through `matmul` /
`dot_general` (`specjax.models.transformer`), and so do a draft model's trimmed head and
an EAGLE head beside a target in that layout.

The kernel is built on first use with the system C++ compiler (`$CXX`, else `c++`;
`-O3 -march=native`, jaxlib's FFI headers), about 3 s, into jax's persistent
compilation cache directory when that is on (`specjax.compile_cache`), else into a
temporary directory for this process. Where it cannot be built, or with
`SPECJAX_CPU_MATMUL=off`, XLA's own matmul runs instead (a warning, once).
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ENV = "SPECJAX_CPU_MATMUL"  # "off" (or 0, false, none): XLA's matmul everywhere
TARGET = "specjax_rows_matmul"
SOURCE = Path(__file__).parent / "csrc" / "rows_matmul.cc"
# Rows per call the kernel takes; above this XLA's GEMM is about as fast (`python -m
# specjax.bench.matmul_rows --kernel-max-rows 64 --rows 1,17,25,33,49`, docs/benchmarks.md).
MAX_ROWS = 32
_OFF = frozenset({"off", "0", "false", "none"})
_lock = threading.Lock()
_state: dict = {}  # "ok": bool once tried; "lib": the loaded library (kept referenced)


def _cxx() -> str | None:
    return shutil.which(os.environ.get("CXX") or "c++")


def _cpu_flags() -> str:
    """The CPU's feature flags (-march=native builds for them), for the library's key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _library_dir() -> Path:
    """jax's persistent compilation cache directory when it is on, else a temp dir."""
    cache = jax.config.jax_compilation_cache_dir
    if cache and jax.config.jax_enable_compilation_cache and "://" not in cache:
        return Path(cache) / "specjax-kernels"
    directory = tempfile.mkdtemp(prefix="specjax-kernels-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return Path(directory)


def _build(cxx: str) -> Path:
    """The shared library for this source, compiler, jaxlib and CPU, built if absent."""
    include = jax.ffi.include_dir()
    flags = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w"]
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                             check=True).stdout
    parts = [SOURCE.read_text(), version, importlib.metadata.version("jaxlib"), _cpu_flags(),
             *flags]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    directory = _library_dir()
    lib = directory / f"rows_matmul-{key}.so"
    if lib.exists():
        return lib
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{lib.name}.{os.getpid()}.tmp"
    done = subprocess.run([cxx, *flags, f"-I{include}", str(SOURCE), "-o", str(tmp)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{cxx} failed on {SOURCE}:\n{done.stderr[-2000:]}")
    os.replace(tmp, lib)  # atomic: concurrent builders (test workers) each write whole
    return lib


def available() -> bool:
    """Whether the kernel is registered with XLA:CPU (built and loaded on first call);
    False with a warning, once, where it cannot be, and quietly when turned off."""
    if os.environ.get(ENV, "").strip().lower() in _OFF:
        return False
    with _lock:
        if "ok" not in _state:
            _state["ok"] = False
            cxx = _cxx()
            try:
                if cxx is None:
                    raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX') or 'c++'}"
                                       " not on PATH; set CXX)")
                lib = ctypes.cdll.LoadLibrary(str(_build(cxx)))
                jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.specjax_rows_matmul),
                                            platform="cpu")
                _state.update(ok=True, lib=lib)
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                warnings.warn(f"specjax's few-row CPU matmul kernel is unavailable ({e}); "
                              f"XLA's matmul runs instead. {ENV}=off silences this.",
                              RuntimeWarning, stacklevel=2)
        return _state["ok"]


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

