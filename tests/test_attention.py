"""specjax.attention: the entry point's contract (module docstring), on hostile data, per backend.

Unused pages and every slot at or past a row's length hold NaN; page tables are
shuffled; lengths are ragged around the page size. The reference is a float64 numpy
loop that spells the contract out slot by slot. Decode, prefill, verify and tree
cases are kept apart.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import attention
from specjax.config import ModelConfig
from specjax.pallas_kernels.ragged_paged_attention.blockwise import (
    blockwise_ragged_paged_attention,
)
from tests.hf_models import CACHE_ATOL, VOCAB

ATOL = CACHE_ATOL["float32"]
N, K, H = 4, 2, 8  # query heads, KV heads, head_dim
Z, M, P = 4, 5, 32  # page size, pages per row, pages in the pool (7 never named)
# kv_lens around the page size: Z-1, Z, Z+1, long; an idle row (nothing new, empty).
KV_LENS = np.asarray([Z - 1, Z, Z + 1, M * Z - 2, 0], np.int32)


def _naive(q, k_pages, v_pages, table, kv_lens, q_lens, mask, scale, soft_cap, window):
    """float64 loop over the contract: [B, T, N, H], padding queries left at 0."""
    b, t_len = q.shape[:2]
    out = np.zeros(q.shape, np.float64)
    for row in range(b):
        start = kv_lens[row] - q_lens[row]
        for t in range(q_lens[row]):
            seen = []
            for j in range(kv_lens[row]):
                rel = j - start
                ok = rel < 0 or (mask[row, t, rel] if mask is not None else rel <= t)
                if window is not None:
                    ok = ok and start + t - j < window
                if ok:
                    seen.append(j)
            page = table[row, np.asarray(seen) // Z]
            off = np.asarray(seen) % Z
            for n in range(N):
                kk = k_pages[n // (N // K), page, off].astype(np.float64)  # [S', H]
                vv = v_pages[n // (N // K), page, off].astype(np.float64)
                s = kk @ q[row, t, n].astype(np.float64) * scale
                if soft_cap is not None:
                    s = soft_cap * np.tanh(s / soft_cap)
                p = np.exp(s - s.max())
                out[row, t, n] = (p / p.sum()) @ vv
    return out


def _case(t_len, q_lens, mask=None, seed=0):
    """Inputs with NaN in every unused page and every slot at or past kv_lens."""
    rng = np.random.default_rng(seed)
    b = len(KV_LENS)
    table = rng.permutation(P)[:b * M].reshape(b, M).astype(np.int32)
    k_pages = np.full((K, P, Z, H), np.nan, np.float32)
    v_pages = np.full((K, P, Z, H), np.nan, np.float32)
    for row in range(b):
        for j in range(KV_LENS[row]):
            page, off = table[row, j // Z], j % Z
            k_pages[:, page, off] = rng.standard_normal((K, H))
            v_pages[:, page, off] = rng.standard_normal((K, H))
    q = rng.standard_normal((b, t_len, N, H)).astype(np.float32)
    return q, k_pages, v_pages, table, KV_LENS.copy(), np.asarray(q_lens, np.int32), mask


def _tree_mask(parents, t_len, b):
    mask = np.zeros((b, t_len, t_len), bool)
    for i in range(len(parents)):
        j = i
        while j >= 0:
            mask[:, i, j] = True
            j = parents[j]
    return mask


CASES = {  # name -> (T, q_lens, tree parents or None)
    "decode": (1, [1, 1, 1, 1, 0], None),
    "prefill": (5, [3, 4, 5, 5, 0], None),  # whole rows (first 3) and a chunk (row 3)
    "verify": (3, [3, 2, 3, 3, 0], None),  # a k+1 = 3 chain, one row shorter
    "tree": (5, [3, 4, 5, 5, 0], [-1, 0, 0, 1, 2]),
}


def _backend_params():
    """Every case on the reference; on the Pallas kernel (interpret mode on CPU, ~5 s a
    case) decode and tree by default, the rest under `-m slow`."""
    out = []
    for name in CASES:
        for soft_cap, window in [(None, None), (5.0, None), (None, 3)]:
            out.append(pytest.param("reference", name, soft_cap, window))
            fast = name in ("decode", "tree") and soft_cap is window is None
            out.append(pytest.param("pallas", name, soft_cap, window,
                                    marks=() if fast else pytest.mark.slow))
    return out


@pytest.mark.parametrize("backend, name, soft_cap, window", _backend_params())
def test_backend_matches_contract_with_nan_outside(backend, name, soft_cap, window):
    t_len, q_lens, parents = CASES[name]
    mask = None if parents is None else _tree_mask(parents, t_len, len(KV_LENS))
    args = _case(t_len, q_lens, mask)
    scale = H ** -0.5
    out = np.asarray(attention.paged_attention(
        *map(lambda a: None if a is None else jnp.asarray(a), args), scale=scale,
        soft_cap=soft_cap, sliding_window=window, backend=backend))
    assert np.isfinite(out).all()  # NaN never reaches any output, padding queries included
    want = _naive(*args, scale, soft_cap, window)
    for row, n in enumerate(q_lens):
        np.testing.assert_allclose(out[row, :n], want[row, :n], atol=ATOL, rtol=0)


def test_nan_query_rows_stay_in_their_row():
    """A NaN query (a garbage padding token) poisons only its own output."""
    q, k_pages, v_pages, table, kv_lens, q_lens, _ = _case(5, [3, 4, 5, 5, 0])
    q[0, 4] = np.nan  # row 0 has q_len 3: t = 4 is padding
    out = np.asarray(attention.paged_attention(
        jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(table),
        jnp.asarray(kv_lens), jnp.asarray(q_lens), scale=H ** -0.5, backend="reference"))
    bad = ~np.isfinite(out).all(axis=(2, 3))
    assert bad.sum() <= 1 and not bad[:, :4].any() and not bad[1:].any()


def test_default_backend_and_env_var(monkeypatch):
    monkeypatch.delenv("SPECJAX_ATTENTION", raising=False)
    assert attention.default_backend() == ("reference" if jax.default_backend() == "cpu"
                                           else "pallas")
    monkeypatch.setenv("SPECJAX_ATTENTION", "reference")
    assert attention.resolve_backend(None) == "reference"
    monkeypatch.setenv("SPECJAX_ATTENTION", "flash")
    with pytest.raises(ValueError, match=r"SPECJAX_ATTENTION='flash' must be one of"):
        attention.resolve_backend(None)
    assert attention.resolve_backend("reference") == "reference"  # explicit beats the env


def test_backend_argument_validation(monkeypatch):
    monkeypatch.delenv("SPECJAX_ATTENTION", raising=False)
    args = [jnp.asarray(a) for a in _case(1, [1, 1, 1, 1, 0])[:6]]
    with pytest.raises(ValueError, match=r"attention backend='cuda' must be one of"):
        attention.paged_attention(*args, scale=1.0, backend="cuda")
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=1,
                         num_heads=4, num_kv_heads=2)
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), specjax.param_shapes(config))
    tokens = jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(ValueError, match=r"attention backend='cuda'"):
        specjax.step(config, params, None, tokens, tokens, attention_backend="cuda")
    monkeypatch.setenv("SPECJAX_ATTENTION", "bogus")
    with pytest.raises(ValueError, match=r"SPECJAX_ATTENTION='bogus'"):
        specjax.step(config, params, None, tokens, tokens)


@pytest.mark.parametrize("name, soft_cap, window", [
    (n, sc, w) for n in CASES for sc, w in [(None, None), (5.0, None), (None, 3)]])
def test_attention_with_new_kv_beside_the_pages(name, soft_cap, window):
    """`paged_attention(new_kv=...)` (the verify forward that defers its cache write)
    equals the contract with the new tokens written, and never reads their slots."""
    t_len, q_lens, parents = CASES[name]
    b = len(KV_LENS)
    mask = None if parents is None else _tree_mask(parents, t_len, b)
    q, k_pages, v_pages, table, kv_lens, q_lens, mask = _case(t_len, q_lens, mask, seed=1)
    want = _naive(q, k_pages, v_pages, table, kv_lens, q_lens, mask, H ** -0.5, soft_cap,
                  window)
    k_new = np.full((b, t_len, K, H), np.nan, np.float32)  # padding tokens: NaN too
    v_new = np.full((b, t_len, K, H), np.nan, np.float32)
    for row in range(b):
        for t in range(q_lens[row]):
            j = kv_lens[row] - q_lens[row] + t
            page, off = table[row, j // Z], j % Z
            k_new[row, t], v_new[row, t] = k_pages[:, page, off], v_pages[:, page, off]
            k_pages[:, page, off] = v_pages[:, page, off] = np.nan  # not written yet
    out = np.asarray(attention.paged_attention(
        *map(jnp.asarray, (q, k_pages, v_pages, table, kv_lens, q_lens)),
        None if mask is None else jnp.asarray(mask), scale=H ** -0.5, soft_cap=soft_cap,
        sliding_window=window, backend="reference", new_kv=(jnp.asarray(k_new),
                                                            jnp.asarray(v_new))))
    for row, n in enumerate(q_lens):
        np.testing.assert_allclose(out[row, :n], want[row, :n], atol=ATOL, rtol=0)
        assert np.isfinite(out[row, :n]).all()
    with pytest.raises(ValueError, match="new_kv .* needs the reference backend"):
        attention.paged_attention(*map(jnp.asarray, (q, k_pages, v_pages, table, kv_lens,
                                                      q_lens)), scale=1.0, backend="pallas",
                                  new_kv=(jnp.asarray(k_new), jnp.asarray(v_new)))


def test_float32_queries_over_a_bfloat16_cache_compute_in_float32():
    """Mixed dtypes compute in the wider one, the probabilities included: float32 queries
    over bf16 pages give exactly what the same pages upcast to float32 give. (Casting p to
    the pages' bf16 made a bf16 KV cache's greedy decoding part from float32's after 9
    tokens in `python -m specjax.bench.kv_cache`, against 64 of 64 equal with p in f32.)"""
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((2, 3, N, H)), jnp.float32)
    pages = [jnp.asarray(rng.standard_normal((K, P, Z, H)), jnp.bfloat16) for _ in range(2)]
    table = jnp.asarray(rng.permutation(P)[:2 * M].reshape(2, M), jnp.int32)
    args = (table, jnp.asarray([7, 13], jnp.int32), jnp.asarray([3, 2], jnp.int32))
    got = attention.reference_paged_attention(q, *pages, *args, scale=0.3)
    want = attention.reference_paged_attention(q, *(p.astype(jnp.float32) for p in pages),
                                               *args, scale=0.3)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("name, soft_cap, window, block_pages", [
    (n, sc, w, bp) for n in CASES for sc, w in [(None, None), (5.0, None), (None, 3)]
    for bp in (1, 2)])
def test_blockwise_form_matches_contract(name, soft_cap, window, block_pages):
    """The reference's blockwise form (long prefill chunks) over blocks of 1 or 2 pages:
    several blocks per row, the last ones past every row's end skipped, NaN outside."""
    t_len, q_lens, parents = CASES[name]
    mask = None if parents is None else _tree_mask(parents, t_len, len(KV_LENS))
    args = _case(t_len, q_lens, mask, seed=2)
    scale = H ** -0.5
    out = np.asarray(blockwise_ragged_paged_attention(
        *map(lambda a: None if a is None else jnp.asarray(a), args), scale=scale,
        soft_cap=soft_cap, sliding_window=window, block_pages=block_pages))
    assert np.isfinite(out).all()
    want = _naive(*args, scale, soft_cap, window)
    for row, n in enumerate(q_lens):
        np.testing.assert_allclose(out[row, :n], want[row, :n], atol=ATOL, rtol=0)


