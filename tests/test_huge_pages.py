"""Huge pages for the CPU decode weights: `specjax.huge_pages`, called where the decode
layout is made (`Model.decode_params`, the speculators' `LayoutCache`)."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import huge_pages, init_model
from specjax.config import tiny_llama
from specjax.decoding.programs import LayoutCache
from specjax.speculators import DraftModel

# whether this host's kernel moves pages on request: Linux >= 6.1 (MADV_COLLAPSE), THP
# not `never`
ACTS = huge_pages.is_on()


def _largest(tree) -> jax.Array:
    return max(jax.tree.leaves(tree), key=lambda x: x.nbytes)


def _check_backed(x: jax.Array) -> None:
    """`x`'s aligned span is on huge pages where the host moves pages; else nothing."""
    start, end = huge_pages.span(x)
    if ACTS:
        assert huge_pages.huge_bytes(x) >= end - start
    else:
        assert huge_pages.advise(x) == 0


def _slow(key):
    """[3, 1024, 1024] float32 written only after a dozen 1024^3 products."""
    x = jax.random.normal(key, (1024, 1024)) / 32.0
    x = jax.lax.fori_loop(0, 12, lambda i, x: jnp.tanh(x @ x), x)
    return jnp.stack([x, -x, 2 * x])


@pytest.fixture
def big():
    """A fresh 12 MB array XLA allocated, still being computed when returned (its pages
    not yet written: `advise` must wait for them)."""
    return jax.jit(_slow)(jax.random.key(0))


def test_span_is_the_aligned_pages_inside_the_buffer(big):
    start, end = huge_pages.span(big)
    address = big.unsafe_buffer_pointer()
    assert start % huge_pages.HUGE == 0 and end % huge_pages.HUGE == 0
    assert address <= start < end <= address + big.nbytes
    assert end - start >= big.nbytes - 2 * huge_pages.HUGE
    assert huge_pages.span(jnp.ones(1000)) is None  # smaller than a huge page
    assert huge_pages.span(np.ones((3, 1024, 1024))) is None  # not a jax array


def test_advise_moves_a_large_buffer_onto_huge_pages_and_keeps_its_values(big):
    done = huge_pages.advise({"big": big, "small": jnp.ones(3)})  # while `big` computes
    start, end = huge_pages.span(big)
    assert done == ((end - start) if ACTS else 0)
    _check_backed(big)
    again = jax.jit(_slow)(jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(big), np.asarray(again))


def test_the_switch_turns_it_off(big, monkeypatch):
    monkeypatch.setenv(huge_pages.ENV, "off")
    assert not huge_pages.is_on()
    assert huge_pages.advise(big) == 0
    monkeypatch.setenv(huge_pages.ENV, "on")
    assert huge_pages.is_on() == (huge_pages.thp_mode() not in (None, "never")
                                  and huge_pages.kernel_collapses())


@pytest.mark.parametrize("release, collapses", [
    ("6.1.0-13-amd64", True), ("6.18.44-fc-v1300", True), ("7.0.1", True),
    ("6.0.19", False), ("5.15.0-91-generic", False), ("unknown", False)])
def test_madv_collapse_needs_linux_6_1(release, collapses):
    assert huge_pages.kernel_collapses(release) == collapses


def test_an_older_kernel_advises_nothing(big, monkeypatch):
    monkeypatch.setattr(huge_pages.os, "uname",
                        lambda: type("U", (), {"release": "5.15.0-91-generic"})())
    assert not huge_pages.is_on() and huge_pages.advise(big) == 0


# vocab x hidden float32 = 8 MB of embedding; the layers' stacked [L, ...] weights 4-8 MB
BIG_CONFIG = dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_layers=2,
                  num_heads=8, num_kv_heads=4)


def test_advise_soon_advises_in_the_background(big, monkeypatch):
    calls, real = [], huge_pages.advise
    monkeypatch.setattr(huge_pages, "advise", lambda tree: calls.append(
        (threading.current_thread().name, tree)) or real(tree))
    tree = {"big": big}
    huge_pages.advise_soon(tree)
    huge_pages.wait()
    assert not huge_pages._PENDING
    assert calls == ([("specjax-huge-pages", tree)] if ACTS else [])
    _check_backed(big)
    monkeypatch.setenv(huge_pages.ENV, "off")
    huge_pages.advise_soon(big)  # nothing to do: no thread
    assert not huge_pages._PENDING


@pytest.fixture
def advised(monkeypatch):
    """The trees `huge_pages.advise_soon` was called on (memory freed by an earlier test
    may come back on pages advised already, so being backed alone does not show the
    call); the tests `wait()` for the background work before they look at the pages."""
    calls, real = [], huge_pages.advise_soon
    monkeypatch.setattr(huge_pages, "advise_soon",
                        lambda tree: calls.append(tree) or real(tree))
    return calls


def _leaf_ids(tree) -> set:
    return {id(x) for x in jax.tree.leaves(tree)}


def test_the_decode_layout_of_a_model_is_backed(advised):
    model = init_model(tiny_llama(**BIG_CONFIG), seed=0)
    decoded = model.decode_params()
    assert decoded is not model.params
    assert [_leaf_ids(t) for t in advised] == [_leaf_ids(decoded)]
    huge_pages.wait()
    _check_backed(_largest(decoded))
    assert model.decode_params() is decoded and len(advised) == 1  # once per model


def test_a_speculator_laid_out_for_decoding_is_backed(advised):
    draft = DraftModel.create(init_model(tiny_llama(**BIG_CONFIG), seed=1), k=2)
    laid_out = LayoutCache().get(draft, "auto")
    assert [_leaf_ids(t) for t in advised] == [_leaf_ids(laid_out)]
    huge_pages.wait()
    _check_backed(_largest(laid_out.params))


@pytest.mark.parametrize("preset, tokens, inside", [
    (None, huge_pages.EARNS_BACK - 1, "off"),  # a short one-shot run: base pages
    (None, huge_pages.EARNS_BACK, None),  # enough tokens to earn the collapse back
    ("on", 1, "on"),  # the user's own setting wins
])
def test_off_unless_earned(preset, tokens, inside, monkeypatch):
    if preset is None:
        monkeypatch.delenv(huge_pages.ENV, raising=False)
    else:
        monkeypatch.setenv(huge_pages.ENV, preset)
    with huge_pages.off_unless_earned(tokens):
        assert huge_pages.os.environ.get(huge_pages.ENV) == inside
        if inside == "off":
            assert not huge_pages.is_on()
    assert huge_pages.os.environ.get(huge_pages.ENV) == preset  # restored
