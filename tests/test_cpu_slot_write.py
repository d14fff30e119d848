"""The CPU KV-slot write kernel (specjax/csrc/slot_write.cc) against XLA's scatter it
stands in for, bit for bit, and where `specjax.cache` hands it writes."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import cache, cpu_slot_write
from specjax.decoding.generate import PROGRAMS
from specjax.speculators import DraftModel

L, K, P, Z, H = 3, 2, 6, 4, 64
DTYPES = ("bfloat16", "float16", "float32", "int8")


def _pages(dtype, seed=0, shape=(L, K, P, Z, H)) -> jax.Array:
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal(shape) * 40).astype(dtype)


def _slots(seed=0, b=2, t=3):
    """Distinct (page, offset) slots [B, T], the last of row 1 dropped (page P)."""
    rng = np.random.default_rng(seed)
    flat = rng.permutation(P * Z)[:b * t].reshape(b, t)
    page, offset = flat // Z, flat % Z
    page[1, -1] = P
    return jnp.asarray(page, jnp.int32), jnp.asarray(offset, jnp.int32)


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(f"u{x.dtype.itemsize}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scales", [False, True])
def test_one_layers_write_equals_xlas_scatter(dtype, scales):
    shape = (L, K, P, Z) if scales else (L, K, P, Z, H)
    pages = _pages(dtype, 1, shape)
    new = _pages("float32", 2, (2, 3, K) + shape[4:])  # [B, T, K(, H)]
    page, offset = _slots(3)
    for layer in range(L):
        got = jax.jit(cpu_slot_write.write)(pages, jnp.int32(layer), new, page, offset)
        want = pages.at[layer, :, page, offset].set(new.astype(pages.dtype), mode="drop")
        np.testing.assert_array_equal(_bits(got), _bits(want))
        assert not np.array_equal(_bits(got), _bits(pages))  # it wrote something


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_layers_write_equals_xlas_scatter(dtype):
    pages = _pages(dtype, 4)
    new = _pages("float32", 5, (L, 2, 3, K, H))  # [L, B, T, K, H]
    page, offset = _slots(6)
    got = jax.jit(cpu_slot_write.write, static_argnums=1)(pages, None, new, page, offset)
    vals = jnp.moveaxis(new, 3, 1).astype(pages.dtype)
    want = pages.at[:, :, page, offset].set(vals, mode="drop")
    np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_move_reads_every_source_before_it_writes(dtype):
    """Slots moved onto slots that are themselves moved (row 0 shifts up by one, where a
    copy in order would copy its first slot three times) come from the pages as they
    were, as a gather then scatter gives."""
    pages = _pages(dtype, 7)
    src_page = jnp.asarray([[1, 1, 1], [4, 2, 0]], jnp.int32)
    src_off = jnp.asarray([[0, 1, 2], [0, 3, 0]], jnp.int32)
    dst_page = jnp.asarray([[1, 1, 1], [5, 2, P]], jnp.int32)
    dst_off = jnp.asarray([[1, 2, 3], [2, 0, 1]], jnp.int32)
    got = jax.jit(cpu_slot_write.move)(pages, src_page, src_off, dst_page, dst_off)
    want = pages.at[:, :, dst_page, dst_off].set(pages[:, :, src_page, src_off], mode="drop")
    np.testing.assert_array_equal(_bits(got), _bits(want))


def _writes_through_kernel(fn, *args) -> bool:
    return cpu_slot_write.TARGET in jax.jit(fn).lower(*args).as_text()


def test_two_byte_float_pages_take_the_kernel_and_others_xlas_scatter(monkeypatch):
    page, offset = _slots(8)
    new = _pages("float32", 9, (2, 3, K, H))

    def routed(dtype):
        return _writes_through_kernel(lambda p: cache.write_kv(p, 1, new, page, offset),
                                      _pages(dtype))

    assert [routed(d) for d in DTYPES] == [True, True, False, False]
    monkeypatch.setenv(cpu_slot_write.ENV, "off")
    assert not routed("bfloat16")


def test_the_compiled_write_never_widens_the_cache():
    """The point of the kernel: no float32 copy of the whole bfloat16 cache per write
    (XLA's own scatter converts it to float32 and back)."""
    pages = _pages("bfloat16")
    page, offset = _slots(10)
    new = _pages("float32", 11, (2, 3, K, H))
    hlo = jax.jit(lambda p: cache.write_kv(p, 2, new, page, offset),
                  donate_argnums=0).lower(pages).compile().as_text()
    assert f"f32[{L},{K},{P},{Z},{H}]" not in hlo
    assert f"bf16[{L},{K},{P},{Z},{H}]" in hlo


def test_writes_in_a_loop_equal_xlas_scatter_in_the_same_loop(monkeypatch):
    """Writes carried through a `lax.fori_loop` (as the decode loop carries its cache),
    moves included, give XLA's scatter's pages bit for bit."""
    kv = (_pages("bfloat16", 12), _pages("bfloat16", 13), None, None)

    def run(kv):
        def body(i, kv):
            new = jnp.full((1, 1, K, H), i, jnp.float32) * 1.37
            page, offset = jnp.full((1, 1), i % P), jnp.full((1, 1), i % Z)
            kv = cache.write_layer_kv(kv, i % L, new, -new, page, offset)
            moved = cache.move_slot_arrays(jnp.arange(P)[None], jnp.full((1, 1), i),
                                           jnp.full((1, 1), i + 5), jnp.ones((1, 1), bool),
                                           *kv[:2])
            return tuple(moved) + (None, None)
        return jax.lax.fori_loop(0, 9, body, kv)

    got = jax.jit(run)(kv)
    monkeypatch.setenv(cpu_slot_write.ENV, "off")
    want = jax.jit(run)(kv)  # a new trace: the env is read when tracing
    for g, w in zip(got[:2], want[:2]):
        np.testing.assert_array_equal(_bits(g), _bits(w))


@pytest.mark.parametrize("kv_commit", ["compact", "write-kept"])
def test_generate_over_bfloat16_caches_is_the_same_with_the_kernel_or_without(
        tiny_target, monkeypatch, kv_commit):
    """A speculative call over a bfloat16 cache (the verify's writes or the kept tokens'
    write, and the commit's moves) gives the same tokens either way."""
    prompts = [[3, 4, 5, 3, 4, 5, 3, 4], [7, 8, 9, 10, 7, 8]]

    def tokens():
        PROGRAMS.clear()
        out = specjax.generate(tiny_target, prompts, max_new_tokens=20, ignore_eos=True,
                               speculator=DraftModel.create(tiny_target, k=3),
                               adaptive=False, kv_commit=kv_commit,
                               kv_cache_dtype="bfloat16")
        return out.tokens, out.stats.accepted

    with_kernel = tokens()
    monkeypatch.setenv(cpu_slot_write.ENV, "off")
    assert tokens() == with_kernel
    assert with_kernel[1] > 0  # drafts were accepted: the commit moved or wrote them
    PROGRAMS.clear()


def test_without_a_compiler_it_warns_once_and_xlas_scatter_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_slot_write.KERNEL, "_state", {})
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    with pytest.warns(RuntimeWarning, match="KV-slot write kernel is unavailable"):
        assert not cpu_slot_write.applies(_pages("bfloat16"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        page, offset = _slots(14)
        new = _pages("float32", 15, (2, 3, K, H))
        assert not _writes_through_kernel(
            lambda p: cache.write_kv(p, 0, new, page, offset), _pages("bfloat16"))


def test_a_layer_past_the_stack_is_an_error_naming_it():
    page, offset = _slots(16)
    new = _pages("float32", 17, (2, 3, K, H))
    with pytest.raises(Exception, match="layer out of range"):
        jax.block_until_ready(cpu_slot_write.write(_pages("bfloat16"), jnp.int32(L), new,
                                                   page, offset))
