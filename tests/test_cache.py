"""specjax.cache: paged decode/prefill/tree steps == the uncached forward; PagePool; move_slots.

Pages come from a `PagePool` whose free list was shuffled, so every row's pages are
scattered; unused pages and slots start as NaN so a stray read poisons the logits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.cache import OutOfPagesError, PagedKVCache, PagePool, move_slots
from specjax.config import ModelConfig
from tests.hf_models import CACHE_ATOL, VOCAB, max_diff, random_params

ATOL = CACHE_ATOL["float32"]
STEP = jax.jit(specjax.step, static_argnums=0)

CONFIGS = {
    "llama-gqa": ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                             num_heads=4, num_kv_heads=2),
    "mistral-window5": ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_layers=2, num_heads=4, num_kv_heads=1, sliding_window=5,
                                   model_type="mistral"),
}


@functools.lru_cache(maxsize=None)
def _model(name: str) -> specjax.Model:
    config = CONFIGS[name]
    return specjax.Model(config, random_params(config, seed=1))


def _shuffled_pool(num_pages: int, page_size: int, seed: int = 0) -> PagePool:
    """A pool whose free list is a random permutation, via the public API only."""
    pool = PagePool(num_pages, page_size)
    for i in range(num_pages):
        pool.allocate(("warm", i), 1)
    for i in np.random.default_rng(seed).permutation(num_pages):
        pool.release(("warm", int(i)))
    assert pool.free_pages == num_pages
    return pool


def _nan_cache(config, table, num_pages, page_size) -> PagedKVCache:
    cache = PagedKVCache.create(config, table, num_pages=num_pages, page_size=page_size)
    return cache.replace(k_pages=jnp.full_like(cache.k_pages, jnp.nan),
                         v_pages=jnp.full_like(cache.v_pages, jnp.nan))


def _last_logits(model, rows: list[list[int]]) -> np.ndarray:
    """Logits after the last token of each row, by one uncached forward over padded rows."""
    width = max(len(r) for r in rows)
    padded = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        padded[i, :len(r)] = r
    logits = np.asarray(specjax.forward(model, padded))  # causal: padding never looks back
    return np.stack([logits[i, len(r) - 1] for i, r in enumerate(rows)])


def _prefill(model, pool, rows: list[list[int]], pages_per_row: int, ids=None):
    """One-shot ragged prefill of `rows` into a fresh NaN cache; returns (logits, cache)."""
    ids = ids or list(range(len(rows)))
    for sid, r in zip(ids, rows):
        pool.allocate(sid, len(r))
    table = pool.page_table(ids, pages_per_row)
    cache = _nan_cache(model.config, table, pool.num_pages, pool.page_size)
    width = max(len(r) for r in rows)
    tokens = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), tokens.shape)
    q_lens = jnp.asarray([len(r) for r in rows], jnp.int32)
    logits, _, cache = STEP(model.config, model.params, cache, jnp.asarray(tokens),
                            jnp.asarray(positions), q_lens=q_lens)
    return np.asarray(logits), cache


@pytest.mark.parametrize("name", CONFIGS)
def test_paged_decode_step_by_step_matches_full_forward(name):
    model = _model(name)
    b, t_len, page_size, m = 3, 13, 4, 4
    tokens = np.random.default_rng(2).integers(0, VOCAB, (b, t_len)).astype(np.int32)
    full = np.asarray(specjax.forward(model, tokens))
    pool = _shuffled_pool(num_pages=16, page_size=page_size)
    cache = None
    for t in range(t_len):
        for row in range(b):  # rows grow in turn, so their pages interleave
            pool.allocate(row, t + 1)
        table = jnp.asarray(pool.page_table(range(b), m))
        if cache is None:
            cache = _nan_cache(model.config, table, pool.num_pages, page_size)
        cache = cache.replace(page_table=table)
        positions = jnp.full((b, 1), t, jnp.int32)
        logits, _, cache = STEP(model.config, model.params, cache,
                                jnp.asarray(tokens[:, t:t + 1]), positions)
        assert max_diff(logits[:, 0], full[:, t]) <= ATOL, f"step {t}"
    np.testing.assert_array_equal(np.asarray(cache.lengths), [t_len] * b)
    assert not all(np.all(np.diff(r) == 1) for r in np.asarray(cache.page_table))


@pytest.fixture(scope="module")
def prefill_case():
    model = _model("llama-gqa")
    tokens = np.random.default_rng(3).integers(0, VOCAB, (2, 13)).astype(np.int32)
    one_shot, cache = _prefill(model, _shuffled_pool(12, 4), [list(r) for r in tokens], 4)
    return model, tokens, one_shot, cache


def test_one_shot_prefill_matches_full_forward(prefill_case):
    model, tokens, one_shot, _ = prefill_case
    assert max_diff(one_shot, specjax.forward(model, tokens)) <= ATOL


@pytest.mark.parametrize("chunk", [1, 3, 8, 16])
def test_chunked_prefill_matches_one_shot(prefill_case, chunk):
    """Page size 4 does not divide length 13; chunk 16 is one chunk padded past the length."""
    model, tokens, one_shot, one_shot_cache = prefill_case
    b, t_len = tokens.shape
    pool = _shuffled_pool(12, 4, seed=chunk)
    for row in range(b):
        pool.allocate(row, t_len)
    cache = _nan_cache(model.config, pool.page_table(range(b), 4), 12, 4)
    got = []
    for start in range(0, t_len, chunk):
        n = min(chunk, t_len - start)
        piece = np.zeros((b, chunk), np.int32)
        piece[:, :n] = tokens[:, start:start + n]
        positions = np.broadcast_to(np.arange(start, start + chunk, dtype=np.int32), (b, chunk))
        logits, _, cache = STEP(model.config, model.params, cache, jnp.asarray(piece),
                                jnp.asarray(positions), q_lens=jnp.full((b,), n, jnp.int32))
        got.append(np.asarray(logits)[:, :n])
    assert max_diff(np.concatenate(got, axis=1), one_shot) <= ATOL
    np.testing.assert_array_equal(np.asarray(cache.lengths), [t_len] * b)
    # Same keys/values at every written slot, and nothing written past the length.
    for row in range(b):
        for which in ("k", "v"):
            got_kv, want_kv = _row_slots(cache, row, which), _row_slots(one_shot_cache, row, which)
            assert np.isnan(got_kv[:, :, t_len:]).all() and np.isnan(want_kv[:, :, t_len:]).all()
            assert max_diff(got_kv[:, :, :t_len], want_kv[:, :, :t_len]) <= ATOL



@pytest.mark.parametrize("name", CONFIGS)
def test_long_chunks_block_by_block_match_full_forward(name):
    """Chunks of 64 tokens (`specjax.attention.BLOCKWISE_MIN_QUERIES`: the reference's
    blockwise form, blocks of 16 four-token pages) over ragged rows of 150 and 97
    tokens: each chunk reads only the blocks up to its end, and its logits equal the
    uncached forward's."""
    from specjax import attention

    model, chunk, lens = _model(name), 64, (150, 97)
    assert chunk >= attention.BLOCKWISE_MIN_QUERIES
    tokens = np.random.default_rng(5).integers(0, VOCAB, (2, max(lens))).astype(np.int32)
    full = np.asarray(specjax.forward(model, tokens))
    pool = _shuffled_pool(120, 4, seed=5)
    for row, n in enumerate(lens):
        pool.allocate(row, n)
    cache = _nan_cache(model.config, pool.page_table(range(2), 60), 120, 4)  # 4 blocks
    for start in range(0, max(lens), chunk):
        q_lens = np.clip(np.asarray(lens) - start, 0, chunk).astype(np.int32)
        piece = np.zeros((2, chunk), np.int32)
        for row, n in enumerate(q_lens):
            piece[row, :n] = tokens[row, start:start + n]
        positions = np.broadcast_to(np.arange(start, start + chunk, dtype=np.int32), (2, chunk))
        logits, _, cache = STEP(model.config, model.params, cache, jnp.asarray(piece),
                                jnp.asarray(positions), q_lens=jnp.asarray(q_lens))
        for row, n in enumerate(q_lens):
            if n:  # a finished row's queries are padding
                assert max_diff(np.asarray(logits)[row, :n], full[row, start:start + n]) <= ATOL


