"""`specjax.rows_matmul`: the few-row CPU matmul kernel against numpy, where it applies and
where XLA's matmul runs instead, its gradients, its build cache and its fallbacks, and
the decode layout calling it."""

from __future__ import annotations

import functools
import json
import os
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import cpu_kernels, rows_matmul
from specjax.config import tiny_llama
from specjax.heads.eagle import (
    EagleConfig,
    eagle_logits,
    eagle_step,
    fuse_features,
    init_eagle_params,
)
from specjax.model import decode_params, init_params, module_for
from specjax.models.transformer import is_decode_layout


def _calls_kernel(fn, *args, target=rows_matmul.TARGET) -> bool:
    return target in jax.jit(fn).lower(*args).as_text()


def _calls_kernel_t(fn, *args) -> bool:  # the transposed-weight kernel
    return _calls_kernel(fn, *args, target=rows_matmul.TARGET_T)


def _data(shape_x, shape_w, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape_x).astype(np.float32),
            rng.standard_normal(shape_w).astype(np.float32))


@pytest.mark.parametrize("rows", range(1, rows_matmul.MAX_ROWS + 1))
@pytest.mark.parametrize("inner, out", [(37, 53), (64, 200), (16, 7), (96, 1024),
                                        (21, 1603)])  # wide: 2-8 rows sweep
def test_kernel_matches_numpy_at_every_row_count(rows, inner, out):
    # column counts off the 16-lane vectors and the 64-column chunks, rows off the
    # kernel's 16-row blocks: every tail path
    assert rows_matmul.available()
    x, w = _data((rows, inner), (inner, out), seed=rows)
    assert _calls_kernel(rows_matmul.matmul, x, w)
    y = np.asarray(jax.jit(rows_matmul.matmul)(x, w))
    np.testing.assert_allclose(y, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-4)


def test_leading_axes_are_rows():
    x, w = _data((2, 3, 40), (40, 70))
    assert _calls_kernel(rows_matmul.matmul, x, w)
    y = np.asarray(jax.jit(rows_matmul.matmul)(x, w))
    assert y.shape == (2, 3, 70)
    np.testing.assert_allclose(y, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-4)


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    # each output sums over the inner axis in one order whatever the row count, so a
    # verify row equals the same row decoded alone, bit for bit
    # (a narrow weight takes register blocks from 2 rows on, a wide one sweeps 2-8 rows)
    for out in (500, 1700):
        x, w = _data((rows_matmul.MAX_ROWS, 300), (300, out))
        alone = np.asarray(jax.jit(rows_matmul.matmul)(x[:1], w))
        for rows in range(2, rows_matmul.MAX_ROWS + 1):
            together = np.asarray(jax.jit(rows_matmul.matmul)(x[:rows], w))
            np.testing.assert_array_equal(together[:1], alone, err_msg=f"{out=} {rows=}")


def test_the_width_rule_sweeps_few_rows_of_wide_weights():
    sweeps, wide, very = rows_matmul.sweeps, rows_matmul.WIDE, rows_matmul.VERY_WIDE
    assert [sweeps(r, very) for r in (1, 2, 8, 9)] == [False, True, True, False]
    assert [sweeps(r, wide) for r in (2, 4, 5)] == [True, True, False]
    assert not sweeps(2, wide - 1)


def test_every_kernel_form_gives_the_same_bits():
    """The register blocks and the sweep, forced on a narrow and a wide weight at every
    row count they serve (2..FEW_ROWS), give the same bits as the form the width picks
    (`rows_matmul.matmul`), and as numpy's product within float32 rounding; a form
    outside `FORMS` is named."""
    for out in (200, rows_matmul.WIDE + 64):
        x, w = _data((rows_matmul.FEW_ROWS, 300), (300, out))
        for rows in range(2, rows_matmul.FEW_ROWS + 1):
            got = {name: np.asarray(jax.jit(rows_matmul.in_form(name))(x[:rows], w))
                   for name in rows_matmul.FORMS}
            by_width = np.asarray(jax.jit(rows_matmul.matmul)(x[:rows], w))
            for name, y in got.items():
                np.testing.assert_array_equal(y, by_width, err_msg=f"{name} {out=}")
            np.testing.assert_allclose(got["sweep"], x[:rows].astype(np.float64) @ w,
                                       rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="'fast'"):
        rows_matmul.in_form("fast")


