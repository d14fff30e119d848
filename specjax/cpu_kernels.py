"""specjax's C++ kernels for XLA:CPU (XLA FFI handlers in `specjax/csrc`): building,
caching and registering them.

A kernel's source is built on first use with the system C++ compiler (`$CXX`, else
`c++`; `-O3 -march=native`, jaxlib's FFI headers), a few seconds, every other kernel's
beside it (one compiler process per core: `build_with_the_others`), into jax's persistent
compilation cache directory when that is on (`specjax.compile_cache`), else into a
temporary directory for this process; the library's name keys on the source, the
headers beside it (`csrc/*.h`), compiler, jaxlib and CPU. Where it cannot be built, or
with its environment switch set to `off`, XLA's own ops run instead (a warning, once).
Users: `specjax.rows_matmul`, `specjax.cpu_attention`, `specjax.cpu_slot_write`.
"""

from __future__ import annotations

import atexit
import concurrent.futures
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

from specjax.compile_cache import OFF  # the same spellings of "off"

CSRC = Path(__file__).parent / "csrc"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")


def cxx() -> str | None:
    """The C++ compiler: `$CXX`, else `c++`, if on PATH."""
    return shutil.which(os.environ.get("CXX") or "c++")


def cpu_flags() -> str:
    """The CPU's feature flags (-march=native builds for them), for the library's key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def persistent_dir() -> Path | None:
    """`specjax-kernels` in jax's persistent compilation cache directory when that is on
    (a local one), else None."""
    cache = jax.config.jax_compilation_cache_dir
    if cache and jax.config.jax_enable_compilation_cache and "://" not in cache:
        return Path(cache) / "specjax-kernels"
    return None


def library_dir() -> Path:
    """`persistent_dir()` when the compilation cache is on, else a temp dir."""
    kept = persistent_dir()
    if kept is not None:
        return kept
    directory = tempfile.mkdtemp(prefix="specjax-kernels-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return Path(directory)


def build(source: Path, compiler: str, directory: Path | None = None) -> Path:
    """The shared library of `source` for this compiler, jaxlib and CPU, built into
    `directory` (default `library_dir()`) if not there yet."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=True).stdout
    headers = [h.read_text() for h in sorted(CSRC.glob("*.h"))]  # what sources include
    parts = [source.read_text(), *headers, version, importlib.metadata.version("jaxlib"),
             cpu_flags(), *FLAGS]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    directory = library_dir() if directory is None else directory
    lib = directory / f"{source.stem}-{key}.so"
    if lib.exists():
        return lib
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{lib.name}.{os.getpid()}.tmp"
    done = subprocess.run([compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(source),
                           "-o", str(tmp)], capture_output=True, text=True)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{compiler} failed on {source}:\n{done.stderr[-2000:]}")
    os.replace(tmp, lib)  # atomic: concurrent builders (test workers) each write whole
    return lib


# every kernel made in this process, and the builds started for them and not yet
# collected ({(source, compiler): future}): `build_with_the_others`. One thread per
# core: a build is one compiler process on one core.
KERNELS: list[FfiKernel] = []
_builds: dict[tuple[Path, str], concurrent.futures.Future] = {}
_builds_lock = threading.Lock()
_builders = concurrent.futures.ThreadPoolExecutor(max(os.cpu_count() or 1, 1),
                                                  thread_name_prefix="specjax-kernel-build")


def build_with_the_others(kernel: FfiKernel, compiler: str) -> Path:
    """`build(kernel.source, compiler)`, started together with the builds of every other
    kernel that is on, not yet tried and built `with_others`: the compiler runs on one
    core per source and a first decode call needs all of them (its matmuls and its
    attention), so it waits for the slowest builds rather than for their sum. Each other
    build's result waits for that kernel's first `available()`."""
    with _builds_lock:
        others = [k for k in KERNELS if k is not kernel and k.is_on() and not k.tried()
                  and k.with_others]
        for k in [kernel, *others]:
            if (k.source, compiler) not in _builds:
                _builds[k.source, compiler] = _builders.submit(build, k.source, compiler)
        mine = _builds.pop((kernel.source, compiler))
    return mine.result()


class FfiKernel:
    """One kernel: `target` is both its FFI handler's symbol in `source` and the name
    XLA:CPU knows it by; `env` set to `off` (or 0, false, none) turns it off.
    with_others: its build starts beside another kernel's first build (every decode call
    needs it); False: only at its own first use (only some models need it)."""

    def __init__(self, target: str, source: Path, env: str, what: str, fallback: str,
                 with_others: bool = True):
        self.target, self.source, self.env = target, source, env
        self.what, self.fallback = what, fallback
        self.with_others = with_others
        self._lock = threading.Lock()
        # "ok": bool once tried; "lib": the library (kept referenced); "path": its file
        self._state: dict = {}
        KERNELS.append(self)

    def is_on(self) -> bool:
        """False where its environment switch turns it off."""
        return os.environ.get(self.env, "").strip().lower() not in OFF

    def tried(self) -> bool:
        """Whether its first `available()` has begun (its build started or done)."""
        return "ok" in self._state

    def available(self) -> bool:
        """Whether the kernel is registered with XLA:CPU (built and loaded on first call,
        the other kernels' builds started beside its own: `build_with_the_others`);
        False with a warning, once, where it cannot be, and quietly when turned off."""
        if not self.is_on():
            return False
        with self._lock:
            if "ok" not in self._state:
                self._state["ok"] = False
                compiler = cxx()
                try:
                    if compiler is None:
                        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX') or 'c++'}"
                                           " not on PATH; set CXX)")
                    path = build_with_the_others(self, compiler)
                    lib = ctypes.cdll.LoadLibrary(str(path))
                    jax.ffi.register_ffi_target(
                        self.target, jax.ffi.pycapsule(getattr(lib, self.target)),
                        platform="cpu")
                    self._state.update(ok=True, lib=lib, path=path)
                except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                    warnings.warn(f"specjax's {self.what} is unavailable ({e}); "
                                  f"{self.fallback} runs instead. {self.env}=off silences "
                                  "this.", RuntimeWarning, stacklevel=3)
            return self._state["ok"]

    def library_path(self) -> Path | None:
        """The loaded library's file (its name keys on source, compiler, jaxlib and CPU),
        or None where the kernel is not available."""
        return self._state.get("path") if self.available() else None


def layer_operand(layer) -> jax.Array:
    """The matmul kernels' layer operand (`csrc/layered.h`): an int32 scalar (0 for a
    single matrix)."""
    return jax.numpy.asarray(0 if layer is None else layer, jax.numpy.int32).reshape(())


def layer_of(w: jax.Array, layer) -> jax.Array:
    """Layer `layer` of a stacked weight [L, A, B] (`w` itself when 2-D): a slice, so on
    XLA:CPU a copy; the kernels read the layer in place instead."""
    return w if w.ndim == 2 else jax.lax.dynamic_index_in_dim(w, layer, 0, keepdims=False)
