"""Pallas ragged paged attention (tree mask) == the jnp reference, on hostile data.

`RaggedPagedAttentionTest` holds the cases; its subclasses pick how they run:
`TestInterpret` (CPU CI: the Triton kernel in interpret mode), `TestMosaicInterpret`
(the TPU kernel under TPU interpret mode; slow, a smoke subset runs by default),
`TestGpu` / `TestTpu` (compiled, on the real device: -m gpu / -m tpu).

Hostile data: shuffled page tables whose entries past a row's pages name NaN-filled
pages, NaN in every unused page and in the slots past each row's length, ragged lengths
(1, Z-1, Z, Z+1, long) and padding queries (q_lens < T, one row with q_lens = 0) with
garbage mask bits, real trees (each node's parent earlier; mask = ancestors + self).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.cache import PagePool
from specjax.pallas_kernels.ragged_paged_attention import (
    check_inputs,
    dequantize_pages,
    quantize_pages,
    ragged_paged_attention,
    reference_ragged_paged_attention,
    static_check,
)

# One tolerance table keyed by dtype (STYLE): float32 parity is tight.
TOL = {
    jnp.dtype(jnp.float32): dict(rtol=1e-5, atol=1e-6),
    jnp.dtype(jnp.bfloat16): dict(rtol=2e-2, atol=2e-2),
}
PAGE_SIZE = 16
RAGGED = (1, PAGE_SIZE - 1, PAGE_SIZE, PAGE_SIZE + 1, 5 * PAGE_SIZE + 3)  # KV lengths


def random_tree_mask(rng, t_len: int) -> np.ndarray:
    """[T, T] ancestors-and-self mask of a random tree (node i's parent is < i)."""
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, t_len)]
    mask = np.zeros((t_len, t_len), bool)
    for i in range(t_len):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def make_case(rng, *, t_len, num_heads, num_kv_heads, head_dim, dtype, kv_lens=RAGGED,
              q_lens=None, tree=False, page_size=PAGE_SIZE, spare_pages=3):
    """Inputs of one call; rows differ in length, everything a row must not read is NaN."""
    kv_lens = np.asarray(kv_lens, np.int32)
    b = kv_lens.size
    if q_lens is None:  # full rows, but the shortest rows can hold fewer new tokens
        q_lens = np.minimum(kv_lens, t_len)
    q_lens = np.asarray(q_lens, np.int32)
    used = -(-kv_lens // page_size)  # pages each row reads
    m = int(used.max()) + 1  # one table column past the longest row
    num_pages = int(used.sum()) + spare_pages
    perm = rng.permutation(num_pages)
    unused = perm[used.sum():]  # never named by a row's first pages: filled with NaN
    table = np.empty((b, m), np.int32)
    offset = 0
    for r in range(b):
        table[r, : used[r]] = perm[offset: offset + used[r]]
        table[r, used[r]:] = rng.choice(unused, m - used[r])  # past the row: NaN pages
        offset += used[r]
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    k[:, unused] = v[:, unused] = np.nan
    for r in range(b):  # slots past the row's length in its last page
        if kv_lens[r] % page_size:
            page = table[r, used[r] - 1]
            k[:, page, kv_lens[r] % page_size:] = v[:, page, kv_lens[r] % page_size:] = np.nan
    q = rng.standard_normal((b, t_len, num_heads, head_dim)).astype(np.float32)
    mask = None
    if tree:
        mask = rng.random((b, t_len, t_len)) < 0.5  # garbage where t or j >= q_lens
        for r in range(b):
            mask[r, : q_lens[r], : q_lens[r]] = random_tree_mask(rng, int(q_lens[r]))
        mask = jnp.asarray(mask)
    return dict(q=jnp.asarray(q, dtype), k_pages=jnp.asarray(k, dtype),
                v_pages=jnp.asarray(v, dtype), page_table=jnp.asarray(table),
                kv_lens=jnp.asarray(kv_lens), q_lens=jnp.asarray(q_lens), mask=mask)


def hf(x):  # bf16 arrays to float32 numpy
    return np.asarray(jnp.asarray(x, jnp.float32))


def assert_matches_reference(case, *, scale=0.125, soft_cap=None, sliding_window=None,
                             tol=None, **kernel_options):
    """Kernel == reference on valid queries (dtype tolerance); finite everywhere.

    int8 cases (`k_scales` in `case`) compare with the reference on dequantized pages.
    """
    opts = dict(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
    out = ragged_paged_attention(**case, **opts, **kernel_options)
    ref_case = dict(case)
    if "k_scales" in case:
        dtype = case["q"].dtype
        for name in ("k", "v"):
            ref_case[f"{name}_pages"] = dequantize_pages(
                case[f"{name}_pages"], ref_case.pop(f"{name}_scales"), dtype)
    ref = reference_ragged_paged_attention(**ref_case, **opts)
    assert out.shape == case["q"].shape and out.dtype == case["q"].dtype
    out, ref = hf(out), hf(ref)
    assert np.isfinite(out).all(), "padding queries must be finite too"
    valid = np.arange(out.shape[1])[None, :] < np.asarray(case["q_lens"])[:, None]
    np.testing.assert_allclose(out[valid], ref[valid], **(tol or TOL[case["q"].dtype]))


class RaggedPagedAttentionTest:
    """The cases. Subclasses set INTERPRET / LOWERING (see the module docstring)."""

    INTERPRET = False
    LOWERING = None  # None: the default for jax.default_backend()

    def check(self, case, **kw):
        assert_matches_reference(case, lowering=self.LOWERING, interpret=self.INTERPRET,
                                 **kw)

    # --- decode: T = 1 -------------------------------------------------------------
    @pytest.mark.parametrize("group,head_dim,dtype", [
        (1, 64, jnp.float32), (4, 128, jnp.float32), (8, 64, jnp.bfloat16)])
    def test_decode(self, group, head_dim, dtype):
        rng = np.random.default_rng(0)
        self.check(make_case(rng, t_len=1, num_heads=2 * group, num_kv_heads=2,
                             head_dim=head_dim, dtype=dtype))

    # --- chain verify / prefill chunk: causal among the new tokens ------------------
    @pytest.mark.parametrize("t_len,group,head_dim,dtype", [
        (2, 4, 64, jnp.float32), (5, 8, 128, jnp.float32), (16, 1, 64, jnp.bfloat16),
        (64, 4, 64, jnp.float32)])
    def test_causal(self, t_len, group, head_dim, dtype):
        rng = np.random.default_rng(1)
        kv_lens = np.array(RAGGED) + t_len  # every row holds all T new tokens
        self.check(make_case(rng, t_len=t_len, num_heads=group, num_kv_heads=1,
                             head_dim=head_dim, dtype=dtype, kv_lens=kv_lens))

    # --- tree verify ------------------------------------------------------------------
    @pytest.mark.parametrize("t_len,group,head_dim,dtype", [
        (5, 4, 64, jnp.float32), (16, 8, 128, jnp.float32), (16, 1, 64, jnp.bfloat16),
        (64, 4, 64, jnp.float32)])  # T = 64: two mask words per row
    def test_tree(self, t_len, group, head_dim, dtype):
        rng = np.random.default_rng(2)
        self.check(make_case(rng, t_len=t_len, num_heads=2 * group, num_kv_heads=2,
                             head_dim=head_dim, dtype=dtype, tree=True))

    def test_padding_queries(self):
        """q_lens < T (one row with none): valid queries exact, padding ones finite."""
        rng = np.random.default_rng(3)
        kv_lens = np.array([3, 20, 40, 7])
        self.check(make_case(rng, t_len=5, num_heads=4, num_kv_heads=2, head_dim=64,
                             dtype=jnp.float32, kv_lens=kv_lens, q_lens=[3, 0, 5, 2],
                             tree=True))

    # --- options --------------------------------------------------------------------
    @pytest.mark.parametrize("tree", [False, True])
    def test_soft_cap_and_sliding_window(self, tree):
        rng = np.random.default_rng(4)
        case = make_case(rng, t_len=5, num_heads=8, num_kv_heads=2, head_dim=64,
                         dtype=jnp.float32, kv_lens=np.array(RAGGED) + 4, tree=tree)
        self.check(case, scale=1.0, soft_cap=5.0, sliding_window=PAGE_SIZE + 2)

    def test_sliding_window_skips_blocks(self):
        """A window much shorter than the row: whole KV blocks before it are skipped."""
        rng = np.random.default_rng(5)
        case = make_case(rng, t_len=2, num_heads=4, num_kv_heads=4, head_dim=64,
                         dtype=jnp.float32, kv_lens=[300, 2, 129])
        self.check(case, sliding_window=3, pages_per_block=2)

    def test_many_row_and_kv_blocks(self):
        """Small blocks: rows of one token straddle row blocks; many KV blocks per row."""
        rng = np.random.default_rng(6)
        case = make_case(rng, t_len=5, num_heads=24, num_kv_heads=8, head_dim=64,
                         dtype=jnp.float32, tree=True)  # G = 3: not a power of 2
        self.check(case, block_rows=16, pages_per_block=1)

    @pytest.mark.parametrize("tree", [False, True])
    def test_kv_splits(self, tree):
        """Flash-decoding: each row's blocks split over programs, merged afterwards."""
        rng = np.random.default_rng(7)
        case = make_case(rng, t_len=5 if tree else 1, num_heads=8, num_kv_heads=2,
                         head_dim=64, dtype=jnp.float32, tree=tree)
        if self.LOWERING == "mosaic":  # a sequential grid: splits would only add a merge
            with pytest.raises(ValueError, match="kv_splits=3"):
                self.check(case, pages_per_block=1, kv_splits=3)
            return
        self.check(case, pages_per_block=1, kv_splits=3)

    @pytest.mark.parametrize("t_len,tree,dtype", [
        (1, False, jnp.float32), (5, True, jnp.bfloat16)])
    def test_int8_pages(self, t_len, tree, dtype):
        """int8 pages, per-slot scales (NaN where the pages are NaN), dequantized per block."""
        rng = np.random.default_rng(13)
        case = make_case(rng, t_len=t_len, num_heads=8, num_kv_heads=2, head_dim=64,
                         dtype=dtype, tree=tree)
        for name in ("k", "v"):
            pages = case[f"{name}_pages"]
            case[f"{name}_pages"], scales = quantize_pages(pages)
            case[f"{name}_scales"] = jnp.where(jnp.isnan(pages).any(-1), jnp.nan, scales)
        self.check(case, soft_cap=5.0, pages_per_block=2)

    def test_pages_in_another_dtype(self):
        """bf16 pages under float32 queries (a bf16 cache, f32 compute): as the reference,
        which promotes; bf16 tolerance, since it rounds p to the pages' dtype."""
        rng = np.random.default_rng(14)
        case = make_case(rng, t_len=5, num_heads=8, num_kv_heads=2, head_dim=64,
                         dtype=jnp.float32, tree=True)
        case["k_pages"] = case["k_pages"].astype(jnp.bfloat16)
        case["v_pages"] = case["v_pages"].astype(jnp.bfloat16)
        self.check(case, tol=TOL[jnp.dtype(jnp.bfloat16)])

    @pytest.mark.slow
    @pytest.mark.parametrize("t_len", [1, 2, 5, 16, 64])
    @pytest.mark.parametrize("group", [1, 4, 8])
    @pytest.mark.parametrize("head_dim", [64, 128])
    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("tree", [False, True])
    def test_sweep(self, t_len, group, head_dim, dtype, tree):
        rng = np.random.default_rng(8)
        case = make_case(rng, t_len=t_len, num_heads=2 * group, num_kv_heads=2,
                         head_dim=head_dim, dtype=dtype, tree=tree,
                         kv_lens=np.array(RAGGED) + t_len)
        self.check(case)
        self.check(case, soft_cap=3.0, sliding_window=20)


class TestInterpret(RaggedPagedAttentionTest):
    """CPU CI: the Triton kernel in interpret mode (the CPU default)."""

    INTERPRET = True
    LOWERING = "triton"


@pytest.mark.slow
class TestMosaicInterpret(RaggedPagedAttentionTest):
    """The TPU kernel under TPU interpret mode (0.6-2.5 s a call here): every case, slow."""

    INTERPRET = True
    LOWERING = "mosaic"

    @pytest.fixture(autouse=True)
    def _fresh_caches(self):
        """Each case's programs dropped after it: with all 141 cases' interpreted TPU
        programs kept alive in one process, XLA:CPU segfaulted compiling the ~120th
        (jax 0.10.2, 2026-11-23; the same case passes alone)."""
        yield
        jax.clear_caches()


@pytest.mark.gpu
class TestGpu(RaggedPagedAttentionTest):
    INTERPRET = False
    LOWERING = "triton"


@pytest.mark.tpu
class TestTpu(RaggedPagedAttentionTest):
    INTERPRET = False
    LOWERING = "mosaic"


@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.int8])
def test_model_step_matches_reference(monkeypatch, kv_dtype):
    """A tiny random specjax model over a random, ragged paged cache (float, or int8 with
    per-token scales): a decode step and a tree verify step give the same logits with
    SPECJAX_ATTENTION=pallas (the device's own lowering; CPU: Triton interpret) as with
    the reference backend."""
    config = specjax.config.tiny_llama()
    params = specjax.init_model(config).params
    rows, lengths, num_pages = 2, np.array([21, 9]), 8
    pool = PagePool(num_pages=num_pages, page_size=PAGE_SIZE)
    for r in range(rows):
        pool.allocate(r, int(lengths[r]) + 8)
    table = pool.page_table(range(rows), pages_per_row=3)
    cache = specjax.PagedKVCache.create(config, table, num_pages=num_pages,
                                        page_size=PAGE_SIZE, lengths=lengths, dtype=kv_dtype)
    rng = np.random.default_rng(9)
    shape = cache.k_pages.shape
    k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2))
    if kv_dtype == jnp.int8:
        (k, k_scales), (v, v_scales) = quantize_pages(k), quantize_pages(v)
        cache = cache.replace(k_scales=k_scales, v_scales=v_scales)
    cache = cache.replace(k_pages=k, v_pages=v)
    step = jax.jit(specjax.step, static_argnums=0, static_argnames="attention_backend")
    tree = np.stack([random_tree_mask(rng, 5) for _ in range(rows)])
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (rows, 5)), jnp.int32)
    cases = [  # (tokens, positions, mask): decode, then a tree at depth positions
        (tokens[:, :1], jnp.asarray(lengths[:, None], jnp.int32), None),
        (tokens, jnp.asarray(lengths[:, None] + tree.sum(-1) - 1, jnp.int32),
         jnp.asarray(tree))]
    for tok, pos, mask in cases:
        ref = step(config, params, cache, tok, pos, mask, attention_backend="reference")
        monkeypatch.setenv("SPECJAX_ATTENTION", "pallas")
        out = step(config, params, cache, tok, pos, mask)  # backend from the env
        monkeypatch.delenv("SPECJAX_ATTENTION")
        np.testing.assert_allclose(hf(out[0]), hf(ref[0]), **TOL[jnp.dtype(config.dtype)])


