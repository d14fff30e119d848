"""Draft heads: Medusa/EAGLE modules, the tree builders, vocabulary maps, save/load."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.cache import PagedKVCache
from specjax.config import tiny_llama
from specjax.heads import (
    EagleConfig,
    MedusaConfig,
    build_vocab_map,
    eagle3_layers,
    eagle_logits,
    eagle_step,
    init_eagle_params,
    init_medusa_params,
    load_heads,
    medusa_logits,
    save_heads,
    target_to_draft,
)
from specjax.heads.eagle import layer_config
from specjax.model import module_for
from specjax.models.transformer import Transformer
from specjax.speculators.dynamic_tree import (
    Nodes,
    dynamic_depth_widths,
    dynamic_tree,
    static_tree_expand,
)
from specjax.tree import static_tree

ATOL = 1e-5  # float32
# jitted once per shape: op-by-op eager Flax is far slower on a busy CPU
step = jax.jit(eagle_step, static_argnums=(0, 1))


@pytest.fixture(scope="module")
def target():
    return specjax.init_model(tiny_llama(vocab_size=64), seed=3)


# ---- Medusa -----------------------------------------------------------------------
@pytest.mark.parametrize("tied", [False, True])
def test_untrained_medusa_heads_are_the_targets_next_token_head(tied):
    t = specjax.init_model(tiny_llama(vocab_size=64, tie_word_embeddings=tied), seed=1)
    cfg = MedusaConfig(num_heads=3, num_residual_layers=2)
    params = init_medusa_params(cfg, t.config, t.params)
    h = jax.random.normal(jax.random.key(0), (2, 5, t.config.hidden_size))
    got = jax.jit(medusa_logits, static_argnums=(0, 1))(cfg, t.config, params, h)
    assert got.shape == (2, 5, 3, 64) and got.dtype == jnp.float32
    want = module_for(t.config).apply({"params": t.params}, h, method=Transformer.logits)
    np.testing.assert_allclose(got, jnp.broadcast_to(want[:, :, None], got.shape), atol=ATOL)


def test_medusa_heads_differ_once_their_resblocks_do(target):
    cfg = MedusaConfig(num_heads=2)
    params = init_medusa_params(cfg, target.config, target.params, key=0, init_scale=0.5)
    out = medusa_logits(cfg, target.config, params, jnp.ones((1, 1, target.config.hidden_size)))
    assert not np.allclose(out[0, 0, 0], out[0, 0, 1])


# ---- EAGLE: the head over a paged cache is the plain forward ------------------------
def _eagle(version, target):
    cfg = EagleConfig(version, draft_vocab_size=40 if version == 3 else None)
    return cfg.resolved(target.config)


def _cache(target, b, slots=64, page_size=8):
    m = slots // page_size
    table = np.random.default_rng(0).permutation(b * m).reshape(b, m)  # shuffled pages
    return PagedKVCache.create(layer_config(target.config), table, num_pages=b * m,
                               page_size=page_size)


@pytest.mark.parametrize("version", [1, 3])
def test_eagle_step_in_ragged_chunks_equals_one_uncached_forward(target, version):
    cfg = _eagle(version, target)
    params = init_eagle_params(cfg, target.config, 1)
    b, t, d = 2, 12, target.config.hidden_size
    k1, k2 = jax.random.split(jax.random.key(2))
    tokens = jax.random.randint(k1, (b, t), 0, 64)
    feats = jax.random.normal(k2, (b, t, d))
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    want, _ = step(cfg, target.config, params, target.params, None, tokens, feats, pos)
    cache = _cache(target, b)
    cut = np.array([4, 6])  # ragged first chunk, then the next 6 pairs of each row
    out1, cache = step(cfg, target.config, params, target.params, cache, tokens[:, :6],
                       feats[:, :6], pos[:, :6], q_lens=jnp.asarray(cut))
    rest = np.stack([np.arange(c, c + 6) for c in cut])
    take = lambda x: jnp.take_along_axis(
        x, jnp.asarray(rest).reshape(b, 6, *([1] * (x.ndim - 2))), 1)
    out2, cache = step(cfg, target.config, params, target.params, cache, take(tokens),
                       take(feats), take(pos))
    np.testing.assert_array_equal(cache.lengths, cut + 6)
    for r in range(b):
        np.testing.assert_allclose(out1[r, :cut[r]], want[r, :cut[r]], atol=ATOL)
        np.testing.assert_allclose(out2[r], want[r, rest[r]], atol=ATOL)
    logits = eagle_logits(cfg, target.config, params, target.params, want)
    assert logits.shape == (b, t, 64 if version == 1 else 40)


def test_eagle_tree_nodes_see_only_their_ancestors(target):
    cfg = _eagle(1, target)
    params = init_eagle_params(cfg, target.config, 4)
    d = target.config.hidden_size
    prefix = 6
    parents = np.array([-1, -1, 0, 0, 1, 2])  # two branches, depth up to 3
    _, depth = _depths(parents)
    rng = np.random.default_rng(1)
    ptok, ntok = rng.integers(0, 64, prefix), rng.integers(0, 64, len(parents))
    pfeat, nfeat = rng.normal(size=(prefix, d)), rng.normal(size=(len(parents), d))
    cache = _cache(target, 1)
    _, cache = step(cfg, target.config, params, target.params, cache,
                          jnp.asarray(ptok)[None], jnp.asarray(pfeat, jnp.float32)[None],
                          jnp.arange(prefix)[None])
    nodes = Nodes(jnp.asarray(ntok)[None], jnp.asarray(parents)[None], jnp.asarray(depth)[None],
                  jnp.int32(len(parents)), jnp.arange(1), int(depth.max()))
    out, _ = step(cfg, target.config, params, target.params, cache, nodes.tokens,
                        jnp.asarray(nfeat, jnp.float32)[None], prefix - 1 + nodes.depth,
                        mask=nodes.mask)
    width = prefix + int(depth.max())  # one padded shape: causal, so padding is inert
    for i in range(len(parents)):
        path = _path(parents, i)
        toks = np.zeros(width, np.int32)
        feats = np.zeros((width, d), np.float32)
        n = prefix + len(path)
        toks[:n] = np.concatenate([ptok, ntok[path]])
        feats[:n] = np.concatenate([pfeat, nfeat[path]])
        want, _ = step(cfg, target.config, params, target.params, None, jnp.asarray(toks)[None],
                       jnp.asarray(feats)[None], jnp.arange(width)[None])
        np.testing.assert_allclose(out[0, i], want[0, n - 1], atol=ATOL)


def _path(parents, i):
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def _depths(parents):
    depth = np.array([len(_path(parents, i)) for i in range(len(parents))])
    return parents, depth


def test_eagle3_layers_and_config_checks():
    assert eagle3_layers(32) == (1, 15, 28)
    assert eagle3_layers(2) == (1, 0, 0)  # clamped for tiny models
    cfg = tiny_llama(vocab_size=64)
    assert EagleConfig(3).resolved(cfg) == EagleConfig(3, (1, 0, 0), 64)
    with pytest.raises(ValueError, match="version=2"):
        EagleConfig(2)
    with pytest.raises(ValueError, match="outside"):
        EagleConfig(3, (0, 1, 5)).check(cfg)
    with pytest.raises(ValueError, match="draft_vocab_size=100"):
        EagleConfig(3, draft_vocab_size=100).check(cfg)
    with pytest.raises(ValueError, match="EAGLE-3 settings"):
        EagleConfig(1, draft_vocab_size=10)


# ---- EAGLE-3 vocabulary map -------------------------------------------------------
def test_build_vocab_map_keeps_the_most_frequent_ids_in_id_order():
    counts = np.array([5, 0, 9, 9, 1, 7, 0, 2])
    d2t = build_vocab_map(counts, 4)
    np.testing.assert_array_equal(d2t, [0, 2, 3, 5])
    assert d2t.dtype == np.int32
    np.testing.assert_array_equal(build_vocab_map(np.zeros(5), 2), [0, 1])  # ties: low ids
    t2d = target_to_draft(d2t, 8)
    np.testing.assert_array_equal(t2d, [0, -1, 1, 2, -1, 3, -1, -1])
    np.testing.assert_array_equal(d2t[t2d[d2t]], d2t)
    with pytest.raises(ValueError, match="draft_vocab_size=9"):
        build_vocab_map(counts, 9)


# ---- tree builders ----------------------------------------------------------------
V = 12


def _table_expand(table):
    """A stand-in draft: the children's log-probs of a node depend on its token only."""
    def expand(carry, nodes):
        q = jnp.take(nodes.tokens, nodes.query, axis=1)  # [B, Q]
        return jnp.asarray(table)[q], carry + 1
    return expand


