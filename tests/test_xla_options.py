"""specjax.xla_options: generate's decode programs compile with the per-backend options,
numerics unchanged, and an XLA that refuses an option falls back to its defaults."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import xla_options


def _lowered():
    w = jnp.asarray(np.random.default_rng(0).standard_normal((64, 96)), jnp.float32)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((5, 64)), jnp.float32)
    return jax.jit(lambda x, w: x @ w).lower(x, w), (x, w)


def test_decode_options_reach_xla_with_numerics_unchanged(monkeypatch):
    """An option set for a backend (here: no YNNPACK fusions on CPU) is what its decode
    programs compile with; CPU keeps YNNPACK's dots only by default
    (`test_a_rows_reduction_does_not_depend_on_the_rows_beside_it`), TPU sets none."""
    assert xla_options.decode_options("cpu") == {
        "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
    assert xla_options.decode_options("tpu") == {}
    monkeypatch.setitem(xla_options.DECODE_OPTIONS, "cpu",
                        {"xla_cpu_experimental_ynn_fusion_type": ""})
    assert xla_options.decode_options("cpu") == {"xla_cpu_experimental_ynn_fusion_type": ""}
    lowered, args = _lowered()
    compiled = xla_options.compile_decode(lowered, "cpu")
    # same numbers as XLA's defaults (a 5-row matmul: YNNPACK's shape by default)
    np.testing.assert_allclose(compiled(*args), lowered.compile()(*args), rtol=1e-5,
                               atol=1e-5)
    # the option reached XLA: YNNPACK's fusion is gone from the optimized program
    assert "__ynn_fusion" in lowered.compile().as_text()
    assert "__ynn_fusion" not in compiled.as_text()


def test_refused_options_fall_back_with_a_warning(monkeypatch):
    monkeypatch.setitem(xla_options.DECODE_OPTIONS, "cpu",
                        {"xla_cpu_no_such_option_for_the_test": True})
    monkeypatch.setattr(xla_options, "_UNSUPPORTED", set())
    lowered, args = _lowered()
    with pytest.warns(RuntimeWarning, match="xla_cpu_no_such_option_for_the_test"):
        compiled = xla_options.compile_decode(lowered, "cpu")
    np.testing.assert_allclose(compiled(*args), lowered.compile()(*args), rtol=1e-6)
    assert xla_options.decode_options("cpu") == {}  # asked once, not on every compile


def test_generates_program_cache_recompiles_when_an_option_changes(monkeypatch):
    """`ProgramCache` keys its programs on the options too: a program compiled before an
    edit of `DECODE_OPTIONS` is not served after it."""
    from specjax.decoding import programs

    compiled = []
    monkeypatch.setattr(programs, "compile_decode",
                        lambda lowered: compiled.append(lowered) or lowered.compile())
    cache = programs.ProgramCache(size=4)
    fn = jax.jit(lambda scale, x: x * scale, static_argnums=0)
    x = jnp.ones((3,), jnp.float32)
    for _ in range(2):
        cache.get("double", fn, 2.0, (x,), {})
    assert len(compiled) == 1
    monkeypatch.setitem(xla_options.DECODE_OPTIONS, "cpu",
                        {"xla_cpu_experimental_ynn_fusion_type": ""})
    cache.get("double", fn, 2.0, (x,), {})
    assert len(compiled) == 2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_rows_reduction_does_not_depend_on_the_rows_beside_it(dtype):
    """Under the CPU decode options, an RMS norm's mean of squares over 10-30 rows (a
    verify's, batch x tokens) gives each row the bits it gets alone (a decode step's):
    XLA:CPU's YNNPACK reduction fusion, on by default, summed some rows otherwise, so a
    verify's logits could part from plain decoding's by a rounding step."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((30, 576)) * 3, dtype)

    def mean_square(rows):
        lowered = jax.jit(lambda r: jnp.mean(jnp.square(r.astype(jnp.float32)), -1)).lower(rows)
        return np.asarray(xla_options.compile_decode(lowered, "cpu")(rows))

    for n in (10, 15, 30):
        alone = np.concatenate([mean_square(x[i:i + 1]) for i in range(n)])
        np.testing.assert_array_equal(mean_square(x[:n]), alone)
