"""Medusa, EAGLE (1/2/3) and DraftModel tree mode inside generation: lossless greedy,
the target's distribution when sampling, the pairs protocol, save/load, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.config import tiny_llama
from specjax.heads import eagle_logits, eagle_step
from specjax.heads.eagle import fuse_features, target_features
from specjax.models.transformer import Hidden
from specjax.sampling import Sampling, probs
from specjax.speculators import DraftModel, Eagle, Medusa
from specjax.speculators.base import CommitContext, PrefillChunk, ProposeContext
from tests.conftest import PROMPTS, slow_cases
from tests.stat_utils import assert_same_distribution

SMALL_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


@pytest.fixture(scope="module")
def greedy_ref(tiny_target):
    return specjax.generate(tiny_target, PROMPTS, max_new_tokens=16, ignore_eos=True).tokens


@pytest.fixture(scope="module")
def greedy_ref_40(tiny_target):
    """40 tokens: long enough for probes (test_no_call_while_no_row_drafts_stays_lossless)."""
    return specjax.generate(tiny_target, PROMPTS, max_new_tokens=40, ignore_eos=True).tokens


def _make(name, target):
    return {
        "medusa": lambda: Medusa.random(target, num_heads=3, tree=SMALL_TREE),
        "eagle1": lambda: Eagle.random(target, version=1, tree=SMALL_TREE),
        "eagle2": lambda: Eagle.random(target, top_k=3, depth=3, total_tokens=8),
        "eagle3": lambda: Eagle.random(target, version=3, draft_vocab_size=48, top_k=2, depth=3,
                                       total_tokens=6),
        "draft_tree": lambda: DraftModel.create(_noisy_copy(target), k=3, tree_top_k=2,
                                                total_tokens=6),
    }[name]()


def _noisy_copy(model, scale=0.05, seed=7):
    """A draft that mostly agrees with `model`: some drafts accepted, some not."""
    leaves, tree = jax.tree.flatten(model.params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [x + scale * jnp.std(x) * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    return specjax.Model(model.config, jax.tree.unflatten(tree, noisy))


SPECS = ["medusa", "eagle1", "eagle2", "eagle3", "draft_tree"]


# eagle1 (EAGLE-1's static tree) runs with -m slow: its tree is verified by default in
# test_ragged_batch_samples_the_target[eagle1_top_k], greedy trees in the other cases;
# eagle2 (EAGLE-2's dynamic tree) too: eagle3 builds the same dynamic tree, and eagle2's
# is verified by default in test_sampled_output_has_the_target_distribution[eagle2]
@pytest.mark.parametrize("name", slow_cases(SPECS, {"eagle1", "eagle2"}))
def test_greedy_is_lossless_on_a_ragged_batch(tiny_target, greedy_ref_40, name):
    # 40 tokens: eagle3's loop is test_no_call_while_no_row_drafts_stays_lossless's
    # (adaptive and the cost model are traced)
    spec = _make(name, tiny_target)
    out = specjax.generate(tiny_target, PROMPTS, max_new_tokens=40, ignore_eos=True,
                           speculator=spec, adaptive=False)
    assert out.tokens == greedy_ref_40
    st = out.stats
    assert st.draft_calls == st.target_calls * spec.cost.calls_per_step
    if name in ("medusa", "draft_tree"):
        assert st.accepted > 0  # accepted runs went through commit


# a tree decoding one row: Medusa's by default (no other default test checks a tree's
# output at batch 1), the other speculators' trees with -m slow
@pytest.mark.parametrize("name", slow_cases(["medusa", "eagle1", "eagle2", "eagle3",
                                             "draft_tree"],
                                            {"eagle1", "eagle2", "eagle3", "draft_tree"}))
def test_greedy_is_lossless_for_one_prompt(tiny_target, greedy_ref, name):
    out = specjax.generate(tiny_target, PROMPTS[1:2], max_new_tokens=16, ignore_eos=True,
                           speculator=_make(name, tiny_target), adaptive=False)
    assert out.tokens == greedy_ref[1:2]


@pytest.mark.slow
@pytest.mark.parametrize("name", SPECS)
def test_greedy_is_lossless_with_adaptive_depth(tiny_target, greedy_ref, name):
    out = specjax.generate(tiny_target, PROMPTS, max_new_tokens=16, ignore_eos=True,
                           speculator=_make(name, tiny_target), adaptive=True)
    assert out.tokens == greedy_ref


def _same_run(a, b):
    assert a.tokens == b.tokens
    for f in ("new_tokens", "target_calls", "draft_calls", "drafted", "accepted",
              "accepted_hist"):
        assert getattr(a.stats, f) == getattr(b.stats, f), f


@pytest.mark.slow  # both paths are lossless by default: the chain's and the trees' tests
def test_a_one_branch_tree_is_the_chain(tiny_target, greedy_ref):
    draft = _noisy_copy(tiny_target, scale=0.3)
    run = lambda spec: specjax.generate(tiny_target, PROMPTS, max_new_tokens=16,
                                        ignore_eos=True, speculator=spec, adaptive=False)
    chain = run(DraftModel.create(draft, k=4))
    tree = run(DraftModel.create(draft, k=4, tree_top_k=1))
    _same_run(chain, tree)
    assert chain.tokens == greedy_ref
    assert 0 < chain.stats.accepted < chain.stats.drafted  # both accepts and rejections


@pytest.mark.slow
def test_eagle_one_branch_static_tree_is_the_top1_dynamic_tree(tiny_target):
    head = Eagle.random(tiny_target, top_k=1, depth=3, total_tokens=3)
    static = Eagle.create(head.params, head.config, target=tiny_target,
                          tree=[[0], [0, 0], [0, 0, 0]])
    run = lambda spec: specjax.generate(tiny_target, PROMPTS, max_new_tokens=16,
                                        ignore_eos=True, speculator=spec, adaptive=False)
    _same_run(run(head), run(static))


# ---- the pairs protocol, white-box: proposals equal a from-scratch head run ----------
def test_eagle_state_after_commits_matches_a_fresh_run_of_the_head(tiny_target):
    """Prefill, commit, propose, a commit that keeps 3 pairs, propose: the tree must be
    what the head proposes when run uncached over all pairs with the target's features."""
    t = tiny_target
    spec = Eagle.random(t, version=3, draft_vocab_size=64, tree=[[0], [1], [0, 0], [1, 1]],
                        page_size=4)
    seq = np.random.default_rng(0).integers(0, 128, 16)
    n = 15  # pairs (x_i, x_{i+1}) for i < 15
    _, hidden = specjax.model._forward(t.config, t.params, jnp.asarray(seq)[None],
                                       spec.hidden_layers)
    tok = jnp.asarray(seq)[None]
    pos = jnp.arange(16)[None]
    one = jnp.ones((1,), jnp.int32)
    hid = lambda a, b: Hidden(hidden.final[:, a:b], tuple(x[:, a:b] for x in hidden.layers))
    sampling = Sampling.create()

    st = spec.init(t.config, 1, 32)
    p = 6  # prompt of 6: 5 pairs in prefill, pair 5 in the prefill commit
    st = jax.jit(spec.prefill)(st, PrefillChunk(tok[:, :8], tok[:, 1:9], pos[:, :8], 5 * one,
                                                hid(0, 8)), t.params)
    jcommit, jpropose = jax.jit(spec.commit), jax.jit(spec.propose)
    commit = lambda st, a, b, lengths: jcommit(st, CommitContext(
        tok[:, a:b], tok[:, a + 1:b + 1], pos[:, a:b], (b - a) * one, hid(a, b),
        (b - a - 1) * one, lengths * one), t.params)
    propose = lambda st, lengths: jpropose(st, ProposeContext(
        tok, lengths * one, jnp.ones((1,), bool), sampling, jax.random.key(0),
        jnp.full((1,), spec.shape.max_depth, jnp.int32)), t.params)
    st = commit(st, p - 1, p, p + 1)  # root = x_6
    _, st = propose(st, p + 1)  # drafts written into the head cache, to be rolled back
    st = commit(st, p, p + 3, p + 4)  # kept inputs 6, 7, 8; root = x_9
    tree, st = propose(st, p + 4)

    # reference: the head over pairs 0..8 uncached, then each node on its path
    feats = fuse_features(spec.config, t.config, spec.params,
                          target_features(spec.config, hidden, spec._layer_index))[0, :n]
    step = jax.jit(lambda toks, fs: eagle_step(spec.config, t.config, spec.params, t.params,
                                                None, toks[None], fs[None],
                                                jnp.arange(12)[None])[0][0])

    def run(toks, fs):  # one padded shape of 12: causal, so padding is inert
        n = len(toks)
        out = step(jnp.zeros(12, jnp.int32).at[:n].set(jnp.asarray(toks)),
                   jnp.zeros((12, fs.shape[1])).at[:n].set(fs))
        return out[n - 1]

    top = lambda out: np.argsort(-np.asarray(eagle_logits(spec.config, t.config, spec.params,
                                                          t.params, out)), kind="stable")
    r = p + 4 - 1  # root position 9; pairs 0..8
    base_t, base_f = seq[1:r + 1], feats[:r]
    root_out = run(base_t, base_f)
    d2t = np.asarray(spec.d2t)
    kids = d2t[top(root_out)[:2]]
    want = list(kids)
    for c in range(2):  # [0, 0] and [1, 1]: child c's c-th child
        out = run(np.append(base_t, kids[c]), jnp.concatenate([base_f, root_out[None]]))
        want.append(d2t[top(out)[c]])
    np.testing.assert_array_equal(tree.tokens[0], want)


