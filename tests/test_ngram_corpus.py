"""n-gram drafting from a corpus (`CorpusIndex`, `NGram(corpus=)`): the lookup, the
choice between a row's own match and the corpus's, losslessness, and bad input."""

import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.speculators import CorpusIndex, NGram
from specjax.speculators.base import ProposeContext
from specjax.speculators.ngram_corpus import _hash, read_corpus
from tests.conftest import PROMPTS

DOCS = [[5, 6, 7, 8, 9], [1, 2, 3], [6, 7, 40, 41], [2, 3, 50, 51, 52, 53, 54]]


def _lookup(index, rows, n_min=1, n_max=3, k=4):
    """[(drafts while valid)] per row of token lists (each its own length)."""
    width = max(map(len, rows))
    toks = jnp.asarray([r + [0] * (width - len(r)) for r in rows], jnp.int32)
    drafts, valid = index.lookup(toks, jnp.asarray([len(r) for r in rows]), n_min, n_max, k)
    return [[int(t) for t, v in zip(d, ok) if v] for d, ok in zip(drafts, valid)]


def test_lookup_takes_the_longest_n_and_ties_go_to_the_first_occurrence():
    index = CorpusIndex.build(DOCS, n_max=3)
    # "6 7" is followed by 8 in document 0 and by 40 in document 2: a tie, so the first
    # occurrence's continuation, up to the document's end
    assert _lookup(index, [[1, 6, 7]]) == [[8, 9]]
    # "40": only in document 2
    assert _lookup(index, [[9, 40]]) == [[41]]
    # "1 2 3" (document 1) ends its document, so has no continuation there; "2 3" is in
    # document 3 with one, and a shorter n is taken when the longer finds none
    assert _lookup(index, [[1, 2, 3]]) == [[50, 51, 52, 53]]
    # k caps the draft; n_min above the longest match found leaves none
    assert _lookup(index, [[2, 3]], k=2) == [[50, 51]]
    assert _lookup(index, [[9, 2, 3]], n_min=3) == [[]]
    # an n-gram that is not in the corpus, and a row shorter than n_min
    assert _lookup(index, [[11, 12, 13], [7]], n_min=2) == [[], []]


def test_lookup_follows_the_most_frequent_continuation():
    docs = [[1, 2, 4, 6], [1, 2, 3, 9], [1, 2, 4, 5], [7, 1, 2, 4, 5]]
    index = CorpusIndex.build(docs)
    # "1 2" is followed by 4 three times in four; after "1 2 4", by 5 twice in three;
    # then each of those documents ends, so the draft stops there
    assert _lookup(index, [[0, 1, 2]]) == [[4, 5]]
    # the path is followed, and drafted, for `depth` tokens
    assert _lookup(CorpusIndex.build(docs, depth=1), [[0, 1, 2]]) == [[4]]
    # "4" alone: 5 twice, 6 once; two more "4 6 8" make 6 the most frequent, then 8
    assert _lookup(index, [[3, 4]], n_min=1) == [[5]]
    assert _lookup(CorpusIndex.build(docs + [[4, 6, 8]] * 2), [[3, 4]],
                   n_min=1) == [[6, 8]]
    # a document's end counts as a continuation: "4 5" ends two documents of three
    ends = CorpusIndex.build([[4, 5, 6], [4, 5], [4, 5]])
    assert _lookup(ends, [[4]]) == [[5]]


def test_a_continuation_few_occurrences_agree_on_is_not_drafted():
    # after "1 2 4" four tokens each follow once: a share of 0.25, under MIN_SHARE
    docs = [[1, 2, 4, t] for t in (5, 6, 7, 8)]
    assert _lookup(CorpusIndex.build(docs), [[1, 2]]) == [[4]]
    assert _lookup(CorpusIndex.build(docs, min_share=0.25), [[1, 2]]) == [[4, 5]]
    # a first token under the share: that n-gram drafts nothing, and peeks no draft
    spread = [[1, 2, t, 9] for t in (5, 6, 7, 8)]
    assert _lookup(CorpusIndex.build(spread), [[1, 2]]) == [[]]
    assert _propose(NGram(k=4).with_corpus(spread), [30, 1, 2]) == ([], False)
    assert _propose(NGram(k=4).with_corpus(spread, min_share=0), [30, 1, 2]) == ([5, 9], True)


