"""int8 KV cache: the quantization, the cache that holds it, attention over it, and the
errors (`specjax.kv_quant`, `generate(..., kv_cache_dtype="int8")`)."""

import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import kv_quant
from specjax.attention import reference_paged_attention
from specjax.cache import PagedKVCache, PagePool, move_slots, write_slots
from specjax.config import tiny_llama
from specjax.model import step_kv


def test_quantize_rounds_each_vector_to_half_a_step():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 5, 64)) * rng.uniform(0.01, 100, (3, 5, 1)),
                    jnp.float32)
    x = x.at[1, 2].set(0.0)  # an all-zero vector: scale 0, values 0, no NaN
    q, s = kv_quant.quantize(x)
    assert q.dtype == jnp.int8 and s.dtype == jnp.float32 and s.shape == (3, 5)
    np.testing.assert_allclose(s, np.abs(np.asarray(x)).max(-1) / 127, rtol=1e-6)
    err = np.abs(np.asarray(kv_quant.fake_quantize(x)) - np.asarray(x))
    assert np.all(err <= np.asarray(s)[..., None] / 2 * (1 + 1e-5) + 1e-30)
    assert np.all(np.abs(np.asarray(q)).max(-1)[np.asarray(s) > 0] == 127)  # full range
    assert np.all(np.asarray(kv_quant.fake_quantize(x))[1, 2] == 0)


@pytest.mark.parametrize("bad", ["int4", "int32", "float8", 3])
def test_bad_kv_cache_dtype_is_named(tiny_target, bad):
    with pytest.raises(ValueError, match=f"kv_cache_dtype={bad!r}"):
        specjax.generate(tiny_target, [[1, 2, 3]], max_new_tokens=2, kv_cache_dtype=bad)


def _filled_cache(config, dtype, rng, lengths=(21, 9), page_size=16, num_pages=8):
    """A cache whose pages hold random keys/values, written through `write_slots`."""
    pool = PagePool(num_pages=num_pages, page_size=page_size)
    for r, n in enumerate(lengths):
        pool.allocate(r, n + 8)
    table = pool.page_table(range(len(lengths)), pages_per_row=3)
    cache = PagedKVCache.create(config, table, num_pages=num_pages, page_size=page_size,
                                dtype=dtype)
    t = max(lengths)
    shape = (config.num_layers, len(lengths), t, config.num_kv_heads, config.head_dim)
    k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2))
    start = jnp.zeros((len(lengths),), jnp.int32)
    cache = write_slots(cache, k, v, start, jnp.asarray(lengths, jnp.int32))
    return cache.replace(lengths=jnp.asarray(lengths, jnp.int32)), k, v


