"""XLA compiler options for the decode programs (generate's prefill and loop).

Per backend, options generate compiles its programs with. On CPU: YNNPACK for individual
dots only, without its reduction and elementwise fusions. A YNNPACK reduction sums a row
in an order that depends on how many rows it reduces together (an RMS norm over 10 or
more rows gave some rows other bits than the same row alone), so a verify's rows did
not get a decode step's bits, and speculation over a bfloat16 model and cache at batch > 1
could part from plain decoding's greedy tokens (float32 hides it: a last-bit difference
rarely moves an argmax). `tests/test_xla_options.py` holds every row's reduction to its
one-row bits under these options; exactness comes before the little time XLA's own
reductions cost over YNNPACK's.

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
    # YNNPACK's dots stay (prefill's GEMMs); its row-count-dependent reductions go
    "cpu": {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"},
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