def _row_slots(cache: PagedKVCache, row: int, which: str = "k") -> np.ndarray:
    """A row's KV in slot order: [L, K, M*Z, H]."""
    pages = np.asarray(cache.k_pages if which == "k" else cache.v_pages)
    table = np.asarray(cache.page_table)[row]
    sel = pages[:, :, table]  # [L, K, M, Z, H]
    return sel.reshape(sel.shape[0], sel.shape[1], -1, sel.shape[-1])


def test_ragged_rows_with_q_lens():
    """Rows with different prefixes extend by different counts in one padded call."""
    model = _model("llama-gqa")
    rng = np.random.default_rng(4)
    prefixes = [list(rng.integers(0, VOCAB, n)) for n in (5, 1, 9)]
    news = [list(rng.integers(0, VOCAB, n)) for n in (3, 6, 1)]
    pool = _shuffled_pool(16, 4, seed=4)
    _, cache = _prefill(model, pool, prefixes, pages_per_row=5)
    for row, (p, n) in enumerate(zip(prefixes, news)):
        pool.allocate(row, len(p) + len(n))
    cache = cache.replace(page_table=jnp.asarray(pool.page_table(range(3), 5)))
    width = max(len(n) for n in news)
    tokens = np.zeros((3, width), np.int32)
    positions = np.zeros((3, width), np.int32)
    for row, (p, n) in enumerate(zip(prefixes, news)):
        tokens[row, :len(n)] = n
        positions[row] = len(p) + np.arange(width)
    q_lens = jnp.asarray([len(n) for n in news], jnp.int32)
    logits, _, cache = STEP(model.config, model.params, cache, jnp.asarray(tokens),
                            jnp.asarray(positions), q_lens=q_lens)
    logits = np.asarray(logits)
    assert np.isfinite(logits).all()  # padding queries included
    np.testing.assert_array_equal(np.asarray(cache.lengths), [8, 7, 10])
    want = [p + n[:t + 1] for p, n in zip(prefixes, news) for t in range(len(n))]
    got = [logits[row, t] for row, n in enumerate(news) for t in range(len(n))]
    assert max_diff(np.stack(got), _last_logits(model, want)) <= ATOL


