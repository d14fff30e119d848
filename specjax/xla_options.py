"""XLA compiler options for the decode programs (generate's prefill and loop).

XLA:CPU hands matmuls with more than one row to YNNPACK fusions by default. At decode
shapes (M = batch x verified tokens, from 2 to a few dozen rows against weights of a
few hundred columns) those run slower than XLA's own dot path: on the 25M benchmark
Llama a 5-token verify forward costs ~2.3x a one-token step with YNNPACK and ~1.6x
without it, and a plain batch-8 step is ~17 % faster without it
(`python -m specjax.bench.verify_cost --compare-xla-options`, docs/benchmarks.md). Cheap
verification is what speculative decoding lives on, so the decode programs compile with
YNNPACK fusions off on CPU. Other backends take no options.

Options are per compilation (`Lowered.compile(compiler_options=...)`), not the
process-wide `XLA_FLAGS`, so training and user code keep XLA's defaults. An XLA that
does not know an option (another jaxlib) compiles with its defaults, with a warning.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax

# Per backend platform; edit (or set to {}) to change what generate compiles with.
DECODE_OPTIONS: dict[str, dict[str, Any]] = {
    "cpu": {"xla_cpu_experimental_ynn_fusion_type": ""},  # empty list: no YNNPACK fusions
}
_UNSUPPORTED: set[str] = set()  # platforms whose XLA refused the options once


def decode_options(platform: str | None = None) -> dict[str, Any]:
    """The compiler options for decode programs on `platform` (default: jax's backend)."""
    platform = platform or jax.default_backend()
    if platform in _UNSUPPORTED:
        return {}
    return dict(DECODE_OPTIONS.get(platform, {}))


def compile_decode(lowered: jax.stages.Lowered, platform: str | None = None):
    """`lowered.compile` with `decode_options`; falls back to XLA's defaults (and warns
    once) where this XLA does not accept them."""
    platform = platform or jax.default_backend()
    opts = decode_options(platform)
    if not opts:
        return lowered.compile()
    try:
        return lowered.compile(compiler_options=opts)
    except jax.errors.JaxRuntimeError as e:
        if not any(name in str(e) for name in opts):
            raise
        _UNSUPPORTED.add(platform)
        warnings.warn(f"XLA on {platform} refused decode options {opts} ({e}); compiling "
                      "with its defaults", RuntimeWarning, stacklevel=2)
        return lowered.compile()
