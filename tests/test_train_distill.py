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
from specjax.train.forward import causal_logits
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


@jax.jit
def _kept_vocabulary_cases(target_logits, draft_logits, vocab):
    one = jnp.ones(target_logits.shape[:2])
    return {name: fn(target_logits, draft_logits, one, 1.5, vocab=vocab)
            for name, fn in losses.DIVERGENCES.items()} | {
        "agreement": losses.top1_agreement(target_logits, draft_logits, one, vocab)}


def test_divergences_on_a_kept_vocabulary():
    """A draft proposing only `vocab`: each divergence compares q with the target's
    distribution renormalized on `vocab`; agreement maps the draft's argmax back to
    target ids and compares it with the target's over every id."""
    rng = np.random.default_rng(0)
    vocab = np.array([0, 2, 3, 6])
    tl = rng.normal(size=(2, 3, 7)).astype(np.float32) * 2
    dl = rng.normal(size=(2, 3, 4)).astype(np.float32) * 2
    tl[0, 0, 6] = 9.0  # the target's argmax there, kept...
    dl[0, 0, 3] = 9.0  # ...and the draft's, at the same target id
    tl[1, 2, 5] = 9.0  # one the draft can never propose
    dl[1, 2, 2] = 9.0  # (though id 3 is the target's best among the kept)
    tl[1, 2, 3] = 8.0
    out = _kept_vocabulary_cases(jnp.asarray(tl), jnp.asarray(dl), jnp.asarray(vocab))
    soft = lambda x: np.exp(x - x.max(-1, keepdims=True)) / np.exp(  # noqa: E731
        x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)
    p, q = soft(tl[..., vocab] / 1.5), soft(dl / 1.5)
    assert out["tvd"] == pytest.approx(np.mean(0.5 * np.abs(p - q).sum(-1)), abs=1e-6)
    assert out["reverse_kl"] == pytest.approx(np.mean((q * np.log(q / p)).sum(-1)), abs=1e-5)
    assert out["forward_kl"] == pytest.approx(np.mean((p * np.log(p / q)).sum(-1)), abs=1e-5)
    same = tl.argmax(-1) == vocab[dl.argmax(-1)]
    assert same[0, 0] and not same[1, 2]
    assert out["agreement"] == pytest.approx(same.mean())
    # the draft at the renormalized target is the optimum; keeping every id is the
    # plain divergence
    at_p = _kept_vocabulary_cases(jnp.asarray(tl), jnp.asarray(tl[..., vocab]),
                                  jnp.asarray(vocab))
    every = _kept_vocabulary_cases(jnp.asarray(tl), jnp.asarray(dl[..., [0, 1, 2, 3, 0, 1, 2]]),
                                   jnp.arange(7))
    for name, fn in losses.DIVERGENCES.items():
        assert at_p[name] == pytest.approx(0.0, abs=1e-6), name
        plain = fn(jnp.asarray(tl), jnp.asarray(dl[..., [0, 1, 2, 3, 0, 1, 2]]),
                   jnp.ones((2, 3)), 1.5)
        assert every[name] == pytest.approx(float(plain), rel=1e-6) and plain > 0.1, name


def test_a_kept_vocabularys_loss_is_the_draft_head_on_those_rows(target):
    """Distill(vocab=) trains the draft's head rows of `vocab` only: its logits are the
    whole head's at those ids, its loss the kept-vocabulary divergence of them; a bad
    vocabulary names itself."""
    model = specjax.load(target.export_dir)
    vocab = tuple(range(3, 300, 3))
    method = Distill(DRAFT, MODEL, vocab=vocab)
    batch = {"tokens": jnp.asarray(tiny_data().eval[:2, :16]), "mask": jnp.ones((2, 16))}
    draft_params = specjax.init_params(DRAFT, jax.random.key(1))

    @jax.jit
    def run(draft_params, target_params):
        p, q = method._logits(draft_params, target_params, batch["tokens"])
        whole = causal_logits(DRAFT, draft_params, batch["tokens"])
        loss = method.loss_fn(draft_params, target_params, batch, jax.random.key(0))[0]
        grads = jax.grad(lambda d: method.loss_fn(d, target_params, batch,
                                                  jax.random.key(0))[0])(draft_params)
        return q, whole, loss, losses.total_variation(p, whole[..., jnp.asarray(vocab)],
                                                      batch["mask"], vocab=vocab), grads

    q, whole, loss, expect, grads = run(draft_params, model.params)
    np.testing.assert_allclose(q, np.asarray(whole)[..., list(vocab)], rtol=1e-5, atol=1e-5)
    assert loss == pytest.approx(float(expect), rel=1e-6)
    head = np.asarray(grads["lm_head"]["kernel"])  # [D, V]
    kept = np.zeros(VOCAB, bool)
    kept[list(vocab)] = True
    assert np.abs(head[:, ~kept]).max() == 0 and np.abs(head[:, kept]).max() > 0
    with pytest.raises(ValueError, match="sorted"):
        Distill(DRAFT, MODEL, vocab=(5, 3))
    with pytest.raises(ValueError, match="outside"):
        Distill(DRAFT, MODEL, vocab=(3, VOCAB))


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
