"""Training Medusa and EAGLE heads: the loss falls, and the written heads load into the
speculators and generate exactly the target's greedy output."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from train_setup import DATA, GIN_BINDINGS, MODEL, tokenizer, train_config

import specjax
from specjax.cache import PagedKVCache
from specjax.checkpoint import save_hf
from specjax.heads import EagleConfig, MedusaConfig, load_heads
from specjax.heads.eagle import eagle_logits, eagle_step, fuse_features
from specjax.model import Model, init_params
from specjax.models.transformer import step_context
from specjax.speculators import Eagle, Medusa
from specjax.speculators.saved import head_speculator
from specjax.train import jobs
from specjax.train.methods import TrainEagle, TrainMedusa
from specjax.train.methods.eagle import ttt_mask
from specjax.train.run import CONFIGS_ROOT, run_config
from specjax.train.speculation import SpeculativeEval

PROMPTS = [[5, 6, 7, 8], [9, 10], [11] * 12, [40, 41, 42, 40, 41]]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A random tiny target with the train tests' tokenizer, its LM head scaled up so its
    distributions are peaked (something for the heads to learn; no quality needed)."""
    out = tmp_path_factory.mktemp("target")
    params = init_params(MODEL, 0)
    params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * 20.0
    save_hf(Model(MODEL, params, tokenizer()), out)
    return out


def _evals(workdir):
    lines = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if r["split"] == "eval"]


SPECULATIVE = SpeculativeEval(num_prompts=2, prompt_len=16, new_tokens=16)


def _check_speculative_record(workdir, job, step):
    """One record of the end-of-run greedy generation, in metrics.jsonl and the summary,
    with α and τ as generation defines them."""
    lines = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in lines if r["split"] == "speculative"]
    assert len(records) == 1, records
    rec = records[0]
    assert rec["step"] == step and rec["prompts"] == 2 and rec["new_tokens"] == 16
    assert 0.0 <= rec["alpha"] <= 1.0 and rec["tau"] >= 1.0
    assert (rec["tau"] > 1.0) == (rec["alpha"] > 0.0)  # τ - 1 drafts accepted per target call
    assert sum(rec["accepted_hist"]) > 0
    assert job.summary["speculative"] == rec
    assert json.loads((workdir / "summary.json").read_text())["speculative"] == rec
    return rec


def _lossless(target_dir, spec):
    # two prompts, 16 new tokens, full depth: the end-of-run generation's batch and
    # settings (SPECULATIVE), so its compiled loop serves
    target = specjax.load(target_dir, dtype="float32")
    ref = specjax.generate(target, PROMPTS[:2], max_new_tokens=16, ignore_eos=True).tokens
    out = specjax.generate(target, PROMPTS[:2], max_new_tokens=16, ignore_eos=True,
                           speculator=spec, adaptive=False)
    assert out.tokens == ref