# A small tree written at once: parent of each node (-1 = hangs off the prefix).
TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 4]


def _tree_paths(parents):
    paths = []
    for i in range(len(parents)):
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = parents[j]
        paths.append(path[::-1])
    return paths


@pytest.fixture(scope="module")
def tree_case():
    """Row 0: prefix 7 + the 7-node tree; row 1: prefix 4 + its first 4 nodes (q_lens)."""
    model = _model("llama-gqa")
    rng = np.random.default_rng(5)
    prefixes = [list(rng.integers(0, VOCAB, 7)), list(rng.integers(0, VOCAB, 4))]
    nodes = rng.integers(0, VOCAB, (2, len(TREE_PARENTS))).astype(np.int32)
    sizes = [len(TREE_PARENTS), 4]
    pool = _shuffled_pool(16, 4, seed=5)
    _, cache = _prefill(model, pool, prefixes, pages_per_row=6)
    for row in range(2):
        pool.allocate(row, len(prefixes[row]) + sizes[row] + 1)  # + the token after commit
    cache = cache.replace(page_table=jnp.asarray(pool.page_table(range(2), 6)))
    paths = _tree_paths(TREE_PARENTS)
    n = len(TREE_PARENTS)
    mask = np.zeros((2, n, n), bool)
    positions = np.zeros((2, n), np.int32)
    for i, path in enumerate(paths):
        mask[:, i, path] = True
        positions[:, i] = [len(prefixes[0]) + len(path) - 1, len(prefixes[1]) + len(path) - 1]
    logits, _, cache = STEP(model.config, model.params, cache, jnp.asarray(nodes),
                            jnp.asarray(positions), jnp.asarray(mask),
                            q_lens=jnp.asarray(sizes, jnp.int32))
    return model, prefixes, nodes, sizes, paths, np.asarray(logits), cache


def test_tree_mask_step_matches_causal_forward_of_each_path(tree_case):
    model, prefixes, nodes, sizes, paths, logits, cache = tree_case
    np.testing.assert_array_equal(np.asarray(cache.lengths),
                                  [len(p) + s for p, s in zip(prefixes, sizes)])
    want, got = [], []
    for row in range(2):
        for i in range(sizes[row]):
            want.append(prefixes[row] + [int(nodes[row, j]) for j in paths[i]])
            got.append(logits[row, i])
    assert np.isfinite(logits).all()
    assert max_diff(np.stack(got), _last_logits(model, want)) <= ATOL


def test_move_slots_commits_an_accepted_tree_path(tree_case):
    """Compacting an accepted path's KV after the prefix makes the next decode exact."""
    model, prefixes, nodes, sizes, paths, _, cache = tree_case
    accepted = [paths[6], paths[3]]  # row 0: nodes 0,1,4,6; row 1: nodes 0,1,3
    width = 4
    src = np.zeros((2, width), np.int32)
    dst = np.zeros((2, width), np.int32)
    valid = np.zeros((2, width), bool)
    for row, path in enumerate(accepted):
        p = len(prefixes[row])
        src[row, :len(path)] = p + np.asarray(path)
        dst[row, :len(path)] = p + np.arange(len(path))
        valid[row, :len(path)] = True
    cache = move_slots(cache, jnp.asarray(src), jnp.asarray(dst), jnp.asarray(valid))
    lengths = [len(p) + len(a) for p, a in zip(prefixes, accepted)]
    cache = cache.replace(lengths=jnp.asarray(lengths, jnp.int32))
    nxt = np.asarray([[11], [12]], np.int32)
    logits, _, _ = STEP(model.config, model.params, cache, jnp.asarray(nxt),
                        jnp.asarray(lengths, jnp.int32)[:, None])
    want = [prefixes[row] + [int(nodes[row, j]) for j in accepted[row]] + [int(nxt[row, 0])]
            for row in range(2)]
    assert max_diff(np.asarray(logits)[:, 0], _last_logits(model, want)) <= ATOL


