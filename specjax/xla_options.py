"""XLA compiler options for the decode programs (generate's prefill and loop).

Per backend, options generate compiles its programs with, for where XLA's defaults
are slower at decode shapes. None are set now: on a real checkpoint XLA:CPU's defaults
are as fast or faster (`python -m specjax.bench.verify_cost`, docs/benchmarks.md), so
the CPU entry is empty; the mechanism stays for the next exception.

Options are per compilation (`Lowered.compile(compiler_options=...)`), not the
process-wide `XLA_FLAGS`, so training and user code keep XLA's defaults, and generate's
program cache keys on them (an edit recompiles). An XLA that does not know an option
(another jaxlib) compiles with its defaults, with a warning.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax

# Per backend platform; edit (or set to {}) to change what generate compiles with.
DECODE_OPTIONS: dict[str, dict[str, Any]] = {
    "cpu": {},  # e.g. {"xla_cpu_experimental_ynn_fusion_type": ""}: no YNNPACK fusions
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