@pytest.mark.parametrize("head,generate", [
    (MedusaConfig(num_heads=2), True),
    # loading saved EAGLE-3 heads into a generating speculator is also
    # test_speculators_heads.py::test_saved_heads_load_into_a_speculator_that_generates_the_same
    (EagleConfig(3, draft_vocab_size=200), False),
    pytest.param(EagleConfig(3, draft_vocab_size=200), True, marks=pytest.mark.slow),
    pytest.param(EagleConfig(1), True, marks=pytest.mark.slow),
], ids=["medusa", "eagle3", "eagle3-generate", "eagle1"])
def test_trained_heads_learn_and_generate_losslessly(tmp_path, target_dir, head, generate):
    kw = {"ttt_steps": 2} if isinstance(head, EagleConfig) and head.version == 3 else {}
    # The end-of-run τ generation compiles a speculative loop: only where we generate anyway.
    kw["speculative"] = SPECULATIVE if generate else None
    job = jobs.heads(tmp_path, target_dir, head, train_config(
        steps=30, checkpoint_every=0, eval_at_start=True), DATA, **kw)
    first, last = _evals(tmp_path)[0], _evals(tmp_path)[-1]
    assert last["loss"] < 0.95 * first["loss"], (first, last)
    if generate:
        record = _check_speculative_record(tmp_path, job, 30)
        if isinstance(head, MedusaConfig):  # a re-run of the finished job reuses the record
            again = jobs.heads(tmp_path, target_dir, head, train_config(
                steps=30, checkpoint_every=0, eval_at_start=True), DATA, **kw)
            assert _check_speculative_record(tmp_path, again, 30) == record
    else:
        assert "speculative" not in job.summary
    target = specjax.load(target_dir, dtype="float32")
    ckpt = load_heads(job.export_dir, target.config)
    if isinstance(head, MedusaConfig):
        loaded = Medusa.load(job.export_dir, target=target, tree=[[0], [1], [0, 0]])
        assert loaded.shape.max_depth == 2
        spec = head_speculator(job.export_dir, target)  # the end-of-run generation's tree
        # the Medusa repository's layout, written beside (tests/test_export.py checks it)
        assert job.summary["serving"] == str(tmp_path / "medusa")
        served = load_heads(tmp_path / "medusa", target.config)
        for a, b in zip(jax.tree.leaves(served.params), jax.tree.leaves(ckpt.params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    elif head.version == 3:  # a 2-layer target has no 3 distinct layers for servers
        assert job.summary["serving"].startswith("not written: hidden_layers=(1, 0, 0)")
    if isinstance(head, EagleConfig):
        spec = Eagle.load(job.export_dir, target=target, top_k=2, depth=2, total_tokens=4)
        if head.version == 3:  # d2t: the 200 ids most frequent in the training split
            assert ckpt.vocab_map.shape == (200,) and np.all(np.diff(ckpt.vocab_map) > 0)
            np.testing.assert_array_equal(spec.d2t, ckpt.vocab_map)
    if generate:
        _lossless(target_dir, spec)


def test_ttt_mask_is_what_a_draft_node_sees():
    m = ttt_mask(3, 4)
    # step 2, index 1: real pairs 0..1, its own chain at index 1 in steps 1 and 2
    row = m[2 * 4 + 1].reshape(3, 4)
    np.testing.assert_array_equal(row, [[1, 1, 0, 0], [0, 1, 0, 0], [0, 1, 0, 0]])
    np.testing.assert_array_equal(m[:4, :4], np.tril(np.ones((4, 4), bool)))  # step 0: causal
    assert not m[:4, 4:].any()


def _ttt_all_blocks(method, params, frozen, batch):
    """EAGLE-3's TTT loss written directly from `ttt_mask`: step j runs the head over the
    concatenation of blocks 0..j under that mask and keeps its last block (every earlier
    block recomputed), the form `TrainEagle` replaces by running each block once."""
    tokens, mask = batch["tokens"], batch["mask"]
    logits, feats = method._target(frozen, batch)
    p = jax.nn.softmax(logits, axis=-1)
    b, n = tokens.shape[0], tokens.shape[1] - 1
    pad = lambda x, j: jnp.pad(x[:, 1 + j:], ((0, 0), (0, j)) + ((0, 0),) * (x.ndim - 2))
    prev = fuse_features(method.head, method.target, params, feats[:, :-1])
    toks, fs, total = [], [], 0.0
    for j in range(method.ttt_steps):
        toks.append(pad(tokens, j)[:, :n])
        fs.append(prev)
        pos = (jnp.arange(n)[None, :] + jnp.arange(j + 1)[:, None]).reshape(1, -1)
        m = jnp.broadcast_to(jnp.asarray(ttt_mask(j + 1, n)), (b, (j + 1) * n, (j + 1) * n))
        out, _ = eagle_step(method.head, method.target, params, frozen["target"], None,
                            jnp.concatenate(toks, 1), jnp.concatenate(fs, 1),
                            jnp.broadcast_to(pos, (b, (j + 1) * n)), mask=m)
        prev = out[:, j * n:]
        q = eagle_logits(method.head, method.target, params, frozen["target"], prev)
        valid = (jnp.arange(n)[None, :] < n - j) * pad(mask, j)[:, :n] * mask[:, :n]
        ce = -jnp.sum(pad(p, j)[:, :n] * jax.nn.log_softmax(q, -1), -1)
        total = total + 0.8 ** j * jnp.sum(ce * valid) / jnp.sum(valid)
    return total


def test_eagle3_ttt_runs_each_block_once_with_the_same_loss_and_grads(target_dir):
    target = specjax.load(target_dir, dtype="float32")
    method = TrainEagle(target.config, EagleConfig(3, draft_vocab_size=200), ttt_steps=3)
    d2t = jnp.asarray(np.sort(np.random.default_rng(0).choice(
        target.config.vocab_size, 200, replace=False)), jnp.int32)
    params = jax.tree.map(  # random, so no block's output is trivial
        lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape, x.dtype),
        method.initial_params(target.params, np.asarray(d2t)))
    frozen = {"target": target.params, "d2t": d2t}
    mask = np.ones((2, 24), np.float32)
    mask[1, 17:] = 0  # a padded row
    batch = {"tokens": jnp.asarray(np.random.default_rng(1).integers(3, 300, (2, 24)),
                                   jnp.int32), "mask": jnp.asarray(mask)}
    loss, grads = jax.jit(jax.value_and_grad(
        lambda p: method.loss_fn(p, frozen, batch, None)[0]))(params)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(
        lambda p: _ttt_all_blocks(method, p, frozen, batch)))(params)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-6)
    assert float(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads))) > 0