def test_blockwise_form_reads_int8_pages_as_the_reference():
    """int8 pages with their scales: the blockwise form dequantizes as the reference."""
    q, k_pages, v_pages, table, kv_lens, q_lens, _ = _case(5, [3, 4, 5, 5, 0], seed=3)
    kp, ks = specjax.kv_quant.quantize(jnp.asarray(np.nan_to_num(k_pages)))
    vp, vs = specjax.kv_quant.quantize(jnp.asarray(np.nan_to_num(v_pages)))
    args = (jnp.asarray(q), kp, vp, jnp.asarray(table), jnp.asarray(kv_lens),
            jnp.asarray(q_lens))
    kw = dict(scale=H ** -0.5, k_scales=ks, v_scales=vs)
    got = blockwise_ragged_paged_attention(*args, block_pages=2, **kw)
    want = attention.reference_paged_attention(*args, **kw)
    for row, n in enumerate(q_lens):
        np.testing.assert_allclose(np.asarray(got)[row, :n], np.asarray(want)[row, :n],
                                   atol=ATOL, rtol=0)


def test_long_chunks_take_the_blockwise_form(monkeypatch):
    """`paged_attention` on the reference backend: T >= BLOCKWISE_MIN_QUERIES goes block
    by block, fewer queries gather the whole table; both give the contract's output."""
    calls = []
    real = attention.blockwise_ragged_paged_attention
    monkeypatch.setattr(attention, "blockwise_ragged_paged_attention",
                        lambda *a, **k: calls.append(a[0].shape[1]) or real(*a, **k))
    monkeypatch.setattr(attention, "BLOCKWISE_MIN_QUERIES", 5)
    for t_len, q_lens in ((5, [3, 4, 5, 5, 0]), (3, [3, 2, 3, 3, 0])):
        args = _case(t_len, q_lens, seed=4)
        out = np.asarray(attention.paged_attention(*map(jnp.asarray, args[:6]),
                                                   scale=H ** -0.5, backend="reference"))
        want = _naive(*args, H ** -0.5, None, None)
        for row, n in enumerate(q_lens):
            np.testing.assert_allclose(out[row, :n], want[row, :n], atol=ATOL, rtol=0)
    assert calls == [5]

