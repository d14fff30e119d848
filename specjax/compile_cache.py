"""JAX's persistent compilation cache, as specjax's command lines turn it on.

`enable()` points jax at a cache directory, so a compiled program (generate's prefill
and decode loop, a training step) is written to disk once and read back by the next
process instead of compiled again. The command lines (`specjax ...`, `python -m
specjax.train.run`) call it before anything compiles; the library never does (importing
specjax or calling `specjax.generate` writes nothing to the user's home). In a notebook
or script, `specjax.compile_cache.enable()` before the first compile does the same.

The directory, first match wins:
  1. the `path` argument (the CLI's `--compilation-cache DIR|off`);
  2. `$SPECJAX_COMPILATION_CACHE` (a directory, or `off`);
  3. jax's own setting, when one was made (`JAX_COMPILATION_CACHE_DIR`,
     `JAX_ENABLE_COMPILATION_CACHE=false`, or `jax.config.update`);
  4. `$XDG_CACHE_HOME/specjax/jax`, by default `~/.cache/specjax/jax`.
`off` (also `0`, `false`, `none`; any case) disables the cache. An empty value counts
as unset. A remote cache (a URL) is jax's own setting: `JAX_COMPILATION_CACHE_DIR`.
jax trusts what it reads there: keep the directory writable by you alone.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import jax

ENV = "SPECJAX_COMPILATION_CACHE"
OFF = frozenset({"off", "0", "false", "none"})

# jax caches only programs that took at least this long to compile (its default is 1 s).
# On CPU the programs worth caching (a prefill, a decode loop, a training step) take
# from about a second up, and some sit right at 1 s; the many tiny ones (an argmax, a
# slice, a cast) take well under 0.1 s and would cost about as much to read back as to
# compile, while filling the directory with entries. 0.5 s keeps the first kind with
# margin and skips the second. `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` overrides.
# (jax's other threshold, `jax_persistent_cache_min_entry_size_bytes`, is 0 by default:
# no size floor on a local filesystem, so it is left alone.)
MIN_COMPILE_TIME_SECS = 0.5


def default_dir() -> Path:
    """`$XDG_CACHE_HOME/specjax/jax`, or `~/.cache/specjax/jax`."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "specjax" / "jax"


def _parse(value: str | os.PathLike) -> Path | None:
    text = os.fspath(value)
    if text.strip().lower() in OFF:
        return None
    if "://" in text:
        raise ValueError(f"compilation cache {text!r}: not a local directory (for a remote "
                         "cache set JAX_COMPILATION_CACHE_DIR, which jax reads itself)")
    return Path(os.path.abspath(os.path.expanduser(text)))


def resolve(path: str | os.PathLike | None = None) -> tuple[Path | None, str]:
    """The directory `enable(path)` would use (None: off) and where that came from:
    "argument", "env", "jax" or "default"."""
    if path is not None and os.fspath(path) != "":
        return _parse(path), "argument"
    if os.environ.get(ENV, ""):
        return _parse(os.environ[ENV]), "env"
    if not jax.config.jax_enable_compilation_cache:
        return None, "jax"
    if jax.config.jax_compilation_cache_dir:
        return Path(jax.config.jax_compilation_cache_dir), "jax"
    return default_dir(), "default"


def enable(path: str | os.PathLike | None = None) -> Path | None:
    """Turns jax's persistent compilation cache on in `path` (see the module docstring
    for the order of `path`, `$SPECJAX_COMPILATION_CACHE`, jax's own setting and the
    default) and returns the directory, or turns it off and returns None. Idempotent;
    takes effect for the next compile, so call it before the first one.

    A value naming an existing file, or a directory that cannot be created, is a
    ValueError; at the default location that only warns and leaves the cache off.
    """
    directory, source = resolve(path)
    if directory is not None and source != "jax":  # jax's own directory is left as set
        problem = None
        if directory.exists() and not directory.is_dir():
            problem = "it exists and is not a directory"
        else:
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                problem = f"cannot create it ({e.strerror or e})"
        if problem and source in ("argument", "env"):
            name = repr(os.fspath(path)) if source == "argument" else f"${ENV}={os.environ[ENV]!r}"
            raise ValueError(f"compilation cache {name}: {problem}")
        if problem:
            warnings.warn(f"compilation cache {str(directory)!r} left off: {problem}",
                          RuntimeWarning, stacklevel=2)
            directory = None
    if directory is None:
        _set(jax_enable_compilation_cache=False)
        return None
    updates = {"jax_enable_compilation_cache": True}
    if source != "jax":
        updates["jax_compilation_cache_dir"] = str(directory)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        updates["jax_persistent_cache_min_compile_time_secs"] = MIN_COMPILE_TIME_SECS
    _set(**updates)
    return directory


def _set(**updates) -> None:
    """Updates jax's config; resets jax's cache object when the cache's location or
    on/off state changed (jax opens it once, at the first compile that uses it)."""
    keys = ("jax_enable_compilation_cache", "jax_compilation_cache_dir")
    before = [getattr(jax.config, k) for k in keys]
    for name, v in updates.items():
        jax.config.update(name, v)
    if [getattr(jax.config, k) for k in keys] != before:
        from jax.experimental.compilation_cache import compilation_cache

        compilation_cache.reset_cache()