def test_seen_keys_are_for_uncached_forwards_only():
    cache = PagedKVCache.for_rows(MODEL, batch=1, pages_per_row=1, page_size=16)
    kv = jnp.zeros((1, 2, MODEL.num_kv_heads, MODEL.head_dim))
    with pytest.raises(ValueError, match="uncached forwards"):
        step_context(MODEL, jnp.zeros((1, 2), jnp.int32), jnp.full((1,), 2, jnp.int32),
                     None, cache, seen=((kv, kv, jnp.ones((1, 2, 2), bool)),))


def test_medusa2_joint_trains_the_target_too(target_dir):
    target = specjax.load(target_dir, dtype="float32")
    method = TrainMedusa(target.config, MedusaConfig(num_heads=2), joint=True)
    params = method.initial_params(target.params)
    batch = {"tokens": jnp.asarray(np.arange(64).reshape(2, 32) % 300, jnp.int32),
             "mask": jnp.ones((2, 32))}
    grads = jax.jit(jax.grad(lambda p: method.loss_fn(p, None, batch, None)[0]))(params)
    norm = lambda t: float(sum(jnp.sum(x * x) for x in jax.tree.leaves(t)))
    assert norm(grads["target"]) > 0 and norm(grads["heads"]) > 0
    with pytest.raises(ValueError, match="initial_params"):
        method.init(jax.random.key(0))


