"""`specjax.bench.matmul_rows`: its three forms compute the same MLP, its two attention
forms the same projections and MLP, its tables, and its argument checks, on tiny
shapes."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from specjax import rows_matmul
from specjax.bench import matmul_rows


def test_forms_compute_the_same_mlp():
    weights = matmul_rows.mlp_weights(hidden=8, intermediate=16, layers=2, seed=3)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 8), np.float32))
    outs = [np.asarray(matmul_rows.compiled(f, x, weights)(x, weights))
            for f in matmul_rows.FORMS]
    ref = x
    for layer in weights:  # the MLP in numpy
        h = np.asarray(ref) @ np.asarray(layer["gate"])
        h = h / (1 + np.exp(-h)) * (np.asarray(ref) @ np.asarray(layer["up"]))
        ref = np.asarray(ref) + h @ np.asarray(layer["down"])
    assert not np.allclose(ref, np.asarray(x))  # the layers change x
    for out in outs:
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_attention_forms_compute_the_same_layers():
    weights = matmul_rows.mlp_weights(hidden=8, intermediate=16, layers=2, seed=3,
                                      kv_width=4)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 8), np.float32))
    fused = matmul_rows.form_weights("q/k/v fused", weights)
    assert [sorted(layer["self_attn"]) for layer in fused] == [["o_proj", "qkv_proj"]] * 2
    assert fused[0]["self_attn"]["qkv_proj"]["kernel"].shape == (8, 16)
    ref = np.asarray(x)
    for layer in weights:  # the layers in numpy
        w = {n: np.asarray(a) for n, a in layer.items() if n != "self_attn"}
        w.update({n: np.asarray(a["kernel"]) for n, a in layer["self_attn"].items()})
        q, k, v = ref @ w["q_proj"], ref @ w["k_proj"], ref @ w["v_proj"]
        ref = ref + (q * np.sum(k * v, axis=-1, keepdims=True)) @ w["o_proj"]
        h = ref @ w["gate"]
        ref = ref + (h / (1 + np.exp(-h)) * (ref @ w["up"])) @ w["down"]
    for form in matmul_rows.ATTENTION_FORMS:
        ws = matmul_rows.form_weights(form, weights)
        out = np.asarray(matmul_rows.compiled(form, x, ws)(x, ws))
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_main_with_attention_compares_separate_and_fused(capsys):
    assert matmul_rows.main(["--hidden", "8", "--intermediate", "16", "--layers", "2",
                             "--rows", "1,2", "--repeats", "2", "--attention",
                             "--kv-width", "4"]) == 0
    out = capsys.readouterr().out
    assert all(f in out for f in matmul_rows.ATTENTION_FORMS)
    assert not any(f in out for f in matmul_rows.FORMS[1:])
    one = next(line for line in out.splitlines() if line.startswith("| 1 |"))
    assert one.split("|")[3].strip() == "1.00"  # the base: q/k/v separate at one row


def test_main_prints_every_form_and_row(capsys):
    assert matmul_rows.main(["--hidden", "8", "--intermediate", "16", "--layers", "2",
                             "--rows", "1,2", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert all(f in out for f in matmul_rows.FORMS)
    one = next(line for line in out.splitlines() if line.startswith("| 1 |"))
    assert one.split("|")[3].strip() == "1.00"  # the base: the one-row GEMM
    assert "| 2 |" in out and "GB/s" in out


def test_kernel_max_rows_moves_where_the_kernel_stops():
    """`--kernel-max-rows` (how `rows_matmul.MAX_ROWS` was chosen): above the default the
    kernel form runs XLA's GEMM; with the limit raised, the kernel, same values."""
    weights = matmul_rows.mlp_weights(hidden=8, intermediate=16, layers=1, seed=3)
    x = jnp.asarray(np.random.default_rng(0).standard_normal(
        (rows_matmul.MAX_ROWS + 1, 8), np.float32))
    default = matmul_rows.compiled("rows kernel", x, weights)
    raised = matmul_rows.compiled("rows kernel", x, weights,
                                  kernel_max_rows=rows_matmul.MAX_ROWS + 1)
    assert rows_matmul.TARGET not in default.as_text()
    assert rows_matmul.TARGET in raised.as_text()
    np.testing.assert_allclose(raised(x, weights), default(x, weights), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("argv, name", [(["--rows", "0,2"], "--rows"),
                                        (["--kernel-max-rows", "0"], "--kernel-max-rows"),
                                        (["--layers", "0"], "--layers"),
                                        (["--attention", "--kv-width", "0"], "--kv-width")])
def test_bad_arguments_name_the_flag(argv, name, capsys):
    with pytest.raises(SystemExit) as e:
        matmul_rows.main(argv)
    assert e.value.code == 2 and name in capsys.readouterr().err