def test_int8_cache_holds_quantized_values_and_moves_their_scales():
    config = tiny_llama()
    rng = np.random.default_rng(1)
    cache, k, _ = _filled_cache(config, jnp.int8, rng)
    assert cache.quantized and cache.k_pages.dtype == jnp.int8
    assert cache.k_scales.shape == cache.k_pages.shape[:-1]
    f32, _, _ = _filled_cache(config, jnp.float32, np.random.default_rng(1))
    assert not f32.quantized and f32.k_scales is None
    # bytes per slot: H int8 + one float32 scale, against 4H for float32
    h = config.head_dim
    int8_bytes = cache.k_pages.nbytes + cache.k_scales.nbytes
    assert int8_bytes * 4 * h == f32.k_pages.nbytes * (h + 4)

    def slot(c, layer, row, s):  # dequantized key of row `row`, slot s: [K, H]
        page = int(c.page_table[row, s // c.page_size])
        pages = c.k_pages[layer, :, page, s % c.page_size]
        if not c.quantized:
            return np.asarray(pages)
        return np.asarray(kv_quant.dequantize(pages, c.k_scales[layer, :, page, s % c.page_size],
                                              jnp.float32))

    np.testing.assert_array_equal(slot(cache, 1, 0, 13), kv_quant.fake_quantize(k[1, 0, 13]))
    np.testing.assert_array_equal(slot(f32, 1, 0, 13), k[1, 0, 13])
    # tree commit: slots 15..16 of row 0 move to 10..11, pages and scales together
    src = jnp.asarray([[15, 16], [0, 0]], jnp.int32)
    dst = jnp.asarray([[10, 11], [0, 0]], jnp.int32)
    valid = jnp.asarray([[True, True], [False, False]])
    moved = move_slots(cache, src, dst, valid)
    for a, b in ((10, 15), (11, 16)):
        np.testing.assert_array_equal(slot(moved, 0, 0, a), slot(cache, 0, 0, b))
    np.testing.assert_array_equal(slot(moved, 0, 1, 5), slot(cache, 0, 1, 5))


def test_reference_attention_dequantizes_to_the_query_dtype():
    """Attention over int8 pages == attention over the pages dequantized by hand."""
    config = tiny_llama()
    rng = np.random.default_rng(2)
    cache, _, _ = _filled_cache(config, jnp.int8, rng)
    q = jnp.asarray(rng.standard_normal((2, 3, config.num_heads, config.head_dim)), jnp.float32)
    args = (cache.page_table, cache.lengths, jnp.asarray([3, 2], jnp.int32))
    got = reference_paged_attention(q, cache.k_pages[0], cache.v_pages[0], *args, scale=0.25,
                                    k_scales=cache.k_scales[0], v_scales=cache.v_scales[0])
    k = kv_quant.dequantize(cache.k_pages[0], cache.k_scales[0], jnp.float32)
    v = kv_quant.dequantize(cache.v_pages[0], cache.v_scales[0], jnp.float32)
    want = reference_paged_attention(q, k, v, *args, scale=0.25)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_int8_forward_is_close_to_float_and_not_equal():
    """A decode step over an int8 cache: logits near the float cache's (per-token scales
    keep keys/values within half a step of 1/127 of their largest entry)."""
    model = specjax.init_model(tiny_llama(vocab_size=128), seed=0)
    out = {}
    for dtype in (jnp.float32, jnp.int8):
        cache, _, _ = _filled_cache(model.config, dtype, np.random.default_rng(3))
        tok = jnp.asarray([[5], [7]], jnp.int32)
        logits, _, new = specjax.step(model.config, model.params, cache, tok,
                                      cache.lengths[:, None])
        out[dtype] = np.asarray(logits)
        assert new.quantized == (dtype == jnp.int8)
    diff = np.abs(out[jnp.int8] - out[jnp.float32])
    assert 0 < diff.max() < 0.02 * np.abs(out[jnp.float32]).max()


def test_plan_memory_counts_int8_pages_and_scales():
    config = tiny_llama()
    mesh = {"data": 1, "model": 1}
    kw = dict(batch=2, max_len=64, page_size=16)
    plans = {d: specjax.plan_memory(config, mesh, kv_cache_dtype=d, **kw)
             for d in ("float32", "int8")}
    table = 2 * 4 * 4 + 2 * 4  # page table [2, 4] + lengths [2], int32
    slots = config.num_layers * config.num_kv_heads * 2 * 64 * 2  # layers x K x rows x len x (K, V)
    assert plans["float32"].kv_cache == slots * config.head_dim * 4 + table
    assert plans["int8"].kv_cache == slots * (config.head_dim + 4) + table
    draft = tiny_llama(num_layers=1)  # generate gives the draft's cache the same dtype
    with_draft = specjax.plan_memory(config, mesh, kv_cache_dtype="int8", draft_config=draft,
                                     **kw)
    assert with_draft.draft_kv_cache == slots // config.num_layers * (draft.head_dim + 4) + table
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8'"):
        specjax.plan_memory(config, mesh, kv_cache_dtype="fp8", **kw)


def test_int8_generate_equals_stepping_an_int8_cache_by_hand(tiny_target):
    """`generate`'s compiled loop (prefill chunks, decode steps, scales in the carry)
    gives what greedy decoding by hand over an int8 cache gives, one `step` at a time."""
    cfg, params = tiny_target.config, tiny_target.params
    prompt, new = [22, 104, 83, 116, 64, 77, 124, 93], 10  # int8 and float part at token 7
    got = specjax.generate(tiny_target, [prompt], max_new_tokens=new, ignore_eos=True,
                           kv_cache_dtype="int8").tokens[0]
    assert got != specjax.generate(tiny_target, [prompt], max_new_tokens=new,
                                   ignore_eos=True).tokens[0]
    pool = PagePool(num_pages=2, page_size=16)
    pool.allocate(0, 32)
    cache = PagedKVCache.create(cfg, pool.page_table([0], 2), num_pages=2, page_size=16,
                                dtype=jnp.int8)
    tokens = jnp.asarray([prompt], jnp.int32)
    want = []
    for _ in range(new):
        pos = cache.lengths[:, None] + jnp.arange(tokens.shape[1])[None, :]
        logits, _, cache = specjax.step(cfg, params, cache, tokens, pos)
        want.append(int(jnp.argmax(logits[0, -1])))
        tokens = jnp.asarray([[want[-1]]], jnp.int32)
    assert got == want


def test_a_deferred_step_sees_what_a_written_one_reads_back():
    """Over an int8 cache, a tree verify that keeps its new keys/values out of the cache
    (write_in_layers=False, the speculative loop's path on CPU) gives the logits of one that
    writes them and reads them back quantized (to float32 rounding); then committing the
    returned keys/values (`write_slots`) leaves the cache the written step left."""
    model = specjax.init_model(tiny_llama(vocab_size=128), seed=0)
    cfg, params = model.config, model.params
    cache, _, _ = _filled_cache(cfg, jnp.int8, np.random.default_rng(4))
    tokens = jnp.asarray([[5, 6, 7], [8, 9, 10]], jnp.int32)
    tree = jnp.asarray(np.broadcast_to([[1, 0, 0], [1, 1, 0], [1, 0, 1]], (2, 3, 3)), bool)
    pos = cache.lengths[:, None] + jnp.asarray([[0, 1, 1]], jnp.int32)
    written, _, after = specjax.step(cfg, params, cache, tokens, pos, tree)
    deferred, _, out = step_kv(cfg, params, cache, tokens, pos, tree,
                               write_in_layers=False)
    k_new, v_new = out.k, out.v
    # equal up to float32 summation order (the deferred softmax runs over two parts)
    np.testing.assert_allclose(np.asarray(deferred), np.asarray(written), rtol=1e-5, atol=1e-6)
    committed = write_slots(cache, k_new, v_new, cache.lengths, jnp.asarray([3, 3]))
    for name in ("k_pages", "v_pages"):
        np.testing.assert_array_equal(getattr(committed, name), getattr(after, name))
    for name in ("k_scales", "v_scales"):  # one division, fused differently: within an ulp
        np.testing.assert_allclose(getattr(committed, name), getattr(after, name), rtol=1e-6)


# the CLI's int8 run compiles a plain and an n-gram program of its own (-m slow); int8
# decoding itself runs by default in the tests above and tests/test_bench_suite.py
@pytest.mark.slow
def test_cli_generate_with_an_int8_cache(capsys):
    from specjax import cli

    assert cli.main(["generate", "--ids", "1,2,3,1,2,3,1,2", "--max-new-tokens", "6",
                     "--kv-cache-dtype", "int8"]) == 0
    assert "greedy outputs identical: True" in capsys.readouterr().out


def test_cli_names_a_bad_kv_cache_dtype(capsys):
    from specjax import cli

    assert cli.main(["generate", "--kv-cache-dtype", "int3"]) == 2
    assert "kv_cache_dtype='int3'" in capsys.readouterr().err