def test_mosaic_interpret_smoke():
    """The TPU kernel under TPU interpret mode, default suite: tree + window + soft-cap."""
    case = make_case(np.random.default_rng(10), t_len=5, num_heads=8, num_kv_heads=2,
                     head_dim=64, dtype=jnp.bfloat16, kv_lens=[4, 17, 40], tree=True)
    assert_matches_reference(case, soft_cap=5.0, sliding_window=20, lowering="mosaic",
                             interpret=True, pages_per_block=2)


@pytest.mark.parametrize("lowering,platform", [("triton", "cuda"), ("mosaic", "tpu")])
@pytest.mark.parametrize("t_len,tree,kv_splits,int8", [
    (1, False, 4, False), (5, False, None, True), (5, True, None, False),
    (64, True, 2, True)])  # T=64: 2 mask words
def test_lowers_for_device(lowering, platform, t_len, tree, kv_splits, int8):
    """The compiled kernels lower on CPU (Pallas -> Triton IR / Mosaic MLIR): catches
    unsupported ops and block shapes without a GPU or TPU. Device compilers not run."""
    case = make_case(np.random.default_rng(11), t_len=t_len, num_heads=8, num_kv_heads=2,
                     head_dim=128, dtype=jnp.bfloat16, kv_lens=[70, 140], tree=tree)
    mask = case.pop("mask")
    kv_splits = kv_splits if lowering == "triton" else None
    scales = {}
    if int8:
        case["k_pages"], scales["k_scales"] = quantize_pages(case["k_pages"])
        case["v_pages"], scales["v_scales"] = quantize_pages(case["v_pages"])

    def fn(*args):
        return ragged_paged_attention(*args, mask, scale=0.1, soft_cap=30.0,
                                      sliding_window=8, lowering=lowering, interpret=False,
                                      kv_splits=kv_splits, **scales)

    lowered = jax.jit(fn).trace(*case.values()).lower(lowering_platforms=(platform,))
    text = lowered.as_text()
    assert ("triton" in text) if lowering == "triton" else ("tpu_custom_call" in text)