def test_no_ngram_crosses_a_document_boundary():
    # "9 1" spans documents 0 and 1 once they are joined: never matched
    index = CorpusIndex.build(DOCS, n_max=2)
    assert _lookup(index, [[9, 1]], n_min=2, n_max=2) == [[]]
    assert _lookup(index, [[9, 1]], n_min=1, n_max=2) == [[2, 3]]  # "1" alone is


def test_a_hash_collision_drafts_nothing():
    """An n-gram that is not in the corpus but hashes to a taken slot is told apart by
    its tokens."""
    index = CorpusIndex.build(DOCS, n_max=2)
    size = index.slots.shape[1]
    taken = _hash(np.asarray([6, 7])) & np.uint32(size - 1)
    grams = np.stack(np.meshgrid(np.arange(100), np.arange(300)), -1).reshape(-1, 2)
    hits = grams[(_hash(grams) & np.uint32(size - 1)) == taken]
    other = [g for g in hits.tolist() if g != [6, 7]][0]
    assert _lookup(index, [other], n_min=2, n_max=2) == [[]]
    assert _lookup(index, [[6, 7]], n_min=2, n_max=2) == [[8, 9]]


def _propose(spec, row, k=4):
    toks = jnp.asarray([row + [0] * (16 - len(row))], jnp.int32)
    ctx = ProposeContext(toks, jnp.asarray([len(row)]), jnp.asarray([True]), None, None,
                         jnp.asarray([k]))
    tree, _ = spec.propose(None, ctx, None)
    has = spec.has_draft(None, toks, jnp.asarray([len(row)]))
    return [int(t) for t, v in zip(tree.tokens[0], tree.valid[0]) if v], bool(has[0])


def test_own_match_comes_before_the_corpus():
    spec = NGram(k=4).with_corpus(DOCS)
    # the row's own "6 7" (followed by 1 1 1 1) wins over the corpus's 8 9
    assert _propose(spec, [6, 7, 1, 1, 1, 1, 6, 7]) == ([1, 1, 1, 1], True)
    # no own match: the corpus's continuation
    assert _propose(spec, [30, 31, 6, 7]) == ([8, 9], True)
    # neither
    assert _propose(spec, [30, 31, 32, 33]) == ([], False)
    assert _propose(NGram(k=4), [30, 31, 6, 7]) == ([], False)


def test_a_corpus_draft_stops_after_corpus_k_tokens():
    # "2 3" continues 50 51 52 53 in the corpus; an own match keeps its k
    assert _propose(NGram(k=4).with_corpus(DOCS), [30, 2, 3]) == ([50, 51], True)
    assert _propose(NGram(k=4, corpus_k=3).with_corpus(DOCS), [30, 2, 3]) == ([50, 51, 52], True)
    assert _propose(NGram(k=3, corpus_k=8).with_corpus(DOCS), [30, 2, 3]) == ([50, 51, 52], True)
    assert _propose(NGram(k=4, corpus_k=1).with_corpus(DOCS),
                    [2, 3, 1, 1, 1, 1, 2, 3]) == ([1, 1, 1, 1], True)


def test_a_corpus_of_the_targets_outputs_drafts_and_stays_lossless(tiny_target):
    """Greedy output with a corpus equals plain decoding's; a corpus holding the target's
    own continuations of the same prompts gets drafts accepted where the rows' own
    tokens give the plain n-gram fewer."""
    ref = specjax.generate(tiny_target, PROMPTS, max_new_tokens=16, ignore_eos=True)
    corpus = [p + t for p, t in zip(PROMPTS, ref.tokens)]
    kw = dict(max_new_tokens=16, ignore_eos=True, adaptive=False)
    plain = specjax.generate(tiny_target, PROMPTS, speculator=NGram(k=4), **kw)
    spec = NGram(k=4, corpus_k=4).with_corpus(corpus, tiny_target.config.vocab_size)
    out = specjax.generate(tiny_target, PROMPTS, speculator=spec, **kw)
    assert out.tokens == ref.tokens == plain.tokens
    assert out.stats.mean_accepted_length > plain.stats.mean_accepted_length + 1.0
    unrelated = NGram(k=4).with_corpus([list(range(100, 128)) * 2])
    assert specjax.generate(tiny_target, PROMPTS, speculator=unrelated, **kw).tokens == ref.tokens