# ---- sampling: the output distribution is the target's -------------------------------
VOCAB = 16


@pytest.fixture(scope="module")
def peaked_target():
    m = specjax.init_model(tiny_llama(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_heads=2, num_kv_heads=1), seed=10)
    m.params["lm_head"]["kernel"] = m.params["lm_head"]["kernel"] * 30.0
    return m


def _exact_joint3(model, prompt, sampling):
    """p(x1, x2, x3) [V, V, V] of the target's first three sampled tokens, from one
    forward over all V**2 continuations x1 x2."""
    v = model.config.vocab_size
    pairs = np.stack(np.meshgrid(np.arange(v), np.arange(v), indexing="ij"), -1).reshape(-1, 2)
    seqs = np.concatenate([np.tile(prompt, (v * v, 1)), pairs], axis=1)
    lp = np.asarray(probs(specjax.forward(model, seqs)[:, -3:], sampling), np.float64)
    p1 = lp[0, 0]  # [V]
    p2 = lp[::v, 1]  # [V, V]: rows x1
    p3 = lp[:, 2].reshape(v, v, v)
    return p1[:, None, None] * p2[:, :, None] * p3


# medusa runs with -m slow: a tree of fixed top-k proposals is verified the same way as
# EAGLE-2's, and sampled trees run by default in test_ragged_batch_samples_the_target
@pytest.mark.parametrize("name", slow_cases(["eagle2", "medusa"], {"medusa"}))
def test_sampled_output_has_the_target_distribution(peaked_target, name):
    t = peaked_target
    spec = (Eagle.random(t, top_k=3, depth=2, total_tokens=6) if name == "eagle2"
            else Medusa.random(t, num_heads=2, tree=[[0], [1], [2], [0, 0], [1, 0]]))
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.9)):
        out = specjax.generate(t, [prompt] * 3000, max_new_tokens=3, ignore_eos=True,
                               temperature=temperature, top_p=top_p, seed=1, speculator=spec,
                               adaptive=False)
        assert out.stats.accepted > 0  # speculation really happened
        joint = _exact_joint3(t, prompt, Sampling.create(temperature, 0, top_p))
        first_two = joint.sum(axis=2)  # p(x1, x2)
        speculated = joint.sum(axis=0)  # p(x2, x3): drafted and verified in one step
        for m, cut in ((first_two, slice(0, 2)), (speculated, slice(1, 3))):
            exact = {x: float(m[x]) for x in np.ndindex(m.shape) if m[x] > 0}
            assert_same_distribution([tuple(s[cut]) for s in out.tokens], exact)