def test_move_slots_moves_exactly_the_valid_slots():
    config = CONFIGS["llama-gqa"]
    rng = np.random.default_rng(6)
    table = np.asarray([[5, 2, 7], [0, 6, 3]], np.int32)
    cache = PagedKVCache.create(config, table, num_pages=8, page_size=4)
    shape = cache.k_pages.shape
    cache = cache.replace(k_pages=jnp.asarray(rng.standard_normal(shape), jnp.float32),
                          v_pages=jnp.asarray(rng.standard_normal(shape), jnp.float32))
    src = np.asarray([[9, 3, 11], [4, 5, 0]], np.int32)
    dst = np.asarray([[2, 4, 5], [1, 2, 7]], np.int32)
    valid = np.asarray([[True, True, False], [True, True, True]])
    moved = move_slots(cache, jnp.asarray(src), jnp.asarray(dst), jnp.asarray(valid))
    for which in ("k", "v"):
        for row in range(2):
            before, after = _row_slots(cache, row, which), _row_slots(moved, row, which)
            want = before.copy()
            for s, d, ok in zip(src[row], dst[row], valid[row]):
                if ok:
                    want[:, :, d] = before[:, :, s]
            np.testing.assert_array_equal(after, want)
    np.testing.assert_array_equal(np.asarray(moved.lengths), np.asarray(cache.lengths))


def test_page_pool_allocate_release():
    pool = PagePool(num_pages=5, page_size=4)
    a = pool.allocate("a", 5)  # 2 pages
    assert len(a) == 2 and pool.free_pages == 3
    assert pool.allocate("a", 8) == a  # still fits
    b = pool.allocate("b", 9)  # 3 pages
    assert len(b) == 3 and not set(a) & set(b) and pool.free_pages == 0
    with pytest.raises(OutOfPagesError) as err:
        pool.allocate("a", 9)
    msg = str(err.value)
    assert "'a'" in msg and "needs 1 more page" in msg and "0 of 5 are free" in msg
    assert isinstance(err.value, ValueError)
    assert pool.allocate("a", 8) == a  # a failed allocation changes nothing
    pool.release("b")
    assert pool.free_pages == 3
    c = pool.allocate("c", 12)
    assert sorted(c) == sorted(b)
    table = pool.page_table(["a", "c", "unknown"], 3)
    np.testing.assert_array_equal(table, [a + [0], c, [0, 0, 0]])
    with pytest.raises(ValueError, match="owns 3 pages > pages_per_row=2"):
        pool.page_table(["c"], 2)
    pool.release("never-allocated")  # a no-op
    assert pool.free_pages == 0


def test_page_pool_per_data_shard():
    """Two data shards: each owns 4 of the 8 pages, named by local ids 0..3; rows 0-1 of
    a 4-row batch live on shard 0 and rows 2-3 on shard 1, as `batch` splits over `data`."""
    pool = PagePool(num_pages=8, page_size=4, num_shards=2)
    assert pool.pages_per_shard == 4
    table = pool.allocate_rows([5, 3, 8, 1], pages_per_row=2)  # pages 2, 1 | 2, 1
    np.testing.assert_array_equal(table, [[0, 1], [2, 0], [0, 1], [2, 0]])
    assert pool.free_pages == 2
    with pytest.raises(OutOfPagesError, match=r"on data shard 1: sequence 3 needs 2 more "
                                              r"page\(s\).*only 1 of 4 are free"):
        pool.allocate(3, 12, shard=1)
    pool.release(2)  # back to shard 1, not shard 0
    assert pool.allocate(9, 12, shard=1) == [0, 1, 3]
    with pytest.raises(OutOfPagesError, match="on data shard 0"):
        pool.allocate(8, 5, shard=0)
    with pytest.raises(ValueError, match="sequence 9 owns pages on data shard 1, not shard=0"):
        pool.allocate(9, 16, shard=0)
    with pytest.raises(ValueError, match="sequence 9 owns pages on data shard 1 but sits in "
                                         "row 0, which data shard 0 holds"):
        pool.page_table([9, 1, 3, 3], 3)
    with pytest.raises(ValueError, match="batch=3 rows do not split over num_shards=2"):
        pool.page_table([0, 1, 3], 2)
    with pytest.raises(ValueError, match=r"shard=2 must be in \[0, num_shards=2\)"):
        pool.allocate("x", 1, shard=2)


@pytest.mark.parametrize("kwargs, match", [({"num_pages": 0, "page_size": 4}, "num_pages=0"),
                                           ({"num_pages": 4, "page_size": 0}, "page_size=0"),
                                           ({"num_pages": 6, "page_size": 4, "num_shards": 4},
                                            "num_pages=6 must be a multiple of num_shards=4")])
def test_page_pool_rejects_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PagePool(**kwargs)
