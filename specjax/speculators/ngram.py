"""`NGram`: prompt-lookup drafts from the row's own tokens, on device, at zero model cost.

For n from `n_max` down to `n_min`, find an earlier occurrence of the row's last n tokens
and propose the k tokens that followed it (a chain of point masses). Of the
occurrences, the most recent one with a whole k-token continuation; failing that, the
one with the longest (the earliest). The most recent occurrence alone is often just
behind the end (a repeated token, a line being repeated), with one or two tokens after
it, so it drafted too little to beat prompt lookup; this choice drafts far deeper
(docs/benchmarks.md, "Design ablations").
The lookup costs next to nothing, so the n-gram peeks (`has_draft`): the loop runs plain
steps until a row has a match, and the adaptive rule prices only the steps that have one.
Repetitive input (code edits, quoting the prompt) gives long accepted runs. A match of
one token is right about one time in four, of two more often than not, so `n_min`
defaults to 2 (docs/benchmarks.md, "n-gram: the shortest match"). `n_min` is a traced
value, so another `n_min` runs the loop compiled for the first; `k` and `n_max` shape it.
With a `corpus` (`CorpusIndex`), a row whose own tokens hold no match drafts the corpus's
most frequent continuation of its last n tokens instead, as SuffixDecoding and REST draft
from earlier outputs, up to a token few of the n-gram's occurrences go on with. Its own
match comes first, since it is right far more often. A corpus draft stops after
`corpus_k` tokens (default 2): its tokens are accepted less often than an own match's,
so a longer one costs a wider verify than it returns (docs/benchmarks.md, "n-gram over a
corpus").
"""

from __future__ import annotations

import numbers

import jax.numpy as jnp
from flax import struct

from specjax.speculators.base import ProposeContext, Speculator, TreeShape
from specjax.speculators.ngram_corpus import MIN_SHARE, CorpusIndex, read_corpus
from specjax.tree import DraftTree, chain


@struct.dataclass
class NGram(Speculator):
    k: int = struct.field(pytree_node=False, default=4)
    n_max: int = struct.field(pytree_node=False, default=3)
    n_min: int = 2  # a leaf: traced inside the loop
    # whether the loop looks up a match before each step (`Speculator.peeks`); False
    # asks for a draft wherever the rule drafts, as a speculator that cannot peek does
    # (an ablation: `python -m specjax.bench.loop_steps` times both)
    peek: bool = struct.field(pytree_node=False, default=True)
    # where the row's own tokens hold no match: the continuation in this corpus, at most
    # corpus_k tokens of it (a corpus match is right less often than the row's own)
    corpus: CorpusIndex | None = None
    corpus_k: int = struct.field(pytree_node=False, default=2)

    @property
    def peeks(self) -> bool:
        return self.peek

    def __post_init__(self):
        if self.k < 1 or self.corpus_k < 1:
            raise ValueError(f"NGram k={self.k} and corpus_k={self.corpus_k} must be >= 1")
        # checked where it is a number: jax also rebuilds the speculator around tracers
        # and placeholders
        if isinstance(self.n_min, numbers.Number) and not 1 <= self.n_min <= self.n_max:
            raise ValueError(f"NGram needs 1 <= n_min <= n_max; got n_min={self.n_min}, "
                             f"n_max={self.n_max}")
        if (isinstance(self.corpus, CorpusIndex) and hasattr(self.corpus.slots, "shape")
                and self.corpus.n_max < self.n_max):
            raise ValueError(f"NGram n_max={self.n_max} exceeds its corpus index's n_max="
                             f"{self.corpus.n_max}")

    def with_corpus(self, documents, vocab_size: int | None = None,
                    min_share: float = MIN_SHARE) -> "NGram":
        """This n-gram drafting from `documents` (token-id lists) too, where a row's own
        tokens hold no match (`CorpusIndex.build`: each n-gram's most frequent
        continuation, up to a token fewer than `min_share` of its occurrences go on
        with)."""
        return self.replace(corpus=CorpusIndex.build(
            documents, self.n_max, vocab_size, depth=self.k,
            min_share=min_share))

    def with_corpus_file(self, path, model) -> "NGram":
        """`with_corpus` over the documents of the file `path` (`read_corpus`: JSON lines
        of 'text', tokenized by `model`'s tokenizer, or 'ids'), checked against `model`'s
        vocabulary."""
        return self.with_corpus(read_corpus(path, model.tokenizer), model.config.vocab_size)

    @property
    def shape(self) -> TreeShape:
        return TreeShape.chain(self.k)

    def propose(self, state, ctx: ProposeContext, target_params) -> tuple[DraftTree, tuple]:
        toks, lens = ctx.tokens, ctx.lengths  # [B, S], [B]
        s = toks.shape[1]
        best = self._match(toks, lens)
        idx = best[:, None] + 1 + jnp.arange(self.k)[None, :]  # [B, k]
        drafts = jnp.take_along_axis(toks, jnp.clip(idx, 0, s - 1), axis=1)
        valid = (best[:, None] >= 0) & (idx < lens[:, None])
        if self.corpus is not None:
            outside, found = self.corpus.lookup(toks, lens, self.n_min, self.n_max, self.k)
            found = found & (jnp.arange(self.k) < self.corpus_k)[None, :]
            own = best[:, None] >= 0
            drafts, valid = jnp.where(own, drafts, outside), jnp.where(own, valid, found)
        return chain(drafts, valid=valid), state

    def has_draft(self, state, tokens, lengths):
        """[B] bool: rows whose last n_min..n_max tokens recur earlier (a match always has
        a token after it), or, with a corpus, occur there."""
        own = self._match(tokens, lengths) >= 0
        if self.corpus is None:
            return own
        return own | self.corpus.lookup(tokens, lengths, self.n_min, self.n_max, 1)[1][:, 0]

    def _match(self, toks, lens):
        """[B] int32: the end of the chosen earlier occurrence of each row's last n tokens
        in toks [B, S] (lens [B] tokens so far), -1 where none."""
        b, s = toks.shape
        p = jnp.arange(s)[None, :]  # candidate end of an earlier match
        match = jnp.ones((b, s), bool)
        best = jnp.full((b,), -1, jnp.int32)
        for i in range(self.n_max):
            # the i-th token back from p must equal the i-th token back from the end
            want = jnp.take_along_axis(toks, jnp.maximum(lens - 1 - i, 0)[:, None], axis=1)
            back = jnp.roll(toks, i, axis=1)
            match = match & (p - i >= 0) & (back == want) & (lens[:, None] - 1 - i >= 0)
            ok = match & (p < (lens - 1)[:, None])
            # tokens after p (capped at k), then recency: [B, S] scores
            after = jnp.minimum(lens[:, None] - 1 - p, self.k)
            score = jnp.where(ok, after * s + p, -1)
            pick = jnp.argmax(score, axis=1).astype(jnp.int32)
            found = (jnp.max(score, axis=1) >= 0) & (i + 1 >= self.n_min)  # n = i + 1
            best = jnp.where(found, pick, best)  # longer n overrides shorter
        return best