@pytest.mark.slow
def test_typical_acceptance_is_an_option_for_medusa(tiny_target, greedy_ref):
    spec = Medusa.random(tiny_target, num_heads=3, tree=SMALL_TREE, verification="typical")
    greedy = specjax.generate(tiny_target, PROMPTS, max_new_tokens=16, ignore_eos=True,
                              speculator=spec, adaptive=False)
    assert greedy.tokens == greedy_ref  # typical is only for sampled decoding
    sampled = specjax.generate(tiny_target, PROMPTS, max_new_tokens=16, ignore_eos=True,
                               temperature=1.0, speculator=spec, adaptive=False)
    assert all(len(r) == 16 for r in sampled.tokens)


# ---- save / load, errors -------------------------------------------------------------
@pytest.mark.parametrize("name", ["medusa", "eagle3"])
def test_saved_heads_load_into_a_speculator_that_generates_the_same(
        tmp_path, tiny_target, greedy_ref, name):
    spec = _make(name, tiny_target)
    spec.save(tmp_path)
    if name == "medusa":
        loaded = Medusa.load(tmp_path, target=tiny_target, tree=SMALL_TREE)
    else:
        loaded = Eagle.load(tmp_path, target=tiny_target, top_k=2, depth=3, total_tokens=6)
        np.testing.assert_array_equal(loaded.d2t, spec.d2t)
    assert loaded.config == spec.config
    jax.tree.map(np.testing.assert_array_equal, loaded.params, spec.params)
    out = specjax.generate(tiny_target, PROMPTS, max_new_tokens=16, ignore_eos=True,
                           speculator=loaded, adaptive=False)  # compiled with the original
    assert out.tokens == greedy_ref