def _reference_eagle2(first, table, k, depth, n, vocab_map):
    """Plain-Python EAGLE-2 selection: the same candidates, ranks and tie order."""
    to_tok = (lambda i: int(i)) if vocab_map is None else (lambda i: int(vocab_map[i]))
    order = lambda lp: sorted(range(len(lp)), key=lambda i: (-lp[i], i))[:k]
    cands = [(first[i], to_tok(i), -1, 1) for i in order(first)]  # (score, token, parent, d)
    beam = list(range(k))
    for d in range(2, depth + 1):
        new = []
        for c in beam:
            s, tok = cands[c][0], cands[c][1]
            lp = table[tok]
            new += [(s + lp[i], to_tok(i), c, d) for i in order(lp)]
        base = len(cands)
        cands += new
        top = sorted(range(len(new)), key=lambda i: (-new[i][0], i))[:k]
        beam = [base + i for i in top]
    best = sorted(sorted(range(len(cands)), key=lambda i: (-cands[i][0], i))[:n])
    where = {c: j for j, c in enumerate(best)}
    return ([cands[c][1] for c in best], [where[cands[c][2]] if cands[c][2] >= 0 else -1
                                           for c in best], [cands[c][3] for c in best])


@pytest.mark.parametrize("k,depth,n,mapped", [(3, 3, 7, False), (2, 4, 8, True),
                                              (1, 3, 3, False)])
