"""The CPU paged-attention kernel (specjax/csrc/paged_attention.cc) against the jnp
reference it stands in for, and where `specjax.attention` hands it calls."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import attention, cache, cpu_attention, kv_quant
from specjax.attention import reference_attention_with_new, reference_paged_attention

PAGE = 16


def _case(seed, *, b=2, t=5, kv_heads=2, group=3, head=64, layers=3, pages=12,
          kv_lens=(40, 23), q_lens=None, tree=False):
    """Stacked pages [L, K, P, Z, H], a shuffled page table, queries, new keys/values and
    a mask (a random tree-like one, each token seeing itself, or None: causal)."""
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    table_pages = -(-max(kv_lens) // PAGE) + 1
    table = jnp.asarray(rng.permutation(pages)[:b * table_pages].reshape(b, table_pages),
                        jnp.int32)
    q_lens = [t, max(1, t - 2)][:b] if q_lens is None else q_lens
    mask = None
    if tree:
        mask = jnp.asarray((rng.random((b, t, t)) < 0.5) & np.tri(t, dtype=bool)
                           | np.eye(t, dtype=bool))
    return dict(q=normal(b, t, kv_heads * group, head),
                k_pages=normal(layers, kv_heads, pages, PAGE, head),
                v_pages=normal(layers, kv_heads, pages, PAGE, head), page_table=table,
                kv_lens=jnp.asarray(kv_lens, jnp.int32), q_lens=jnp.asarray(q_lens, jnp.int32),
                mask=mask, k_new=normal(b, t, kv_heads, head), v_new=normal(b, t, kv_heads, head))


def _valid(c):  # [B, T] the queries whose output the contract defines
    return np.arange(c["q"].shape[1])[None, :] < np.asarray(c["q_lens"])[:, None]


def _reference(c, layer, new, **opts):
    kp, vp, ks, vs = attention.one_layer(layer, c["k_pages"], c["v_pages"], c.get("k_scales"),
                                         c.get("v_scales"))
    if ks is not None:
        opts.update(k_scales=ks, v_scales=vs)
    if new:
        return reference_attention_with_new(
            c["q"], c["k_new"], c["v_new"], c["q_lens"], c["mask"], kp, vp,
            c["page_table"], c["kv_lens"] - c["q_lens"], **opts)
    return reference_paged_attention(c["q"], kp, vp, c["page_table"], c["kv_lens"],
                                     c["q_lens"], c["mask"], **opts)


def _kernel(c, layer, new, **opts):
    return cpu_attention.paged_attention(
        c["q"], c["k_pages"], c["v_pages"], jnp.int32(layer), c["page_table"], c["kv_lens"],
        c["q_lens"], c["mask"], new_kv=(c["k_new"], c["v_new"]) if new else None,
        k_scales=c.get("k_scales"), v_scales=c.get("v_scales"), **opts)


def _narrowed(c, dtype):
    """The case's pages as a cache of `dtype` stores them ("int8": codes and their
    scales), and the same values widened back to float32 pages."""
    narrow, wide = dict(c), dict(c)
    for name in ("k", "v"):
        pages = c[f"{name}_pages"]
        if dtype == "int8":
            codes, scales = kv_quant.quantize(pages)
            narrow.update({f"{name}_pages": codes, f"{name}_scales": scales})
            wide[f"{name}_pages"] = kv_quant.dequantize(codes, scales, jnp.float32)
        else:
            narrow[f"{name}_pages"] = pages.astype(dtype)
            wide[f"{name}_pages"] = narrow[f"{name}_pages"].astype(jnp.float32)
    return narrow, wide


@pytest.mark.parametrize("t,group,head", [(1, 3, 64), (5, 3, 64), (17, 3, 64), (40, 1, 64),
                                          (9, 4, 128)])
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("new", [False, True])
def test_kernel_matches_the_reference(t, group, head, tree, new):
    """Both forms (new tokens in the pages, or beside them), causal and tree masks,
    ragged rows, GQA groups, any layer of the stack."""
    c = _case(t * 7 + group, t=t, group=group, head=head, tree=tree and t > 1,
              kv_lens=(40 + t, 23 + t))
    for layer in (0, 2):
        want = _reference(c, layer, new, scale=head ** -0.5)
        got = _kernel(c, layer, new, scale=head ** -0.5)
        np.testing.assert_allclose(np.asarray(got)[_valid(c)], np.asarray(want)[_valid(c)],
                                   rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("t,tree,new", [(1, False, False), (5, True, True), (17, False, True)])
def test_long_contexts_match_the_reference(t, tree, new):
    """Rows longer than the kernel's chunk of slots (512: attended apart, then merged)
    and shorter, over a shuffled table, with and without a sliding window that leaves a
    whole chunk unseen."""
    c = _case(t + 100, t=t, tree=tree and t > 1, pages=80, kv_lens=(600 + t, 257 + t))
    for opts in (dict(scale=0.125), dict(scale=0.125, sliding_window=60)):
        np.testing.assert_allclose(np.asarray(_kernel(c, 1, new, **opts))[_valid(c)],
                                   np.asarray(_reference(c, 1, new, **opts))[_valid(c)],
                                   rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("new", [False, True])
def test_sliding_window_and_soft_cap_match_the_reference(new):
    c = _case(3, t=6, kv_lens=(50, 31), tree=True)
    opts = dict(scale=0.125, sliding_window=9, soft_cap=5.0)
    np.testing.assert_allclose(np.asarray(_kernel(c, 1, new, **opts))[_valid(c)],
                               np.asarray(_reference(c, 1, new, **opts))[_valid(c)],
                               rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("new", [False, True])
def test_slots_it_must_not_read_may_hold_nan(new):
    """Pages the table does not name, slots at or past each row's length, and (new_kv)
    the new tokens' own slots in the pages hold NaN: the output is the reference's on
    clean pages."""
    c = _case(5, t=4)
    clean = _reference(c, 1, new, scale=0.125)
    k, v = np.array(c["k_pages"]), np.array(c["v_pages"])
    named = set(np.asarray(c["page_table"]).ravel())
    for p in range(k.shape[2]):
        if p not in named:
            k[:, :, p] = v[:, :, p] = np.nan
    table = np.asarray(c["page_table"])
    ends = np.asarray(c["kv_lens"]) - (np.asarray(c["q_lens"]) if new else 0)
    for row, end in enumerate(ends):
        for s in range(end, table.shape[1] * PAGE):
            k[:, :, table[row, s // PAGE], s % PAGE] = np.nan
            v[:, :, table[row, s // PAGE], s % PAGE] = np.nan
    c.update(k_pages=jnp.asarray(k), v_pages=jnp.asarray(v))
    got = np.asarray(_kernel(c, 1, new, scale=0.125))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[_valid(c)], np.asarray(clean)[_valid(c)], rtol=1e-5,
                               atol=2e-6)


@pytest.mark.parametrize("prefix", [37, 509, 600])
def test_a_querys_output_depends_only_on_the_slots_it_sees(prefix):
    """Bit for bit: token j of a 5-token chain verify (its keys beside the pages) gets what
    a one-token step gives it after tokens 0..j were written into the pages; also across
    the kernel's chunks of 512 slots (509: attended apart, then merged) and after one
    (600)."""
    c = _case(11, b=1, t=5, pages=48, kv_lens=(prefix + 5,), q_lens=[5])
    chain = np.asarray(_kernel(c, 0, True, scale=0.125))
    k, v = np.array(c["k_pages"]), np.array(c["v_pages"])
    table = np.asarray(c["page_table"])[0]
    for j in range(5):
        s = prefix + j
        k[0, :, table[s // PAGE], s % PAGE] = np.asarray(c["k_new"])[0, j]
        v[0, :, table[s // PAGE], s % PAGE] = np.asarray(c["v_new"])[0, j]
        one = dict(c, q=c["q"][:, j:j + 1], k_pages=jnp.asarray(k), v_pages=jnp.asarray(v),
                   kv_lens=jnp.asarray([s + 1], jnp.int32), q_lens=jnp.asarray([1], jnp.int32))
        np.testing.assert_array_equal(np.asarray(_kernel(one, 0, False, scale=0.125))[:, 0],
                                      chain[:, j])


@pytest.mark.parametrize("dtype", ["int8", jnp.bfloat16])
@pytest.mark.parametrize("t,kv_lens,tree,new", [(1, (40, 23), False, False),
                                                (5, (45, 28), True, True),
                                                (17, (617, 40), False, True),
                                                (3, (700, 530), True, False)])
def test_narrow_pages_are_attended_as_their_float32_values(dtype, t, kv_lens, tree, new):
    """int8 pages with their scales, and bfloat16 pages: bit for bit what float32 pages
    holding their widened values (`kv_quant.dequantize`; bfloat16 exactly) give, over
    one chunk of slots and several; and the jnp reference's output on the same pages."""
    c = _case(t + 200, t=t, tree=tree and t > 1, pages=96, kv_lens=kv_lens)
    narrow, wide = _narrowed(c, dtype)
    got = np.asarray(_kernel(narrow, 1, new, scale=0.125))
    np.testing.assert_array_equal(got[_valid(c)],
                                  np.asarray(_kernel(wide, 1, new, scale=0.125))[_valid(c)])
    want = np.asarray(_reference(narrow, 1, new, scale=0.125))
    np.testing.assert_allclose(got[_valid(c)], want[_valid(c)], rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", ["int8", jnp.bfloat16])
def test_new_keys_beside_narrow_pages_are_seen_as_written(dtype):
    """`specjax.attention.paged_attention(new_kv=)` over int8 or bfloat16 pages: the new
    tokens' keys/values are seen as the pages would hand them back, so a 5-token chain
    verify gives each token the bits of writing the chain into the pages (quantized or
    rounded) and attending there."""
    c = _case(13, b=1, t=5, pages=48, kv_lens=(45,), q_lens=[5])
    narrow, _ = _narrowed(c, dtype)
    slots = 40 + np.arange(5)[None]  # [B, T]: the chain after its 40-token prefix
    page = jnp.asarray(np.asarray(c["page_table"])[0][slots // PAGE], jnp.int32)
    kv = (narrow["k_pages"], narrow["v_pages"], narrow.get("k_scales"), narrow.get("v_scales"))
    written = dict(narrow, **dict(zip(("k_pages", "v_pages", "k_scales", "v_scales"),
                                      cache.write_layer_kv(kv, jnp.int32(0), c["k_new"],
                                                           c["v_new"], page,
                                                           jnp.asarray(slots % PAGE)))))

    def call(d, new_kv):
        extra = dict(k_scales=d["k_scales"], v_scales=d["v_scales"]) if dtype == "int8" else {}
        return np.asarray(attention.paged_attention(
            d["q"], d["k_pages"], d["v_pages"], d["page_table"], d["kv_lens"], d["q_lens"],
            scale=0.125, layer=jnp.int32(0), new_kv=new_kv, **extra))

    assert cpu_attention.applies(narrow["q"], narrow["k_pages"], narrow.get("k_scales"))
    np.testing.assert_array_equal(call(narrow, (c["k_new"], c["v_new"])),
                                  call(written, None))


def _routes_to_kernel(q, k_pages, v_pages, scales=None, **extra) -> bool:
    c = _case(0, t=q.shape[1])
    args = (q, k_pages, v_pages, c["page_table"], c["kv_lens"], c["q_lens"])
    opts = dict(scale=0.125, layer=jnp.int32(1), **extra)
    if scales is not None:
        opts.update(k_scales=scales, v_scales=scales)
    fn = jax.jit(lambda *a: attention.paged_attention(*a, **opts))
    return cpu_attention.TARGET in fn.lower(*args).as_text()


def test_decode_and_verify_calls_take_the_kernel_and_others_the_jnp_forms(monkeypatch):
    c = _case(1, t=5)
    q, kp, vp = c["q"], c["k_pages"], c["v_pages"]
    assert _routes_to_kernel(q, kp, vp)
    assert _routes_to_kernel(q, kp, vp, new_kv=(c["k_new"], c["v_new"]))
    long = jnp.zeros((2, attention.BLOCKWISE_MIN_QUERIES, 6, 64), jnp.float32)
    assert not _routes_to_kernel(long, kp, vp)  # a prefill chunk: the blockwise form
    assert _routes_to_kernel(q.astype(jnp.bfloat16), kp, vp)  # a bfloat16 model's
    assert not _routes_to_kernel(q.astype(jnp.float16), kp, vp)
    int8, scales = kv_quant.quantize(kp)
    assert _routes_to_kernel(q, int8, kv_quant.quantize(vp)[0], scales)
    assert _routes_to_kernel(q, kp.astype(jnp.bfloat16), vp.astype(jnp.bfloat16))
    assert not _routes_to_kernel(q, kp.astype(jnp.float16), vp.astype(jnp.float16))
    odd = _case(1, t=5, head=96)
    assert not _routes_to_kernel(odd["q"], odd["k_pages"], odd["v_pages"])
    monkeypatch.setenv(cpu_attention.ENV, "off")
    assert not _routes_to_kernel(q, kp, vp)


def test_the_routed_call_equals_the_jnp_form_on_a_sliced_layer():
    """`specjax.attention.paged_attention(layer=)`: the kernel on the stacked pages gives
    the reference's output on that layer's slice."""
    c = _case(2, t=3, tree=True)
    got = attention.paged_attention(c["q"], c["k_pages"], c["v_pages"], c["page_table"],
                                    c["kv_lens"], c["q_lens"], c["mask"], scale=0.125,
                                    layer=jnp.int32(2))
    np.testing.assert_allclose(np.asarray(got)[_valid(c)],
                               np.asarray(_reference(c, 2, False, scale=0.125))[_valid(c)],
                               rtol=1e-5, atol=2e-6)


def test_bfloat16_queries_are_attended_as_their_float32_values():
    """A bfloat16 model's queries: widened (exactly), attended in float32 over bfloat16
    pages, the output rounded to bfloat16; bit for bit the float32 queries' output
    rounded."""
    c = _case(7, t=3, tree=True)
    kp, vp = (c[k].astype(jnp.bfloat16) for k in ("k_pages", "v_pages"))
    q = c["q"].astype(jnp.bfloat16)
    args = (kp, vp, c["page_table"], c["kv_lens"], c["q_lens"], c["mask"])
    got = attention.paged_attention(q, *args, scale=0.125, layer=jnp.int32(1))
    want = attention.paged_attention(q.astype(jnp.float32), *args, scale=0.125,
                                     layer=jnp.int32(1))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got)[_valid(c)],
                                  np.asarray(want.astype(jnp.bfloat16))[_valid(c)])


def test_pages_it_does_not_take_raise_naming_their_dtype():
    c = _case(6, t=2)
    int8, scales = kv_quant.quantize(c["k_pages"])
    bad = [dict(k_pages=int8, v_pages=int8),  # int8 without scales
           dict(k_scales=scales, v_scales=scales),  # float32 with scales
           dict(k_pages=c["k_pages"].astype(jnp.float16),
                v_pages=c["v_pages"].astype(jnp.float16)),
           dict(v_pages=c["v_pages"].astype(jnp.bfloat16))]  # keys and values differ
    for fix in bad:
        with pytest.raises(ValueError, match=r"pages of \w+ \(keys\) and \w+ \(values\)"):
            _kernel(dict(c, **fix), 0, False, scale=0.125)


def test_without_a_compiler_it_warns_once_and_the_jnp_form_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_attention.KERNEL, "_state", {})
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    c = _case(4, t=2)
    with pytest.warns(RuntimeWarning, match="paged-attention kernel is unavailable"):
        assert not cpu_attention.available()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        assert not _routes_to_kernel(c["q"], c["k_pages"], c["v_pages"])
        with pytest.raises(RuntimeError, match="only where `applies` holds"):
            _kernel(c, 0, False, scale=0.125)