def test_heads_for_another_target_are_refused(tmp_path, tiny_target):
    # another target: different vocabulary (params cut from tiny_target's; no init)
    cut = lambda x: x[:100] if x.shape[0] == 128 else x[:, :100] if x.shape[-1] == 128 else x
    other = specjax.Model(tiny_target.config.replace(vocab_size=100),
                          jax.tree.map(cut, tiny_target.params))
    Medusa.random(other, num_heads=2, tree=[[0], [0, 0]]).save(tmp_path / "m")
    with pytest.raises(ValueError, match=r"vocab_size=100 \(target has 128\)"):
        Medusa.load(tmp_path / "m", target=tiny_target)
    spec = Eagle.random(other, top_k=2, depth=2, total_tokens=3)
    with pytest.raises(ValueError, match="vocab_size=100"):
        specjax.generate(tiny_target, PROMPTS, max_new_tokens=4, speculator=spec)
    with pytest.raises(ValueError, match="'medusa' heads, not 'eagle'"):
        Eagle.load(tmp_path / "m", target=other)


@pytest.mark.parametrize("make,match", [
    (lambda t: Medusa.random(t, num_heads=2, tree=[[0], [0, 0], [0, 0, 0]]), "exceeds the 2"),
    (lambda t: Medusa.random(t, tree=[[0, 1]]), "no parent"),
    (lambda t: Medusa.random(t, verification="fast"), "verification='fast'"),
    (lambda t: Eagle.random(t, top_k=2, depth=3, total_tokens=20), "total_tokens"),
    (lambda t: Eagle.random(t, version=3, draft_vocab_size=4, top_k=5, depth=2,
                            total_tokens=5), "top-5"),
    (lambda t: Eagle.random(t, version=1, vocab_map=np.arange(8)), "EAGLE-3"),
    (lambda t: DraftModel.create(t, k=2, tree_top_k=2, total_tokens=9), "total_tokens"),
    (lambda t: Medusa.create({}, None, target=t), "MedusaConfig"),
])
def test_bad_settings_are_named(tiny_target, make, match):
    with pytest.raises(ValueError, match=match):
        make(tiny_target)


# eagle2 runs with -m slow: EAGLE-3 skips its head's call the same way (one `Eagle`);
# draft_tree too: a draft model's chain skips its call the same way (one `DraftModel`) by
# default in test_speculative.py::test_draft_skips_its_call_while_no_row_drafts
@pytest.mark.parametrize("name", slow_cases(["eagle2", "eagle3", "draft_tree"],
                                            {"eagle2", "draft_tree"}))