def test_dynamic_tree_is_eagle2s_selection(k, depth, n, mapped):
    rng = np.random.default_rng(k + depth)
    table = np.asarray(jax.nn.log_softmax(rng.normal(size=(64, V)) * 2), np.float32)
    first = np.asarray(jax.nn.log_softmax(rng.normal(size=(2, V)) * 2), np.float32)
    vocab_map = np.sort(rng.choice(64, V, replace=False)).astype(np.int32) if mapped else None
    if not mapped:
        table = table[:V]
    tree, calls = dynamic_tree(jnp.asarray(first), _table_expand(table), 0, top_k=k, depth=depth,
                               total_tokens=n, vocab_map=None if vocab_map is None
                               else jnp.asarray(vocab_map))
    assert int(calls) == depth - 1 and tree.max_depth == depth and tree.draft_probs is None
    assert bool(jnp.all(tree.valid))
    for r in range(2):
        toks, parents, depths = _reference_eagle2(first[r], table, k, depth, n, vocab_map)
        np.testing.assert_array_equal(tree.tokens[r], toks)
        np.testing.assert_array_equal(tree.parents[r], parents)
        np.testing.assert_array_equal(tree.depth[r], depths)
        par = np.asarray(tree.parents[r])
        assert all(p < i for i, p in enumerate(par))  # topological
        dep = np.asarray(tree.depth[r])
        assert all(dep[i] == (1 if p < 0 else dep[p] + 1) for i, p in enumerate(par))
        # the loop verifies only the first W[d] nodes when no kept node is deeper than d
        widths = dynamic_depth_widths(k, depth, n)
        for d in range(1, depth + 1):
            assert np.all(np.flatnonzero(dep <= d) < widths[d]), (d, dep, widths)
    assert widths[0] == 0 and widths[-1] == n and list(widths) == sorted(widths)