@pytest.mark.parametrize("build,match", [
    (lambda: CorpusIndex.build([]), "at least one non-empty"),
    (lambda: CorpusIndex.build([[]]), "at least one non-empty"),
    (lambda: CorpusIndex.build([[1, 2], [3, -4]]), "document 1 holds token id -4"),
    (lambda: CorpusIndex.build([[1, 200]], vocab_size=128), r"token id 200, outside \[0, 128\)"),
    (lambda: CorpusIndex.build([[1, 2]], n_max=0), "n_max=0"),
    (lambda: CorpusIndex.build([[1, 2]], depth=0), "depth=0"),
    (lambda: CorpusIndex.build([[1, 2]], min_share=1.5), "min_share=1.5"),
    (lambda: NGram(k=2, corpus_k=0), "corpus_k=0 must be >= 1"),
    (lambda: NGram(k=2, n_max=3, corpus=CorpusIndex.build([[1, 2]], n_max=2)),
     "n_max=3 exceeds its corpus index's n_max=2"),
])
def test_bad_corpus(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_corpus_file_lines_are_checked(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"def": 0, "f": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    good = tmp_path / "good.jsonl"
    good.write_text('{"ids": [5, 6, 7]}\n\n{"text": "def f x"}\n')
    assert read_corpus(good, tok) == [[5, 6, 7], [0, 1, 2]]
    with pytest.raises(ValueError, match=f"{good}:3: a 'text' line needs the model's tok"):
        read_corpus(good)
    bad = tmp_path / "bad.jsonl"
    for text, match in (('{"text": "a"}\n\n{"txt": "b"}\n', ":3: needs 'ids'"),
                        ('{"ids": [1, "2"]}\n', ":1: needs 'ids'"),
                        ('[1, 2]\n', ":1: needs 'ids'"),
                        ('{"text": "a"\n', ":1: not JSON"),
                        ("\n", ": no texts")):
        bad.write_text(text)
        with pytest.raises(ValueError, match=f"{bad}{match}"):
            read_corpus(bad, tok)


def test_cli_generate_drafts_from_a_corpus_file(tmp_path, capsys):
    from specjax import cli

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"ids": [9, 8, 7, 6, 5, 4, 3, 2]}\n')
    assert cli.main(["generate", "--ids", "1,2,3,1,2,3,1,2", "--max-new-tokens", "6",
                     "--ngram-corpus", str(corpus)]) == 0
    assert "greedy outputs identical: True" in capsys.readouterr().out
    corpus.write_text('{"ids": [9, "x"]}\n')
    assert cli.main(["generate", "--ids", "1,2,3", "--ngram-corpus", str(corpus)]) == 2
    assert f"{corpus}:1: needs 'ids'" in capsys.readouterr().err
    assert cli.main(["generate", "--speculator", "none", "--ngram-corpus", str(corpus)]) == 2
    err = capsys.readouterr().err
    assert "--ngram-corpus is for --speculator ngram; --speculator is 'none'" in err


def test_replay_counts_corpus_drafts_against_the_continuation():
    """`bench.corpus_drafts.replay` by hand: in [9 1 2 3 7 8] the corpus drafts "3 4"
    after "1 2" (one token right) and "4" after "2 3" (wrong); in [5 6 5 6 5 6] the row's
    own "5 6" drafts once, and is not counted as a corpus draft."""
    from specjax.bench.corpus_drafts import replay

    spec = NGram(k=2).with_corpus([[1, 2, 3, 4]])
    out = replay(spec, [[9, 1, 2, 3, 7, 8], [5, 6, 5, 6, 5, 6]], [1, 1],
                 lambda t: np.asarray(t, np.float64))  # a verify costs its tokens
    assert out["positions"] == 8
    assert (out["own"], out["corpus"]) == (1 / 8, 2 / 8)
    assert out["acceptance"] == [0.5, 0.0]
    assert out["tokens_per_cost"] == pytest.approx((2 + 1) / (3 + 2))
    assert out["net_per_100"] == pytest.approx(100 * ((2 - 3) + (1 - 2)) / 8)
    with pytest.raises(ValueError, match="no position to replay"):
        replay(spec, [[1, 2]], [1], lambda t: t)