def test_no_call_while_no_row_drafts_stays_lossless(tiny_target, greedy_ref_40, name):
    """Verification priced so that these depth-3 drafts stay off under the prior but
    accepted probes could turn them on (so probes run): rows draft only on probe
    steps, the head or draft skips its call in between and its queue grows (forced
    calls when full); the output is still target-only greedy, and the probes draft."""
    from tests.conftest import flat_verify_cost

    # for the batch's slowest row (`slowest_row_acceptance`), E(3) = 1.93 at the prior
    # and 2.64 after four accepted probes: a verify at 2.4 steps
    out = specjax.generate(tiny_target, PROMPTS, max_new_tokens=40, ignore_eos=True,
                           speculator=_make(name, tiny_target), cost_ratio=0.0,
                           verify_cost=flat_verify_cost(2.4))
    assert out.tokens == greedy_ref_40 and out.stats.drafted > 0
    assert out.stats.mean_k < 0.5  # mostly plain steps: drafts on probes only


@pytest.mark.parametrize("name", ["medusa", "eagle2", "draft_tree"])
def test_measured_cost_ratio_times_each_speculators_propose(tiny_target, name):
    """`measured_cost_ratio` runs any speculator's full-depth propose as generate lays it
    out (decode params, `for_decoding`) after a prompt; n-gram makes no draft calls."""
    from specjax.calibrate import draft_cost_ratios, measured_cost_ratio
    from specjax.speculators import NGram

    c = measured_cost_ratio(tiny_target, _make(name, tiny_target), context=20, repeats=2,
                            temperature=1.0 if name == "draft_tree" else 0.0)
    assert np.isfinite(c) and c > 0
    if name == "draft_tree":  # both temperatures from one compiled propose
        from specjax.calibrate import draft_cost
        compiled = []
        real = draft_cost.compile_decode
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(draft_cost, "compile_decode",
                       lambda lowered: compiled.append(lowered) or real(lowered))
            both = draft_cost_ratios(tiny_target, _make(name, tiny_target), (0.0, 1.0),
                                     context=20, repeats=2)
        assert set(both) == {0.0, 1.0} and all(np.isfinite(v) and v > 0 for v in both.values())
        assert len(compiled) == 2  # the propose and the target step, whatever the temperatures
    if name == "eagle2":  # over several rows (the tree's top-k and reranking per row)
        c3 = measured_cost_ratio(tiny_target, _make(name, tiny_target), context=20,
                                 repeats=2, batch=3)
        assert np.isfinite(c3) and c3 > 0
    assert measured_cost_ratio(tiny_target, NGram(k=3)) == 0.0


def test_measured_cost_ratios_time_greedy_and_sampled_drafts_apart(tiny_target, monkeypatch):
    """c per temperature: sampling costs a draft more than argmax, and every T > 0 runs
    the same sampling code, so one greedy and one sampled measurement serve them all."""
    from specjax import calibrate
    from specjax.calibrate import draft_cost
    from specjax.speculators import NGram

    calls = []
    monkeypatch.setattr(draft_cost, "draft_cost_ratios", lambda target, spec, temperatures, batch: (
        calls.append((spec.k, temperatures, batch)) or {t: spec.k + t for t in temperatures}))
    specs = {"autoregressive": None, "a": NGram(k=2), "b": NGram(k=3)}
    got = calibrate.measured_cost_ratios(tiny_target, specs, temperatures=(0.7, 0.0, 1.0))
    # one measurement per speculator, greedy and the first sampled temperature in it
    assert sorted(calls) == [(2, (0.0, 0.7), 1), (3, (0.0, 0.7), 1)]
    assert got == {0.0: {"a": 2.0, "b": 3.0}, 0.7: {"a": 2.7, "b": 3.7},
                   1.0: {"a": 2.7, "b": 3.7}}


# ---- end to end, ragged: each tree speculator, top-k, and the adaptive rule's probes ------
@pytest.fixture(scope="module")
def shallow_target():
    """Like `peaked_target`, one layer: five more generate programs compile on it."""
    m = specjax.init_model(tiny_llama(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_heads=2, num_kv_heads=1, num_layers=1), seed=10)
    m.params["lm_head"]["kernel"] = m.params["lm_head"]["kernel"] * 30.0
    return m