def test_dynamic_tree_stops_expanding_at_levels():
    table = np.asarray(jax.nn.log_softmax(np.random.default_rng(0).normal(size=(V, V))))
    first = jnp.asarray(table[:1])
    tree, calls = dynamic_tree(first, _table_expand(table), 0, top_k=2, depth=4,
                               total_tokens=6, levels=jnp.int32(2))
    assert int(calls) == 1  # only depth 2 was expanded
    valid = np.asarray(tree.valid[0])
    assert np.all(np.asarray(tree.depth[0])[valid] <= 2) and valid.sum() == 6


def test_static_tree_expand_picks_the_cth_child_of_each_parent():
    paths = [[0], [1], [0, 0], [0, 2], [1, 1], [0, 2, 0]]
    parents, depth, choice = static_tree(paths)
    table = np.asarray(jax.nn.log_softmax(np.random.default_rng(5).normal(size=(V, V))))
    first = jnp.asarray(table[3:5])
    tree, calls = static_tree_expand(first, _table_expand(table), 0, parents, depth, choice)
    assert int(calls) == 2
    for r in range(2):
        rank = lambda lp: np.argsort(-lp, kind="stable")
        toks = np.asarray(tree.tokens[r])
        for i, (p, c) in enumerate(zip(parents, choice)):
            lp = np.asarray(first[r]) if p < 0 else table[toks[p]]
            assert toks[i] == rank(lp)[c]


# ---- save / load ------------------------------------------------------------------
def test_heads_round_trip_and_refuse_another_target(tmp_path, target):
    mcfg = MedusaConfig(num_heads=2)
    mparams = init_medusa_params(mcfg, target.config, target.params, 0, 0.1)
    save_heads(tmp_path / "medusa", "medusa", mcfg, mparams, target.config)
    ecfg = EagleConfig(3, draft_vocab_size=16).resolved(target.config)
    eparams = init_eagle_params(ecfg, target.config, 0)
    d2t = build_vocab_map(np.arange(64)[::-1], 16)
    save_heads(tmp_path / "eagle", "eagle", ecfg, eparams, target.config, vocab_map=d2t)

    m = load_heads(tmp_path / "medusa", target.config)
    assert m.kind == "medusa" and m.config == mcfg and m.vocab_map is None
    jax.tree.map(np.testing.assert_array_equal, m.params, mparams)
    e = load_heads(tmp_path / "eagle", target.config, kind="eagle")
    assert e.config == ecfg
    np.testing.assert_array_equal(e.vocab_map, d2t)
    jax.tree.map(np.testing.assert_array_equal, e.params, eparams)

    other = tiny_llama(vocab_size=64, hidden_size=32)
    with pytest.raises(ValueError, match=r"another target: hidden_size=64 \(target has 32\)"):
        load_heads(tmp_path / "eagle", other)
    with pytest.raises(ValueError, match="'eagle' heads, not 'medusa'"):
        load_heads(tmp_path / "eagle", target.config, kind="medusa")
    with pytest.raises(ValueError, match="no saved heads"):
        load_heads(tmp_path, target.config)
    with pytest.raises(ValueError, match="MedusaConfig"):
        save_heads(tmp_path / "x", "medusa", ecfg, eparams, target.config)


def test_eagle_config_records_the_norm_flags_only_when_set():
    """A config without the EAGLE 3.1 norm flags records as configs did before they
    existed (old runs and heads.json compare equal), one with a flag records it, and
    both read back to the same config."""
    plain = EagleConfig(version=3, draft_vocab_size=64)
    assert plain.record() == {"version": 3, "hidden_layers": (), "draft_vocab_size": 64}
    flagged = EagleConfig(version=3, draft_vocab_size=64, norm_before_residual=True)
    assert flagged.record()["norm_before_residual"] is True
    assert "fc_norm" not in flagged.record()
    for cfg in (plain, flagged):
        assert EagleConfig(**cfg.record()) == cfg