@pytest.mark.parametrize("rows", range(1, rows_matmul.MAX_ROWS + 1))
@pytest.mark.parametrize("inner, out", [(37, 53), (64, 200), (16, 7), (96, 1024),
                                        (21, 1603), (576, 259)])
def test_transposed_kernel_matches_numpy_at_every_row_count(rows, inner, out):
    # inner sizes off the 8- and 16-lane vectors, outputs off the 2 and 4 streams and
    # the threads' ranges, rows off the 4-row blocks: every tail path
    assert rows_matmul.available_t()
    x, w = _data((rows, inner), (inner, out), seed=rows)
    wt = np.ascontiguousarray(w.T)
    assert _calls_kernel_t(rows_matmul.matmul_t, x, wt)
    y = np.asarray(jax.jit(rows_matmul.matmul_t)(x, wt))
    np.testing.assert_allclose(y, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-4)


def test_transposed_kernel_rows_do_not_depend_on_the_rows_beside_them():
    """Each row's dot products sum in one order whatever block it falls in (1-4 rows,
    2 or 4 streams, the outputs left over), bit for bit: a verify row equals the same
    row decoded alone."""
    for inner, out in ((300, 500), (37, 129), (576, 1030)):
        x, w = _data((rows_matmul.MAX_ROWS, inner), (inner, out))
        wt = np.ascontiguousarray(w.T)
        alone = np.stack([np.asarray(jax.jit(rows_matmul.matmul_t)(x[i:i + 1], wt))[0]
                          for i in range(rows_matmul.MAX_ROWS)])
        for rows in range(2, rows_matmul.MAX_ROWS + 1):
            together = np.asarray(jax.jit(rows_matmul.matmul_t)(x[:rows], wt))
            np.testing.assert_array_equal(together, alone[:rows], err_msg=f"{out=} {rows=}")


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13, rows_matmul.MAX_ROWS])
@pytest.mark.parametrize("inner, out", [(37, 53), (64, 200), (21, 1603), (576, 259)])
def test_bfloat16_weights_give_the_bits_of_their_float32_values(rows, inner, out):
    """bfloat16 weights are widened as they stream: the product is, bit for bit, the
    float32 kernel's on float32 weights holding the same values; bfloat16 rows are
    widened too, and the result is rounded to bfloat16 (as XLA's bfloat16 matmul rounds
    its float32 sums)."""
    x, w = _data((rows, inner), (inner, out), seed=rows + inner)
    wt = jnp.asarray(np.ascontiguousarray(w.T), jnp.bfloat16)
    assert _calls_kernel_t(rows_matmul.matmul_t, x, wt)
    y = np.asarray(jax.jit(rows_matmul.matmul_t)(x, wt))
    assert y.dtype == np.float32
    want = np.asarray(jax.jit(rows_matmul.matmul_t)(x, wt.astype(jnp.float32)))
    np.testing.assert_array_equal(y, want)
    xb = jnp.asarray(x, jnp.bfloat16)
    yb = jax.jit(rows_matmul.matmul_t)(xb, wt)
    assert yb.dtype == jnp.bfloat16
    exact = np.asarray(jax.jit(rows_matmul.matmul_t)(xb.astype(jnp.float32),
                                                      wt.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(yb), exact.astype(jnp.bfloat16))
    np.testing.assert_allclose(exact, np.asarray(xb, np.float64) @ np.asarray(wt, np.float64).T,
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("x_shape, dtype", [((rows_matmul.MAX_ROWS + 1, 32), jnp.float32),
                                            ((2, 32), jnp.float16)])
def test_transposed_products_past_the_kernel_run_xlas(x_shape, dtype):
    x, w = _data(x_shape, (32, 48))
    x, wt = jnp.asarray(x, dtype), jnp.asarray(np.ascontiguousarray(w.T), dtype)
    assert not _calls_kernel_t(rows_matmul.matmul_t, x, wt)
    # XLA's product on the stored [O, I] layout, bit for bit (`x @ wt.T` is another XLA
    # program, a transpose then a dot, whose sums run in another order on AVX-512 hosts)
    np.testing.assert_array_equal(np.asarray(rows_matmul.matmul_t(x, wt), np.float32),
                                  np.asarray(jnp.einsum("...i,oi->...o", x, wt), np.float32))
    np.testing.assert_allclose(np.asarray(rows_matmul.matmul_t(x, wt), np.float32),
                               np.asarray(x, np.float32) @ np.asarray(wt, np.float32).T,
                               rtol=1e-5 if dtype == jnp.float32 else 2e-2, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_within_any_rows_more_rows_keep_the_kernels_and_each_rows_bits(monkeypatch, dtype):
    """A decode loop's products (`any_rows`) take the kernels past `MAX_ROWS` (a verify
    of batch x tree rows): each of 3 x MAX_ROWS rows gets the bits it gets alone, from
    the transposed and the [I, O] kernel; outside it the same products run XLA's (or the
    bfloat16 GEMM)."""
    monkeypatch.setattr(rows_matmul, "kernel_wins", lambda shape: True)
    n = 3 * rows_matmul.MAX_ROWS + 5
    x, w = _data((n, 96), (96, 200), seed=3)
    x = jnp.asarray(x, dtype)
    wt = jnp.asarray(np.ascontiguousarray(w.T), dtype)
    w = jnp.asarray(w)
    forms = [(rows_matmul.matmul_t, wt, _calls_kernel_t)]
    if dtype == jnp.float32:  # the [I, O] kernel takes float32 only
        forms.append((rows_matmul.matmul, w, _calls_kernel))
    for product, weight, calls in forms:
        # traced anew each time (not from jit's cache); float32 sums, not rounded
        fresh = lambda: lambda a, b: product(a, b, preferred_element_type=jnp.float32)  # noqa: E731
        assert not calls(fresh(), x, weight)
        with rows_matmul.any_rows():
            assert calls(fresh(), x, weight)
            together = np.asarray(jax.jit(fresh())(x, weight), np.float32)
        assert not calls(fresh(), x, weight)  # the setting ends with its block
        one = jax.jit(fresh())
        alone = np.concatenate([np.asarray(one(x[i:i + 1], weight)) for i in range(n)])
        np.testing.assert_array_equal(together, alone, err_msg=product.__name__)


def test_transposed_kernel_gradients_equal_xlas_matmuls():
    x, w = _data((3, 24), (24, 40))
    wt = np.ascontiguousarray(w.T)

    def loss(mm, x, wt):
        return jnp.sum(jnp.tanh(mm(x, wt)) ** 2)

    got = jax.grad(lambda x, wt: loss(rows_matmul.matmul_t, x, wt), argnums=(0, 1))(x, wt)
    want = jax.grad(lambda x, wt: loss(lambda a, b: a @ b.T, x, wt), argnums=(0, 1))(x, wt)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("x_shape, dtype", [((rows_matmul.MAX_ROWS + 1, 32), jnp.float32),
                                            ((2, 32), jnp.float16)])
def test_more_rows_or_other_dtypes_run_xlas_matmul(x_shape, dtype):
    x, w = _data(x_shape, (32, 48))
    x, w = jnp.asarray(x, dtype), jnp.asarray(w, dtype)
    assert not _calls_kernel(rows_matmul.matmul, x, w)
    np.testing.assert_allclose(np.asarray(rows_matmul.matmul(x, w), np.float32),
                               np.asarray(x @ w, np.float32))


def test_gradients_equal_xlas_matmuls():
    x, w = _data((3, 24), (24, 40))

    def loss(mm, x, w):
        return jnp.sum(jnp.tanh(mm(x, w)) ** 2)

    got = jax.grad(lambda x, w: loss(rows_matmul.matmul, x, w), argnums=(0, 1))(x, w)
    want = jax.grad(lambda x, w: loss(jnp.matmul, x, w), argnums=(0, 1))(x, w)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transposed", [False, True])
def test_a_stacked_weights_layer_is_multiplied_in_place(transposed):
    """`layer=`: each kernel multiplies by one layer of a stacked weight [L, ...] without
    slicing it (the stack itself is the call's operand), the layer's bits exactly as
    the same matrix alone gets them, gradients through XLA's matmul; past the kernel's
    rows XLA multiplies the slice; a layer outside the stack is an error naming it."""
    x, w = _data((3, 40), (4, 40, 70), seed=5)
    w = np.ascontiguousarray(np.swapaxes(w, 1, 2)) if transposed else w
    product = rows_matmul.matmul_t if transposed else rows_matmul.matmul
    target = rows_matmul.TARGET_T if transposed else rows_matmul.TARGET

    def by_layer(x, w, layer):
        return product(x, w, layer=layer)

    hlo = jax.jit(by_layer).lower(x, w, jnp.int32(2)).as_text()
    assert target in hlo and "dynamic_slice" not in hlo
    for layer in range(4):
        got = np.asarray(jax.jit(by_layer)(x, w, jnp.int32(layer)))
        alone = np.asarray(jax.jit(product)(x, w[layer]) if transposed else
                           jax.jit(functools.partial(product, race=False))(x, w[layer]))
        np.testing.assert_array_equal(got, alone)
        want = x.astype(np.float64) @ (w[layer].T if transposed else w[layer])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    many = _data((rows_matmul.MAX_ROWS + 1, 40), (1, 1))[0]
    assert target not in jax.jit(by_layer).lower(many, w, jnp.int32(1)).as_text()
    np.testing.assert_allclose(by_layer(many, w, jnp.int32(1)),
                               many @ (w[1].T if transposed else w[1]), rtol=1e-5, atol=1e-4)

    def loss(x, w):
        return jnp.sum(jnp.tanh(by_layer(x, w, jnp.int32(3))) ** 2)

    got = jax.grad(loss, argnums=(0, 1))(x, w)
    want = jax.grad(lambda x, w: jnp.sum(jnp.tanh(
        x @ (w[3].T if transposed else w[3])) ** 2), argnums=(0, 1))(x, w)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="layer out of range"):
        jax.block_until_ready(by_layer(x, w, jnp.int32(4)))


def test_dot_general_takes_dense_products_only():
    x, w = _data((2, 16), (16, 8))
    dense = (((1,), (0,)), ((), ()))
    assert _calls_kernel(lambda a, b: rows_matmul.dot_general(a, b, dense), x, w)
    other = (((1,), (1,)), ((), ()))  # contracting w's last axis: not the kernel's product
    w2 = np.ascontiguousarray(w.T)
    assert not _calls_kernel(lambda a, b: rows_matmul.dot_general(a, b, other), x, w2)
    np.testing.assert_allclose(rows_matmul.dot_general(x, w2, other), x @ w, rtol=1e-5)


def test_build_is_cached_per_source_and_machine(tmp_path):
    # the library goes to jax's persistent cache directory (on under the tests)
    assert jax.config.jax_enable_compilation_cache
    assert cpu_kernels.library_dir() == (Path(jax.config.jax_compilation_cache_dir)
                                         / "specjax-kernels")
    cxx = cpu_kernels.cxx()
    first = cpu_kernels.build(rows_matmul.KERNEL.source, cxx, tmp_path)
    assert first.parent == tmp_path and first.exists()
    stamp = first.stat().st_mtime_ns
    assert cpu_kernels.build(rows_matmul.KERNEL.source, cxx, tmp_path) == first
    assert first.stat().st_mtime_ns == stamp


def test_no_compiler_or_a_failed_build_warns_once_and_falls_back(tmp_path, monkeypatch):
    x, w = _data((2, 16), (16, 8))
    monkeypatch.setattr(rows_matmul.KERNEL, "_state", {})
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    with pytest.warns(RuntimeWarning, match="no C.. compiler"):
        assert not rows_matmul.available()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        assert not rows_matmul.available()
        assert not _calls_kernel(rows_matmul.matmul, x, w)
    np.testing.assert_allclose(rows_matmul.matmul(x, w), x @ w, rtol=1e-5)

    broken = tmp_path / "broken.cc"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(rows_matmul.KERNEL, "_state", {})
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(rows_matmul.KERNEL, "source", broken)
    with pytest.warns(RuntimeWarning, match="failed on .*broken.cc"):
        assert not rows_matmul.available()


def test_off_switch(monkeypatch):
    monkeypatch.setenv(rows_matmul.ENV, "off")
    x, w = _data((2, 16), (16, 8))
    assert not rows_matmul.available()
    assert not _calls_kernel(rows_matmul.matmul, x, w)


def test_the_kernel_takes_only_the_weight_shapes_it_wins_here(monkeypatch):
    """Without `SPECJAX_CPU_MATMUL=on` the kernel races XLA's matmul once per weight
    shape, in a thread of its own (the race runs while a program is traced), and takes a
    shape for every row count or for none; a real race returns a verdict."""
    raced = []

    def fake_race(shape, transposed=False, rival="xla", dtype=jnp.float32):
        raced.append(shape)
        return shape[1] == 8  # the kernel "wins" on [12, 8] weights only

    monkeypatch.delenv(rows_matmul.ENV)
    monkeypatch.setattr(rows_matmul, "race", fake_race)
    monkeypatch.setattr(rows_matmul, "_wins", {})
    monkeypatch.setattr(rows_matmul, "verdicts_file", lambda kernel=None: None)  # none kept
    jax.clear_caches()  # programs other tests traced with these shapes
    x = _data((2, 12), (12, 8))[0]
    w8, w24 = _data((2, 12), (12, 8))[1], _data((2, 12), (12, 24))[1]
    assert _calls_kernel(rows_matmul.matmul, x, w8)
    assert _calls_kernel(rows_matmul.matmul, x[:1], w8)  # one verdict for every row count
    assert not _calls_kernel(rows_matmul.matmul, x, w24)
    assert not _calls_kernel(rows_matmul.matmul, x[:1], w24)
    np.testing.assert_allclose(jax.jit(rows_matmul.matmul)(x, w24), x @ w24, rtol=1e-6)
    assert raced == [(12, 8), (12, 24)]  # once per shape
    assert _calls_kernel(functools.partial(rows_matmul.matmul, race=False), x, w24)
    monkeypatch.setenv(rows_matmul.ENV, "on")
    jax.clear_caches()
    assert _calls_kernel(rows_matmul.matmul, x, w24)


@pytest.mark.parametrize("form", ["kernel", "xla", "transposed"])
def test_the_race_reads_every_weight_copy_in_place(form):
    """The race's program multiplies each copy where it lies: no copy of a weight into a
    new buffer (a loop over stacked copies, `lax.map`, sliced each one out first, so the
    products read it from cache, not memory), one product per copy, each right."""
    assert rows_matmul.available() and rows_matmul.available_t()  # built and registered
    fn = {"kernel": rows_matmul._rows, "xla": jnp.matmul,
          "transposed": rows_matmul.transposed_product}[form]
    x, w = _data((3, 48), (48, 40))
    ws = tuple(w + i for i in range(5))
    args = tuple(np.ascontiguousarray(v.T) for v in ws) if form == "transposed" else ws
    program = rows_matmul.race_program(fn)
    hlo = program.lower(x, args).compile().as_text()
    assert "dynamic-slice" not in hlo and " copy(" not in hlo
    if form != "xla":
        target = rows_matmul.TARGET_T if form == "transposed" else rows_matmul.TARGET
        assert hlo.count(f'custom_call_target="{target}"') == len(ws)
    np.testing.assert_allclose(program(x, args), np.stack([x @ v for v in ws]), rtol=1e-5,
                               atol=1e-4)


def test_verdicts_are_kept_beside_the_kernel_for_later_processes(monkeypatch, tmp_path):
    """With the compilation cache on (the suite turns it on), a verdict is written next
    to the built kernel and read back instead of racing again (a new process starts
    with no verdicts in memory), each kernel's beside its own library; an unreadable file
    is raced over and rewritten; with the cache off nothing is kept."""
    monkeypatch.delenv(rows_matmul.ENV)
    kept = rows_matmul.verdicts_file()
    assert kept == rows_matmul.KERNEL.library_path().with_suffix(".race.json")
    assert rows_matmul.verdicts_file(rows_matmul.KERNEL_T) == (
        rows_matmul.KERNEL_T.library_path().with_suffix(".race.json"))
    path, path_t = tmp_path / "kernel.race.json", tmp_path / "kernel_t.race.json"
    monkeypatch.setattr(rows_matmul, "verdicts_file", lambda kernel=rows_matmul.KERNEL:
                        path if kernel is rows_matmul.KERNEL else path_t)
    raced = []

    def fake_race(shape, transposed=False, rival="xla", dtype=jnp.float32):
        raced.append((shape, transposed))
        return shape == ((12, 24) if transposed else (12, 8))

    monkeypatch.setattr(rows_matmul, "race", fake_race)
    for _ in range(2):  # the second "process" reads the first one's verdicts
        monkeypatch.setattr(rows_matmul, "_wins", {})
        assert rows_matmul.kernel_wins((12, 8)) and not rows_matmul.kernel_wins((12, 24))
        assert rows_matmul.transposed_wins((12, 24))
        assert not rows_matmul.transposed_wins((12, 8))
    assert raced == [((12, 8), False), ((12, 24), False), ((12, 24), True), ((12, 8), True)]
    assert json.loads(path.read_text()) == {
        "12x24 rows 1,5,17 bytes 67108864 unrolled": False,
        "12x8 rows 1,5,17 bytes 67108864 unrolled": True}
    assert json.loads(path_t.read_text()) == {  # each against its [I, O] weight's winner
        "12x24 rows 1,5,17 bytes 67108864 unrolled vs xla": True,
        "12x8 rows 1,5,17 bytes 67108864 unrolled vs kernel": False}
    raced.clear()
    path_t.unlink()
    monkeypatch.setattr(rows_matmul, "verdicts_file", lambda kernel=rows_matmul.KERNEL: path)
    path.write_text("{not json")
    monkeypatch.setattr(rows_matmul, "_wins", {})
    assert rows_matmul.kernel_wins((12, 8)) and raced[-1] == ((12, 8), False)
    assert json.loads(path.read_text()) == {"12x8 rows 1,5,17 bytes 67108864 unrolled": True}
    monkeypatch.setattr(rows_matmul, "RACE_ROWS", (1, 9))  # a changed race races again
    monkeypatch.setattr(rows_matmul, "_wins", {})
    assert rows_matmul.kernel_wins((12, 8)) and raced.count(((12, 8), False)) == 2
    monkeypatch.setattr(rows_matmul, "RACE_FORM", "other")  # so does a changed layout
    monkeypatch.setattr(rows_matmul, "_wins", {})
    assert rows_matmul.kernel_wins((12, 8)) and raced.count(((12, 8), False)) == 3
    monkeypatch.undo()  # the real verdicts_file, with the cache off
    monkeypatch.setattr(rows_matmul.cpu_kernels, "persistent_dir", lambda: None)
    assert rows_matmul.verdicts_file() is None


def test_the_transposed_kernel_races_what_the_weight_would_otherwise_get(monkeypatch):
    """`transposed_wins` races the transposed kernel against the [I, O] kernel where that
    one beat XLA on the shape, else against XLA, asking `kernel_wins` first (its own race
    takes the same lock); each rival its own verdict."""
    raced = []

    def fake_race(shape, transposed=False, rival="xla", dtype=jnp.float32):
        raced.append((shape, transposed, rival))
        if not transposed:
            return shape == (12, 8)  # the [I, O] kernel beats XLA on [12, 8] only
        return rival == "xla"  # the transposed kernel beats XLA, never the [I, O] kernel

    monkeypatch.delenv(rows_matmul.ENV)
    monkeypatch.setattr(rows_matmul, "race", fake_race)
    monkeypatch.setattr(rows_matmul, "_wins", {})
    monkeypatch.setattr(rows_matmul, "verdicts_file", lambda kernel=None: None)
    assert rows_matmul.rival((12, 8)) == "kernel" and rows_matmul.rival((12, 24)) == "xla"
    assert not rows_matmul.transposed_wins((12, 8))
    assert rows_matmul.transposed_wins((12, 24))
    assert raced == [((12, 8), False, "xla"), ((12, 24), False, "xla"),
                     ((12, 8), True, "kernel"), ((12, 24), True, "xla")]
    monkeypatch.setattr(rows_matmul, "available", lambda: False)  # no [I, O] kernel: XLA
    assert rows_matmul.transposed_wins((12, 8)) and raced[-1] == ((12, 8), True, "xla")


def test_a_real_race_returns_a_verdict(monkeypatch):
    """`race` times both forms on copies of the weight and says whether the kernel was
    faster; without the kernel it is not."""
    for transposed, rival in ((False, "xla"), (True, "xla"), (True, "kernel")):
        verdict = rows_matmul.race((64, 128), rows=(1, 5), rounds=1, nbytes=1 << 16,
                                   transposed=transposed, rival=rival)
        assert isinstance(verdict, bool)
    monkeypatch.setenv(rows_matmul.ENV, "off")
    assert rows_matmul.race((64, 128), rows=(1,), rounds=1) is False
    assert rows_matmul.race((64, 128), rows=(1,), rounds=1, transposed=True) is False


def test_decode_layout_forward_runs_the_kernel_and_matches_the_stored_layout():
    config = tiny_llama(vocab_size=128)
    params = init_params(config, 0)
    decoded = decode_params(config, params, "unrolled")
    tokens = jnp.asarray([[3, 5, 7]], jnp.int32)
    positions = jnp.arange(3, dtype=jnp.int32)[None]

    def forward(p):
        return module_for(config, p).apply({"params": p}, tokens, positions)[0]

    assert _calls_kernel_t(forward, decoded)  # its weights stored [O, I] (the race: "on")
    assert not _calls_kernel_t(forward, params)  # the stored (scanned) layout: XLA's
    np.testing.assert_allclose(jax.jit(forward)(decoded), jax.jit(forward)(params),
                               rtol=1e-4, atol=1e-4)


def test_eagle3_head_beside_a_decode_layout_target_runs_the_kernel():
    """The head's fc, layer and draft LM head go through the kernel next to a target in the
    decode layout (its CPU decode programs), and through XLA's beside the stored layout
    (training, meshes): the same features and logits either way."""
    config = tiny_llama(vocab_size=128)
    params = init_params(config, 0)
    decoded = decode_params(config, params, "unrolled")
    head = EagleConfig(version=3, draft_vocab_size=32).resolved(config)
    head_params = init_eagle_params(head, config, 1)
    rng = np.random.default_rng(2)
    tokens = jnp.asarray([[3, 5, 7]], jnp.int32)
    positions = jnp.arange(3, dtype=jnp.int32)[None]
    feats = jnp.asarray(rng.standard_normal((1, 3, 3 * config.hidden_size)), jnp.float32)

    def head_logits(target_params):
        fused = fuse_features(head, config, head_params, feats,
                              rows_kernel=is_decode_layout(target_params))
        out, _ = eagle_step(head, config, head_params, target_params, None, tokens, fused,
                            positions)
        return eagle_logits(head, config, head_params, target_params, out)

    assert _calls_kernel(head_logits, decoded)
    assert not _calls_kernel(head_logits, params)
    np.testing.assert_allclose(jax.jit(head_logits)(decoded), jax.jit(head_logits)(params),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("wins", [True, False])
def test_an_eagle3_head_for_decoding_stores_its_weights_as_the_target_does(monkeypatch,
                                                                          wins):
    """`Eagle.for_decoding` lays the head's layer out as the unrolled float32 target's
    layout lays out its own: q/k/v fused, [O, I] (`KERNEL_T`) where the transposed-weight
    kernel wins, [I, O] where it loses; untouched in the scanned layout. Its draft logits
    and its step's features are the same either way, run by the kernel that won."""
    from specjax.model import Model
    from specjax.models.transformer import FUSED_QKV, KERNEL_T
    from specjax.speculators.eagle import Eagle

    monkeypatch.setattr(rows_matmul, "transposed_wins", lambda shape, dtype=None: wins)
    config = tiny_llama(vocab_size=128)
    target = Model(config, init_params(config, 0))
    spec = Eagle.random(target, version=3, seed=1, draft_vocab_size=32)
    laid = spec.for_decoding()
    names = {"/".join(str(getattr(k, "key", k)) for k in path)
             for path, _ in jax.tree_util.tree_flatten_with_path(laid.params)[0]}
    for dense in ("fc", "lm_head", f"self_attn/{FUSED_QKV}", "mlp/down_proj"):
        assert f"{dense}/{KERNEL_T if wins else 'kernel'}" in names, (dense, names)
    if wins:
        np.testing.assert_array_equal(laid.params["lm_head"][KERNEL_T],
                                      np.asarray(spec.params["lm_head"]["kernel"]).T)
    assert spec.for_decoding("scan").params is spec.params
    decoded = decode_params(config, target.params, "unrolled")
    out = jnp.asarray(np.random.default_rng(3).standard_normal((1, 3, config.hidden_size)),
                      jnp.float32)

    def logits(head):
        return eagle_logits(head.config, config, head.params, decoded, out)

    assert _calls_kernel_t(logits, laid) is wins
    np.testing.assert_allclose(jax.jit(logits)(laid), jax.jit(logits)(spec), rtol=1e-5,
                               atol=1e-5)
    rng = np.random.default_rng(5)
    tokens = jnp.asarray([[3, 5, 7]], jnp.int32)
    positions = jnp.arange(3, dtype=jnp.int32)[None]
    feats = jnp.asarray(rng.standard_normal((1, 3, 3 * config.hidden_size)), jnp.float32)

    def features(head):
        fused = fuse_features(head.config, config, head.params, feats, rows_kernel=True)
        return eagle_step(head.config, config, head.params, decoded, None, tokens, fused,
                          positions)[0]

    np.testing.assert_allclose(jax.jit(features)(laid), jax.jit(features)(spec), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("wins", [True, False])
def test_a_trimmed_draft_head_for_decoding_is_transposed_where_that_kernel_wins(
        monkeypatch, wins):
    """`DraftModel.for_decoding` stores a trimmed LM head [Vd, D] for the
    transposed-weight kernel where it wins its shape (else [D, Vd] for the [I, O] one),
    with the same logits."""
    from specjax.model import Model
    from specjax.speculators import DraftModel

    monkeypatch.setattr(rows_matmul, "transposed_wins", lambda shape, dtype=None: wins)
    config = tiny_llama(vocab_size=128)
    spec = DraftModel.create(Model(config, init_params(config, 2)), k=2,
                             vocab=np.arange(0, 128, 3))
    laid = spec.for_decoding()
    assert laid.vocab_head_t is wins
    want_shape = (43, config.hidden_size) if wins else (config.hidden_size, 43)
    assert laid.vocab_head.shape == want_shape
    assert spec.for_decoding("scan").vocab_head_t is False
    h = jnp.asarray(np.random.default_rng(4).standard_normal((2, config.hidden_size)),
                    jnp.float32)
    assert _calls_kernel_t(lambda d: d._logits(h), laid) is wins
    np.testing.assert_allclose(jax.jit(lambda d: d._logits(h))(laid),
                               jax.jit(lambda d: d._logits(h))(spec), rtol=1e-5, atol=1e-5)


def test_a_float32_model_is_served_by_the_kernel_that_won(monkeypatch):
    """`serving` (which verify-cost table prices a step) names the kernel the down
    projection's shape goes to: the transposed-weight one where it won, else the [I, O]
    one where that won, else none; a bfloat16 model's only the transposed one (the
    [I, O] kernel is float32 only); a float16 model's none."""
    config = tiny_llama()
    for t, k, want in ((True, False, "transposed"), (True, True, "transposed"),
                       (False, True, "kernel"), (False, False, None)):
        monkeypatch.setattr(rows_matmul, "transposed_wins", lambda shape, dtype=None, t=t: t)
        monkeypatch.setattr(rows_matmul, "kernel_wins", lambda shape, k=k: k)
        assert rows_matmul.serving(config) == want
        assert rows_matmul.serving(config.replace(dtype="bfloat16")) == (
            "transposed" if t else None)
        assert rows_matmul.serving(config.replace(dtype="float16")) is None


def test_a_kernel_s_first_build_starts_the_other_kernels_builds_beside_it(monkeypatch,
                                                                          tmp_path):
    """`build_with_the_others`: the first kernel asked for starts every other kernel's
    build that is on, not yet tried and built with the others, and they run at once
    (each fake build returns only once two run together); a kernel turned off or built
    at its own first use only is not built, and another kernel's first call collects the
    build already started for it."""
    import threading

    monkeypatch.setattr(cpu_kernels, "KERNELS", [])
    monkeypatch.setattr(cpu_kernels, "_builds", {})
    together = threading.Barrier(min(2, os.cpu_count() or 1), timeout=60)
    built = []

    def fake_build(source, compiler, directory=None):
        built.append(source.name)
        together.wait()  # raises BrokenBarrierError if the builds ran one by one
        return tmp_path / f"{source.stem}.so"

    monkeypatch.setattr(cpu_kernels, "build", fake_build)
    kernels = [cpu_kernels.FfiKernel(f"k{i}", tmp_path / f"k{i}.cc", f"SPECJAX_TEST_K{i}",
                                     "a test kernel", "XLA", with_others=i != 3)
               for i in range(4)]
    monkeypatch.setenv("SPECJAX_TEST_K2", "off")
    kernels[0]._state["ok"] = False  # tried, as `available` marks it before building
    assert cpu_kernels.build_with_the_others(kernels[0], "c++") == tmp_path / "k0.so"
    assert sorted(built) == ["k0.cc", "k1.cc"]
    kernels[1]._state["ok"] = False
    assert cpu_kernels.build_with_the_others(kernels[1], "c++") == tmp_path / "k1.so"
    assert sorted(built) == ["k0.cc", "k1.cc"] and not cpu_kernels._builds
