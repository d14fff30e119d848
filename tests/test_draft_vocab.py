"""A draft model with a trimmed vocabulary: it proposes only its kept ids, reads only
their LM-head rows, and speculation with it stays lossless (greedy and sampled)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.config import tiny_llama
from specjax.sampling import Sampling
from specjax.speculators import DraftModel
from specjax.speculators.base import ProposeContext
from tests.conftest import PROMPTS
from tests.stat_utils import assert_same_distribution, exact_joint


@pytest.fixture(scope="module")
def greedy_ref(tiny_target):
    return specjax.generate(tiny_target, PROMPTS, max_new_tokens=16, ignore_eos=True)


def _run(target, spec, **kw):
    return specjax.generate(target, PROMPTS, max_new_tokens=16, ignore_eos=True,
                            speculator=spec, adaptive=False, **kw)


# -m slow: the trimmed head's rows are checked by default in the tests below, against
# the target's own tokens and distribution
@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_keeping_every_id_changes_nothing(tiny_target, tiny_draft, temperature):
    whole = DraftModel.create(tiny_draft, k=3)
    kept = DraftModel.create(tiny_draft, k=3, vocab=np.arange(128))
    a = _run(tiny_target, whole, temperature=temperature, seed=3)
    b = _run(tiny_target, kept, temperature=temperature, seed=3)
    assert a.tokens == b.tokens
    assert a.stats.accepted == b.stats.accepted


@pytest.mark.slow  # the kept rows' mapping is checked by default in the tests around it
def test_the_target_trimmed_to_its_own_outputs_still_accepts_everything(tiny_target,
                                                                      greedy_ref):
    """The target drafting for itself with only the ids it emits kept: every draft is
    its own argmax, so all are accepted."""
    used = sorted({t for row in greedy_ref.tokens for t in row})
    out = _run(tiny_target, DraftModel.create(tiny_target, k=4, vocab=used))
    assert out.tokens == greedy_ref.tokens
    assert out.stats.acceptance_rate == 1.0


def test_a_draft_missing_the_targets_tokens_is_rejected_there_and_stays_lossless(
        tiny_target, greedy_ref):
    used = {t for row in greedy_ref.tokens for t in row}
    dropped = sorted(used)[::2]
    vocab = [i for i in range(128) if i not in dropped]
    out = _run(tiny_target, DraftModel.create(tiny_target, k=4, vocab=vocab))
    assert out.tokens == greedy_ref.tokens
    assert 0.0 < out.stats.acceptance_rate < 1.0


@pytest.mark.parametrize("tree_top_k,tied", [(0, False), (2, False), (0, True)])
def test_proposals_come_from_the_kept_ids(tree_top_k, tied):
    model = specjax.init_model(tiny_llama(vocab_size=64, tie_word_embeddings=tied), seed=2)
    vocab = np.arange(5, 64, 3)
    spec = DraftModel.create(model, k=3, vocab=vocab, tree_top_k=tree_top_k,
                             total_tokens=4 if tree_top_k else None).for_decoding()
    state = spec.init(model.config, batch=2, capacity=64)
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 64, (2, 64)), jnp.int32)
    lengths = jnp.array([9, 13], jnp.int32)
    state = state.replace(cache=state.cache.replace(lengths=lengths - 1))
    for temperature in (0.0, 1.0):
        ctx = ProposeContext(tokens, lengths, jnp.ones((2,), bool),
                             Sampling.create(temperature),
                             jax.random.split(jax.random.key(0), 2), jnp.full((2,), 3))
        tree, _ = jax.jit(lambda s, c: spec.propose(s, c, None))(state, ctx)
        drafted = np.asarray(tree.tokens)[np.asarray(tree.valid)]
        assert drafted.size and np.isin(drafted, vocab).all(), drafted
        if not tree_top_k:  # the chain's distributions: over the kept ids, zero elsewhere
            q = np.asarray(tree.draft_probs)[np.asarray(tree.valid)]  # [n, V]
            np.testing.assert_allclose(q.sum(-1), 1.0, rtol=1e-5)
            assert (np.delete(q, vocab, axis=1) == 0).all()
            assert (q[np.arange(len(drafted)), drafted] > 0).all()


def test_the_trimmed_head_is_the_heads_kept_rows():
    for tied in (False, True):
        model = specjax.init_model(tiny_llama(vocab_size=64, tie_word_embeddings=tied), seed=4)
        vocab = np.array([0, 7, 63, 20])
        spec = DraftModel.create(model, k=2, vocab=vocab)
        h = jnp.asarray(np.random.default_rng(1).standard_normal((3, 64)), jnp.float32)
        whole = np.asarray(DraftModel.create(model, k=2)._logits(h))
        np.testing.assert_array_equal(spec.vocab_ids, np.sort(vocab))
        np.testing.assert_allclose(spec._logits(h), whole[:, np.sort(vocab)], rtol=1e-5,
                                   atol=1e-5)
        trimmed = np.asarray(spec._full(spec._logits(h), -np.inf))
        np.testing.assert_allclose(trimmed[:, vocab], whole[:, vocab], rtol=1e-5, atol=1e-5)
        assert np.isneginf(np.delete(trimmed, vocab, axis=1)).all()


def test_cost_counts_only_the_kept_rows(tiny_draft):
    cfg = tiny_draft.config
    whole = DraftModel.create(tiny_draft, k=3).cost.params_per_call
    kept = DraftModel.create(tiny_draft, k=3, vocab=np.arange(0, 128, 4)).cost.params_per_call
    assert whole - kept == (128 - 32) * cfg.hidden_size


@pytest.mark.parametrize("vocab,match", [
    (np.array([1, 2, 200]), r"outside \[0, 128\): \[200\]"),
    (np.array([-1, 2]), r"outside \[0, 128\): \[-1\]"),
    (np.array([4, 5, 4]), r"repeats ids: \[4\]"),
    (np.array([[1, 2]]), "1-D array"),
    (np.array([], np.int32), "at least 1"),
    (np.array([1.0, 2.0]), "integer"),
])
def test_bad_vocab_is_named(tiny_draft, vocab, match):
    with pytest.raises(ValueError, match=match):
        DraftModel.create(tiny_draft, k=2, vocab=vocab)


def test_a_tree_needs_as_many_kept_ids_as_its_branching(tiny_draft):
    with pytest.raises(ValueError, match="at least 3"):
        DraftModel.create(tiny_draft, k=2, tree_top_k=3, vocab=[1, 2])


def test_sampled_output_keeps_the_target_distribution():
    """A peaked target, a noisy copy as draft trimmed to 5 of 8 ids (so it cannot propose
    some of the target's likely tokens): the sampled output is still the target's."""
    vocab_size = 8

    def make(seed):
        m = specjax.init_model(tiny_llama(vocab_size=vocab_size, hidden_size=32,
                                          intermediate_size=64, num_heads=2, num_kv_heads=1),
                               seed=seed)
        m.params["lm_head"]["kernel"] = m.params["lm_head"]["kernel"] * 60.0
        return m

    target, draft = make(10), make(11)
    draft.params = jax.tree.map(lambda t, d: t + 0.3 * (d - t), target.params, draft.params)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    spec = DraftModel.create(draft, k=2, vocab=[0, 2, 3, 5, 7])
    out = specjax.generate(target, [prompt] * 3000, max_new_tokens=3, ignore_eos=True,
                           temperature=1.0, seed=1, speculator=spec, adaptive=False)
    assert out.stats.accepted > 0
    assert_same_distribution([tuple(t[:3]) for t in out.tokens],
                             exact_joint(target, prompt, 3, 1.0))


def test_cli_trims_the_draft_to_a_vocab_file(tiny_target, tiny_draft, tmp_path, capsys):
    """`specjax generate --draft DIR --draft-vocab FILE`: lossless greedy with the trimmed
    draft; a file that is not a vocabulary exits 2 naming it."""
    from specjax.cli import main
    from specjax.speculators.draft_model import save_vocab

    specjax.save_hf(tiny_target, tmp_path / "t")
    specjax.save_hf(tiny_draft, tmp_path / "d")
    save_vocab(tmp_path / "vocab.npy", np.arange(0, 128, 2))
    common = ["generate", "--model", str(tmp_path / "t"), "--speculator", "draft",
              "--draft", str(tmp_path / "d"), "--ids", "1,2,3,4,5,6", "--max-new-tokens", "8"]
    assert main(common + ["--draft-vocab", str(tmp_path / "vocab.npy")]) == 0
    assert "greedy outputs identical: True" in capsys.readouterr().out
    np.save(tmp_path / "bad.npy", np.zeros((2, 2), np.int32))
    assert main(common + ["--draft-vocab", str(tmp_path / "bad.npy")]) == 2
    assert f"{tmp_path / 'bad.npy'}: a draft vocabulary is a 1-D array" in capsys.readouterr().err


def test_the_corpus_vocab_is_its_most_frequent_training_ids(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from specjax.bench.speculative import build_speculators
    from specjax.corpus import CorpusConfig, token_counts
    from specjax.speculators.draft_model import load_vocab, save_vocab
    from specjax.train.jobs import corpus_vocab

    words = {w: i for i, w in enumerate(["a", "b", "c", "d", "e", "f", "[UNK]"])}
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    np.testing.assert_array_equal(token_counts(["c c c e", "e b c d"], tok, 16),
                                  [0, 1, 4, 1, 2] + [0] * 11)
    with pytest.raises(ValueError, match="ids up to 4, outside a vocabulary of vocab_size=4"):
        token_counts(["e"], tok, 4)
    # The split is by a hash of the text: distinct documents (an [UNK] word each, counted
    # once per document, below b's count) so that both splits fill.
    src = tmp_path / "docs"
    src.mkdir()
    for i in range(40):
        (src / f"{i:02d}.txt").write_text(f"c c c e e b b x{i}")
    corpus = CorpusConfig(source=str(src), eval_fraction=0.2)
    np.testing.assert_array_equal(corpus_vocab(corpus, tok, 16, 2), [1, 2])  # b ties e: lower id
    model = specjax.init_model(tiny_llama(vocab_size=16), seed=0)
    save_vocab(tmp_path / "vocab.npy", corpus_vocab(corpus, tok, 16, 3))
    assert load_vocab(tmp_path / "vocab.npy").tolist() == [1, 2, 4]
    specs = build_speculators(model, draft=model, draft_vocab=tmp_path / "vocab.npy")
    assert np.asarray(specs["draft"].vocab_ids).tolist() == [1, 2, 4]
    assert build_speculators(model, draft=model, draft_vocab=tmp_path / "no.npy")[
        "draft"].vocab_ids is None
    (tmp_path / "junk.npy").write_text("not numpy")
    with pytest.raises(ValueError, match="junk.npy: not a draft vocabulary"):
        load_vocab(tmp_path / "junk.npy")