D2T = np.asarray([15, 3, 7, 0, 9, 12, 5, 1])  # EAGLE-3's reduced vocabulary, not a prefix
E2E = {  # speculator, sampling settings
    "draft_tree": (lambda t: DraftModel.create(_noisy_copy(t, 0.3), k=2, tree_top_k=2,
                                               total_tokens=4), dict(temperature=1.0)),
    "eagle1_top_k": (lambda t: Eagle.random(t, version=1, tree=[[0], [1], [0, 0]]),
                     dict(temperature=0.8, top_k=5)),
    "eagle3_d2t": (lambda t: Eagle.random(t, version=3, draft_vocab_size=8, vocab_map=D2T,
                                          top_k=2, depth=2, total_tokens=4),
                   dict(temperature=1.0)),
    "adaptive_probes": (lambda t: DraftModel.create(_noisy_copy(t, 0.3), k=2),
                        dict(temperature=0.7, top_p=0.9)),
}


# draft_tree runs with -m slow: a draft model's tree is verified greedy by default
# (test_greedy_is_lossless_on_a_ragged_batch[draft_tree]) and trees sample here by default
# through EAGLE-1's and EAGLE-3's
@pytest.mark.parametrize("name", slow_cases(list(E2E), {"draft_tree"}))
def test_ragged_batch_samples_the_target(shallow_target, name):
    """Two prompts of different lengths interleaved over 3000 rows: for each, the joint
    of tokens (1, 2) and of (2, 3) (drafted and verified within one step) is the
    target's exact one. `adaptive_probes`: the adaptive rule with a prior of 0 keeps
    rows at k = 0, and probes (every step here) draft depth 1 to re-measure."""
    from specjax.decoding.cost import VerifyCost

    t = shallow_target
    make, samp = E2E[name]
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 9, 2]]
    kw = dict(adaptive=False)
    if name == "adaptive_probes":
        kw = dict(adaptive=True, acceptance_prior=[0.0, 0.0], verify_cost=VerifyCost(),
                  cost_ratio=0.0, probe_gap=1)
    out = specjax.generate(t, prompts * 1500, max_new_tokens=3, ignore_eos=True, seed=2,
                           speculator=make(t), **samp, **kw)
    if name == "adaptive_probes":
        assert 0 < out.stats.drafted < 2 * out.stats.target_calls  # probes: depth 1
    assert out.stats.accepted > 0  # speculation really happened
    for i, prompt in enumerate(prompts):
        joint = _exact_joint3(t, prompt, Sampling.create(samp["temperature"],
                                                         samp.get("top_k", 0),
                                                         samp.get("top_p", 1.0)))
        rows = out.tokens[i::2]
        for m, cut in ((joint.sum(axis=2), slice(0, 2)), (joint.sum(axis=0), slice(1, 3))):
            exact = {x: float(m[x]) for x in np.ndindex(m.shape) if m[x] > 0}
            assert_same_distribution([tuple(s[cut]) for s in rows], exact)


@pytest.mark.parametrize("name", ["medusa", "eagle1", "draft_chain"])
def test_nodes_past_the_deepest_kept_depth_are_marked_invalid(tiny_target, name):
    """A speculator that stops drafting at `ProposeContext.levels` marks the nodes it
    left undrafted invalid (the loop keeps any valid node its verify bucket holds)."""
    from specjax import rng
    from specjax.inspect import prefilled_state

    spec = (DraftModel.create(_noisy_copy(tiny_target), k=3) if name == "draft_chain"
            else _make(name, tiny_target))
    state, sampling = prefilled_state(tiny_target, PROMPTS[0], spec)
    for levels in (1, 2):
        ctx = ProposeContext(state.tokens, state.lengths, ~state.done, sampling,
                             rng.step_keys(state.keys, state.lengths, rng.PROPOSE),
                             jnp.full_like(state.lengths, levels))
        tree, _ = spec.propose(state.spec_state, ctx, tiny_target.params)
        np.testing.assert_array_equal(tree.valid, tree.depth <= levels)