def test_gin_features_dump_then_eagle3_run_reads_it(tmp_path, target_dir):
    """configs/runs/features.gin dumps the final hidden state and EAGLE-3's layers once;
    configs/runs/eagle.gin with features = "offline" trains from that dump without
    rewriting it; a re-run of either finds its work done."""
    data = [f"include '{CONFIGS_ROOT / 'models' / 'tiny.gin'}'",
            *[b for b in GIN_BINDINGS if b.split(".")[0] in ("config", "data", "corpus")],
            "corpus.CorpusConfig.max_chars = 20000"]
    dump_bindings = [*data, f"jobs.offline_features.target_dir = '{target_dir}'",
                     "jobs.offline_features.head_config = @eagle.EagleConfig()",
                     "jobs.offline_features.progress = False"]
    store = run_config(CONFIGS_ROOT / "runs" / "features.gin", dump_bindings,
                       workdir=tmp_path / "features")
    assert store.complete and store.layers == (0, 1)  # eagle3_layers(2) = (1, 0, 0)
    files = lambda: {p: p.stat().st_mtime_ns for p in (tmp_path / "features").rglob("*")
                     if p.name != "config.gin"}
    dumped = files()
    assert run_config(CONFIGS_ROOT / "runs" / "features.gin", dump_bindings,
                      workdir=tmp_path / "features").written == store.written
    bindings = [*data, *[b for b in GIN_BINDINGS if b.split(".")[0] in ("trainer", "optim")],
                f"jobs.heads.target_dir = '{target_dir}'",
                "jobs.heads.features = 'offline'",
                f"jobs.heads.features_dir = '{tmp_path / 'features'}'",
                "jobs.heads.speculative = None",  # τ: the Medusa case above, the quickstart
                "jobs.heads.ttt_steps = 2",
                "eagle.EagleConfig.version = 3",
                "eagle.EagleConfig.draft_vocab_size = 200",
                "trainer.TrainConfig.steps = 4"]
    bindings.remove("trainer.TrainConfig.steps = 12")
    job = run_config(CONFIGS_ROOT / "runs" / "eagle.gin", bindings, workdir=tmp_path / "heads")
    assert job.train.finished and job.summary["features"] == "offline"
    assert "speculative" not in job.summary and not (tmp_path / "heads" / "features").exists()
    identity = json.loads((tmp_path / "heads" / "config.json").read_text())["identity"]
    assert identity["data"]["features"]["layers"] == [0, 1]
    assert load_heads(job.export_dir, MODEL).vocab_map.shape == (200,)
    again = run_config(CONFIGS_ROOT / "runs" / "eagle.gin", bindings, workdir=tmp_path / "heads")
    assert again.train.step == 4 and again.train.eval == pytest.approx(job.train.eval)
    assert files() == dumped


def test_a_misspelled_method_setting_is_an_error_before_loading():
    with pytest.raises(ValueError, match=r"\['ttt_stepz'\].*TrainEagle"):
        jobs.heads("/nowhere/run", "/nowhere/target", EagleConfig(3), train_config(),
                   ttt_stepz=3)


@pytest.mark.parametrize("tied", [True, False])
def test_eagle3_init_from_target_is_the_targets_next_layer(tied):
    """With the embedding half of q/k/v zeroed, the target-initialised head over the
    target's own features is the target's layer after the high feature; where that is
    the last layer, its logits are the target's at the draft vocabulary's ids."""
    from specjax.config import tiny_llama
    from specjax.heads.eagle import eagle_logits, eagle_step, fuse_features
    from specjax.train.methods import TrainEagle

    cfg = tiny_llama(vocab_size=96, num_layers=4, tie_word_embeddings=tied)
    target = specjax.init_model(cfg, seed=2)
    method = TrainEagle(cfg, EagleConfig(version=3, hidden_layers=(0, 1, 2),
                                         draft_vocab_size=40), init_from_target=True)
    d2t = np.sort(np.random.default_rng(0).choice(96, 40, replace=False)).astype(np.int32)
    params = method.initial_params(target.params, d2t)
    d = cfg.hidden_size
    for name in ("q_proj", "k_proj", "v_proj"):  # only the feature half reads the target
        params["self_attn"][name]["kernel"] = params["self_attn"][name]["kernel"].at[:d].set(0)
    tokens = np.random.default_rng(1).integers(0, 96, (2, 9))
    logits, hidden, _ = specjax.step(cfg, target.params, None, tokens,
                                     np.broadcast_to(np.arange(9), (2, 9)),
                                     hidden_layers=(0, 1, 2))
    feats = fuse_features(method.head, cfg, params, jnp.concatenate(hidden.layers, -1))
    np.testing.assert_array_equal(np.asarray(feats), np.asarray(hidden.layers[2]))
    out, _ = eagle_step(method.head, cfg, params, target.params, None, jnp.asarray(tokens),
                        feats, jnp.broadcast_to(jnp.arange(9), (2, 9)))
    got = eagle_logits(method.head, cfg, params, target.params, out)
    np.testing.assert_allclose(np.asarray(got), np.asarray(logits)[..., d2t], atol=1e-4,
                               rtol=0)
    with pytest.raises(ValueError, match="init_from_target is an EAGLE-3 setting"):
        TrainEagle(cfg, EagleConfig(version=1), init_from_target=True)
