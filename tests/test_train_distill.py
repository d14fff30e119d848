"""Draft distillation: divergences, the target sampler, and a distilled draft that agrees
with its target more often than an untrained one; the pretrain job's export."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from train_setup import DATA, DRAFT, MODEL, VOCAB, tiny_data, train_config

import specjax
from specjax.train import jobs, losses, tokenizer as tok_lib
from specjax.train.features import embedding_and_head
from specjax.train.forward import FINAL_KEY, causal_logits, frozen_hidden
from specjax.train.methods import Distill


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """The tiny target, pretrained by the pretrain job (same programs as the trainer tests)."""
    return jobs.pretrain(tmp_path_factory.mktemp("target"), MODEL,
                         train_config(steps=100, checkpoint_every=0), DATA)


@pytest.fixture(scope="module")
def distilled(target, tmp_path_factory):
    return jobs.distill(tmp_path_factory.mktemp("draft"), target.export_dir, DRAFT,
                        train_config(steps=60, checkpoint_every=0, eval_at_start=True), DATA)


def eval_lines(workdir):
    lines = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if r["split"] == "eval"]


@jax.jit
def _divergence_cases():
    p = jnp.log(jnp.array([[[0.5, 0.5, 1e-30]]]))  # target
    q = jnp.log(jnp.array([[[0.9, 0.1, 1e-30]]]))  # draft
    one = jnp.ones((1, 1))
    out = {"by_hand": (losses.total_variation(p, q, one), losses.forward_kl(p, q, one),
                       losses.reverse_kl(p, q, one), losses.top1_agreement(p, q, one))}
    logits = jax.random.normal(jax.random.key(0), (2, 5, 7))
    other = logits.at[1].add(3.0 * jax.random.normal(jax.random.key(1), (5, 7)))
    ones, first_row = jnp.ones((2, 5)), jnp.array([[1.0] * 5, [0.0] * 5])
    for name, fn in losses.DIVERGENCES.items():
        out[name] = (fn(logits, logits, ones), fn(other, logits, ones),
                     fn(other, logits, first_row))
    return out


def test_divergences_by_hand():
    out = _divergence_cases()
    tvd, fkl, rkl, agree = out["by_hand"]
    assert tvd == pytest.approx(0.4, abs=1e-6)
    assert fkl == pytest.approx(0.5 * np.log(0.5 / 0.9) + 0.5 * np.log(0.5 / 0.1), abs=1e-5)
    assert rkl == pytest.approx(0.9 * np.log(0.9 / 0.5) + 0.1 * np.log(0.1 / 0.5), abs=1e-5)
    assert agree == 1.0
    for name in losses.DIVERGENCES:
        same, differ, masked = out[name]
        assert same == pytest.approx(0.0, abs=1e-6), name
        assert differ > 0.01, name
        assert masked == pytest.approx(0.0, abs=1e-6), name  # only row 0 counts; it is equal
    with pytest.raises(ValueError, match="divergence='kl'"):
        Distill(DRAFT, MODEL, divergence="kl")
    with pytest.raises(ValueError, match="vocab_size"):
        Distill(DRAFT.replace(vocab_size=64), MODEL)


def test_a_kept_vocabularys_loss_is_both_heads_on_those_rows(target):
    """Distill(vocab=) takes both LM heads at the kept ids only: the draft's logits are
    its whole head's there (so only those rows train), the target's softmax is its whole
    distribution renormalised on them, and the loss is the divergence of the two. A bad
    vocabulary names itself."""
    model = specjax.load(target.export_dir)
    vocab = tuple(range(3, 300, 3))
    method = Distill(DRAFT, MODEL, vocab=vocab)
    batch = {"tokens": jnp.asarray(tiny_data().eval[:2, :16]), "mask": jnp.ones((2, 16))}
    draft_params = specjax.init_params(DRAFT, jax.random.key(1))

    @jax.jit
    def run(draft_params, target_params):
        p, q = method._logits(draft_params, target_params, batch, batch["tokens"])
        whole_p = causal_logits(MODEL, target_params, batch["tokens"])
        whole_q = causal_logits(DRAFT, draft_params, batch["tokens"])
        loss = method.loss_fn(draft_params, target_params, batch, jax.random.key(0))[0]
        grads = jax.grad(lambda d: method.loss_fn(d, target_params, batch,
                                                  jax.random.key(0))[0])(draft_params)
        return p, q, whole_p, whole_q, loss, grads

    p, q, whole_p, whole_q, loss, grads = run(draft_params, model.params)
    kept = np.zeros(VOCAB, bool)
    kept[list(vocab)] = True
    np.testing.assert_allclose(q, np.asarray(whole_q)[..., kept], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(p, np.asarray(whole_p)[..., kept], rtol=1e-5, atol=1e-5)
    whole = np.asarray(jax.nn.softmax(whole_p, -1))[..., kept]
    np.testing.assert_allclose(jax.nn.softmax(p, -1), whole / whole.sum(-1, keepdims=True),
                               rtol=1e-4, atol=1e-6)
    assert loss == pytest.approx(float(losses.total_variation(p, q, batch["mask"])), rel=1e-6)
    head = np.asarray(grads["lm_head"]["kernel"])  # [D, V]
    assert np.abs(head[:, ~kept]).max() == 0 and np.abs(head[:, kept]).max() > 0
    with pytest.raises(ValueError, match="sorted"):
        Distill(DRAFT, MODEL, vocab=(5, 3))
    with pytest.raises(ValueError, match=r"Distill vocab holds ids outside"):
        Distill(DRAFT, MODEL, vocab=(3, VOCAB))


@pytest.mark.parametrize("vocab", [None, tuple(range(3, 300, 3))], ids=["whole", "kept"])
def test_offline_features_give_the_online_loss_and_gradients(target, vocab):
    """A batch carrying the target's final hidden state (an offline features dump) gives
    the online step's loss and draft gradients while reading only the target's embedding
    and LM head; with source="target" (tokens the dump never saw) it is refused."""
    model = specjax.load(target.export_dir)
    method = Distill(DRAFT, MODEL, vocab=vocab)
    batch = {"tokens": jnp.asarray(tiny_data().eval[:2, :16]), "mask": jnp.ones((2, 16))}
    offline = dict(batch, **{FINAL_KEY: frozen_hidden(MODEL, model.params, batch).final})
    draft_params = specjax.init_params(DRAFT, jax.random.key(1))
    key = jax.random.key(0)

    def loss_and_grads(target_params, batch):
        return jax.jit(jax.value_and_grad(lambda d: method.loss_fn(d, target_params, batch,
                                                                   key)[0]))(draft_params)

    loss, grads = loss_and_grads(model.params, batch)
    off_loss, off_grads = loss_and_grads(embedding_and_head(model.params), offline)
    assert off_loss == pytest.approx(float(loss), rel=1e-5) and float(loss) > 0
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(off_grads)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-7)
    sampled = Distill(DRAFT, MODEL, source="target", prompt_len=4)
    with pytest.raises(ValueError, match="source='target'"):
        sampled.loss_fn(draft_params, model.params, offline, key)


def test_distill_job_on_offline_features(target, tmp_path):
    """jobs.distill(features="offline") dumps the target's final hidden states once and
    trains on them: the same losses as the online run of the same batches; a bad mode or
    the target-sampled source with offline features names itself before anything runs."""
    config = train_config(steps=4, checkpoint_every=0)
    online = jobs.distill(tmp_path / "online", target.export_dir, DRAFT, config, DATA)
    offline = jobs.distill(tmp_path / "offline", target.export_dir, DRAFT, config, DATA,
                           features="offline")
    assert json.loads((tmp_path / "offline" / "features" / "features.json").read_text()
                      )["identity"]["layers"] == []

    def train_losses(workdir):
        lines = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in lines if r["split"] == "train"]

    assert len(train_losses(online.workdir)) == 2
    np.testing.assert_allclose(train_losses(offline.workdir), train_losses(online.workdir),
                               rtol=1e-4)
    with pytest.raises(ValueError, match="features='dumped'"):
        jobs.distill(tmp_path / "bad", target.export_dir, DRAFT, config, DATA,
                     features="dumped")
    with pytest.raises(ValueError, match="source='target'"):
        jobs.distill(tmp_path / "bad", target.export_dir, DRAFT, config, DATA,
                     features="offline", source="target")
    assert not (tmp_path / "bad").exists()


def test_pretrain_job_exports_the_target(target):
    assert target.train.finished and target.export_dir == target.workdir / "export"
    loaded = specjax.load(target.export_dir)
    assert loaded.config == MODEL
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(target.train.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert tok_lib.fingerprint(loaded.tokenizer) == tok_lib.fingerprint(
        tok_lib.load_tokenizer(target.workdir / "tokenizer.json"))


def test_distilled_draft_agrees_with_target_more_than_untrained(target, distilled):
    first, last = eval_lines(distilled.workdir)[0], eval_lines(distilled.workdir)[-1]
    assert first["step"] == 0 and last["step"] == 60
    assert last["agreement"] > first["agreement"] + 0.3, (first, last)  # acceptance proxy
    assert last["tvd"] < first["tvd"] - 0.2
    assert last == pytest.approx({**distilled.train.eval, "step": 60, "split": "eval"})
    draft = specjax.load(distilled.export_dir)
    assert draft.config == DRAFT
    assert tok_lib.fingerprint(draft.tokenizer) == tok_lib.fingerprint(
        specjax.load(target.export_dir).tokenizer)


def test_sampled_source_is_the_targets_greedy_continuation(target):
    """source="target" at temperature 0: the batch's tokens after the prompt are the
    target's greedy continuation, and only those positions are trained on."""
    model = specjax.load(target.export_dir)
    method = Distill(DRAFT, MODEL, source="target", prompt_len=8, sample_temperature=0.0)
    batch = {"tokens": jnp.asarray(tiny_data().eval[:2, :14]), "mask": jnp.ones((2, 14))}
    draft_params = jax.tree.map(jnp.zeros_like, specjax.param_shapes(DRAFT))

    # Params are arguments, as in the trainer. (Closed over as constants, all-zero draft
    # params made XLA:CPU return NaN from some compilations of this loss: jax 0.10.2.)
    @jax.jit
    def run(draft_params, target_params, rng):
        tokens, mask = method._tokens(target_params, batch, rng)
        loss = method.loss_fn(draft_params, target_params, batch, rng)[0]
        return tokens, mask, loss, causal_logits(MODEL, target_params, tokens)

    tokens, mask, loss, logits = run(draft_params, model.params, jax.random.key(3))
    assert (tokens[:, :8] == batch["tokens"][:, :8]).all()
    # Causal: re-reading the finished sequence, each new token is the argmax before it.
    np.testing.assert_array_equal(jnp.argmax(logits[:, 7:13], -1), tokens[:, 8:])
    assert mask[0].tolist() == [0.0] * 7 + [1.0] * 7
    assert np.isfinite(loss), loss


@pytest.mark.slow
def test_distill_on_target_samples(target, tmp_path):
    result = jobs.distill(tmp_path, target.export_dir, DRAFT, train_config(steps=8), DATA,
                          source="target", prompt_len=8, divergence="forward_kl")
    assert result.train.finished and np.isfinite(result.train.eval["forward_kl"])