class TestValidation:
    """Static errors at trace time and dynamic ones from `check_inputs`, naming the value."""

    def case(self, **kw):
        opts = dict(t_len=2, num_heads=4, num_kv_heads=2, head_dim=64,
                    dtype=jnp.float32, kv_lens=[3, 20])
        opts.update(kw)
        return make_case(np.random.default_rng(12), **opts)

    @pytest.mark.parametrize("change,message", [
        (lambda c: c.update(q=c["q"][0]), "q.shape="),
        (lambda c: c.update(v_pages=c["v_pages"][:, :-1]), "v_pages.shape="),
        (lambda c: c.update(q=c["q"][..., :32]), "head_dim of q"),
        (lambda c: c.update(q=c["q"][:, :, :3]), "num_heads=3"),
        (lambda c: c.update(q=c["q"].astype(jnp.int32)), "q.dtype="),
        (lambda c: c.update(k_pages=c["k_pages"].astype(jnp.bfloat16)), "one float dtype"),
        (lambda c: c.update(k_pages=c["k_pages"].astype(jnp.int32)), "k_pages.dtype="),
        (lambda c: c.update(page_table=c["page_table"][:1]), "page_table.shape="),
        (lambda c: c.update(kv_lens=c["kv_lens"].astype(jnp.int16)), "kv_lens.dtype="),
        (lambda c: c.update(q_lens=c["q_lens"][:1]), "q_lens.shape="),
        (lambda c: c.update(mask=jnp.ones((2, 2, 3), bool)), "mask.shape="),
        (lambda c: c.update(mask=jnp.ones((2, 2, 2), jnp.int32)), "mask.dtype="),
    ])
    def test_static_shapes_and_dtypes(self, change, message):
        case = self.case()
        change(case)
        with pytest.raises(ValueError, match=message):
            ragged_paged_attention(**case, scale=0.1)

    @pytest.mark.parametrize("options,message", [
        (dict(scale=float("nan")), "scale="),
        (dict(scale=0.1, soft_cap=0.0), "soft_cap=0.0"),
        (dict(scale=0.1, sliding_window=0), "sliding_window=0"),
        (dict(scale=0.1, block_rows=12), "block_rows=12"),
        (dict(scale=0.1, pages_per_block=3), "pages_per_block=3"),
        (dict(scale=0.1, kv_splits=0), "kv_splits=0"),
        (dict(scale=0.1, kv_splits=2, lowering="mosaic"), "kv_splits=2"),
        (dict(scale=0.1, num_warps=6), "num_warps=6"),
        (dict(scale=0.1, num_stages=0), "num_stages=0"),
        (dict(scale=0.1, num_warps=8, lowering="mosaic"), "num_warps=8"),
        (dict(scale=0.1, lowering="cuda"), "lowering='cuda'"),
        (dict(scale=0.1, lowering="triton", interpret=False, block_rows=8), "block_rows=8"),
    ])
    def test_static_options(self, options, message):
        with pytest.raises(ValueError, match=message):
            ragged_paged_attention(**self.case(), **options)

    def test_int8_pages_need_scales(self):
        case = self.case()
        k8, ks = quantize_pages(case["k_pages"])
        v8, vs = quantize_pages(case["v_pages"])
        with pytest.raises(ValueError, match="v_scales=None"):
            ragged_paged_attention(**{**case, "k_pages": k8, "v_pages": v8}, scale=0.1,
                                   k_scales=ks)
        with pytest.raises(ValueError, match=r"k_scales.shape=\(2, 3, 16\)"):
            ragged_paged_attention(**{**case, "k_pages": k8, "v_pages": v8}, scale=0.1,
                                   k_scales=ks[:, :3], v_scales=vs)
        with pytest.raises(ValueError, match="must be int8 like"):
            ragged_paged_attention(**{**case, "k_pages": k8}, scale=0.1, k_scales=ks,
                                   v_scales=vs)
        with pytest.raises(ValueError, match="are for int8 pages"):
            ragged_paged_attention(**case, scale=0.1, k_scales=ks, v_scales=vs)

    def test_triton_page_size_must_be_pow2(self):
        case = self.case(page_size=12)
        with pytest.raises(ValueError, match="page_size=12"):
            ragged_paged_attention(**case, scale=0.1, lowering="triton", interpret=False)

    @pytest.mark.parametrize("change,message", [
        (lambda c: c.update(q_lens=jnp.array([3, 2], jnp.int32)), r"q_lens\[0\]=3"),
        (lambda c: c.update(q_lens=jnp.array([2, -1], jnp.int32)), r"q_lens\[1\]=-1"),
        (lambda c: c.update(kv_lens=jnp.array([1, 20], jnp.int32)), r"kv_lens\[0\]=1"),
        (lambda c: c.update(kv_lens=jnp.array([3, 999], jnp.int32)), r"kv_lens\[1\]=999"),
        (lambda c: c.update(page_table=c["page_table"].at[1, 1].set(-1)),
         r"page_table\[1, 1\]=-1"),
        (lambda c: c.update(page_table=c["page_table"].at[0, 0].set(10_000)),
         r"page_table\[0, 0\]=10000"),
    ])
    def test_dynamic_values(self, change, message):
        case = self.case()
        check_inputs(**case)  # the unchanged case is valid
        change(case)
        with pytest.raises(ValueError, match=message):
            check_inputs(**case)
        with pytest.raises(ValueError, match=message):
            ragged_paged_attention(**case, scale=0.1, validate=True)

    def test_dynamic_needs_concrete_values(self):
        case = self.case()
        fn = jax.jit(lambda c: ragged_paged_attention(**c, scale=0.1, validate=True))
        with pytest.raises(ValueError, match="concrete"):
            fn(case)

    def test_unused_table_entries_are_free(self):
        """Entries past a row's pages may hold anything: they are never read."""
        case = self.case()
        case["page_table"] = case["page_table"].at[0, 1:].set(-7)
        check_inputs(**case)
        static_check(**case, scale=0.1, soft_cap=None, sliding_window=None)
