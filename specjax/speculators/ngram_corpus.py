"""`CorpusIndex`: n-gram lookup into a fixed token corpus, for `NGram(corpus=)`.

Prompt lookup finds continuations only in the row's own tokens. A model also repeats
itself across requests: the same phrasing, the same closing lines. SuffixDecoding
(vLLM's `suffix` method) and REST draft from earlier outputs or a datastore for that
reason. Here the corpus is a list of token sequences, for example the target's own
continuations of training prompts (`train.regenerate`).

The index is built once on the host. For each n in 1..n_max, a direct-mapped hash table
maps an n-gram to the position right after one of its occurrences: the one followed by
the n-gram's most frequent continuation in the corpus, as SuffixDecoding drafts the most
frequent path of its suffix tree (the first occurrence's continuation is right less
often: docs/benchmarks.md, "n-gram over a corpus"). On device
a lookup costs one table read and one check per n, whatever the corpus size. A scan of
the corpus at every step would cost time in proportion to it. A hash collision is
caught by comparing the n tokens themselves, and then there is no draft. None of jax,
numpy or the tokenizers library ships such an index, so it is written here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

# Multiplier of the polynomial hash over token ids. uint32 arithmetic wraps the same way
# on the host (numpy) and on device (jax).
_PRIME = np.uint32(1_000_003)
_SEP = -1  # between documents: no n-gram and no draft crosses it
# A continuation token that fewer than this share of the n-gram's occurrences (agreeing
# up to it) go on with is not drafted: the largest cut that keeps the verify work saved
# on SmolLM2's prompts, with fewer drafts and more of them right (`python -m
# specjax.bench.corpus_drafts`; docs/benchmarks.md, "n-gram over a corpus").
MIN_SHARE = 0.3


def _most_frequent(flat: np.ndarray, ends: np.ndarray, group: np.ndarray,
                   depth: int) -> tuple[np.ndarray, np.ndarray]:
    """For each group of occurrences (ends [N], ascending positions in flat [C]; group
    [N] in 0..G-1): the position [G] whose next `depth` tokens follow the group's most
    frequent path, and each path token's share [G, depth] of the occurrences that agree
    up to it. At each step the path takes the token seen most often after the
    occurrences that agree so far (ties: the one seen first), then the earliest such
    occurrence. A document's end (-1) counts as a token. SuffixDecoding drafts this path
    from its suffix tree's counts; here it is found once, when the index is built."""
    alive = np.ones(ends.size, bool)
    stopped = np.zeros(ends.size, bool)
    shares = np.zeros((int(group.max()) + 1, depth))
    for j in range(depth):
        tok = flat[np.minimum(ends + j, flat.size - 1)].astype(np.int64)
        stopped |= (ends + j >= flat.size) | (tok < 0)
        tok = np.where(stopped, -1, tok)
        at = np.flatnonzero(alive)
        key = group[at].astype(np.int64) * (int(flat.max()) + 2) + tok[at] + 1
        keys, first, counts = np.unique(key, return_index=True, return_counts=True)
        owner = group[at][first]
        # per group: the most counted key, the earliest seen among equals
        best = np.lexsort((first, -counts, owner))
        pick = best[np.unique(owner[best], return_index=True)[1]]  # one per group, in order
        shares[:, j] = counts[pick] / np.bincount(group[at], minlength=shares.shape[0])
        alive[at] = np.isin(key, keys[pick])
    idx = np.flatnonzero(alive)
    return ends[idx[np.unique(group[idx], return_index=True)[1]]], shares


def _hash(grams: np.ndarray) -> np.ndarray:
    """[..., n] int token ids -> [...] uint32 polynomial hash (numpy)."""
    h = np.zeros(grams.shape[:-1], np.uint32)
    for i in range(grams.shape[-1]):
        h = h * _PRIME + grams[..., i].astype(np.uint32)
    return h


def _hash_jnp(grams: jax.Array) -> jax.Array:
    """`_hash` on device: [..., n] int32 -> [...] uint32."""
    h = jnp.zeros(grams.shape[:-1], jnp.uint32)
    for i in range(grams.shape[-1]):
        h = h * jnp.uint32(_PRIME) + grams[..., i].astype(jnp.uint32)
    return h


@struct.dataclass
class CorpusIndex:
    """tokens: [C] int32, the documents joined with -1 after each one. slots: [n_max, H]
    int32. Row n - 1 maps each n-gram's hash (mod H, a power of two) to the corpus
    position right after the occurrence with its most frequent continuation, or -1 where
    no n-gram hashes there. spans: [n_max, H] int8, how many tokens of that continuation
    are drafted: those up to the first whose share falls below the build's `min_share`
    (0: the n-gram drafts nothing)."""

    tokens: jax.Array
    slots: jax.Array
    spans: jax.Array

    @property
    def n_max(self) -> int:
        return int(self.slots.shape[0])

    @classmethod
    def build(cls, documents: Sequence[Sequence[int]], n_max: int = 3,
              vocab_size: int | None = None, depth: int = 4,
              min_share: float = MIN_SHARE) -> "CorpusIndex":
        """The index of `documents` (token-id lists) for n-grams of 1..n_max tokens,
        each mapped to its most frequent continuation over `depth` tokens
        (`_most_frequent`), drafted up to the first token that fewer than `min_share` of
        the n-gram's occurrences agreeing so far go on with. A table has at least twice
        as many slots as the corpus has tokens, so few n-grams collide. vocab_size: when
        given, every id must lie in [0, vocab_size)."""
        if n_max < 1 or not 1 <= depth <= 127:
            raise ValueError(f"CorpusIndex n_max={n_max} must be >= 1 and depth={depth} "
                             "in 1..127")
        if not 0 <= min_share <= 1:
            raise ValueError(f"CorpusIndex min_share={min_share} must lie in [0, 1]")
        docs = [np.asarray(d, np.int64).reshape(-1) for d in documents]
        docs = [d for d in docs if d.size]
        if not docs:
            raise ValueError("CorpusIndex needs at least one non-empty document")
        for i, d in enumerate(docs):
            if d.min() < 0 or (vocab_size is not None and d.max() >= vocab_size):
                raise ValueError(f"CorpusIndex document {i} holds token id "
                                 f"{int(d.min() if d.min() < 0 else d.max())}, outside "
                                 f"[0, {vocab_size if vocab_size is not None else 'inf'})")
        flat = np.concatenate([np.append(d, _SEP) for d in docs])
        size = 1 << max(int(2 * flat.size - 1).bit_length(), 4)
        slots = np.full((n_max, size), -1, np.int32)
        spans = np.zeros((n_max, size), np.int8)
        for n in range(1, n_max + 1):
            # n-gram ending at p - 1, followed by the token at p (a continuation exists)
            ends = np.arange(n, flat.size)
            grams = np.stack([flat[ends - n + i] for i in range(n)], axis=-1)
            ok = (grams >= 0).all(axis=-1) & (flat[ends] >= 0)
            ends, grams = ends[ok], grams[ok]
            if not ends.size:  # no document is longer than n
                continue
            # [G] each distinct n-gram's first occurrence, [N] each occurrence's n-gram
            _, first, group = np.unique(grams, axis=0, return_index=True,
                                        return_inverse=True)
            group = group.reshape(-1)
            chosen, shares = _most_frequent(flat, ends, group, depth)  # [G], [G, depth]
            span = np.cumprod(shares >= min_share, axis=1).sum(axis=1)  # [G]
            where = (_hash(grams[first]) & np.uint32(size - 1)).astype(np.int64)
            # of the n-grams that collide in a slot, the one that occurs first keeps it
            order = np.argsort(first, kind="stable")
            kept = order[np.unique(where[order], return_index=True)[1]]
            slots[n - 1, where[kept]] = chosen[kept]
            spans[n - 1, where[kept]] = span[kept]
        return cls(tokens=jnp.asarray(flat, jnp.int32), slots=jnp.asarray(slots),
                   spans=jnp.asarray(spans))

    def lookup(self, tokens: jax.Array, lengths: jax.Array, n_min, n_max: int,
               k: int) -> tuple[jax.Array, jax.Array]:
        """The corpus's continuation of each row's last n tokens, for the longest n in
        n_min..n_max found: (drafts [B, k] int32, valid [B, k] bool, a prefix of each
        row: up to the n-gram's span or the end of the corpus document). tokens [B, S],
        lengths [B]."""
        if n_max > self.n_max:
            raise ValueError(f"NGram n_max={n_max} exceeds the corpus index's n_max="
                             f"{self.n_max}; build it with n_max >= {n_max}")
        c = self.tokens.shape[0]
        mask = jnp.uint32(self.slots.shape[1] - 1)
        start = jnp.full(lengths.shape, -1, jnp.int32)
        span = jnp.zeros(lengths.shape, jnp.int32)
        for n in range(1, n_max + 1):
            back = jnp.maximum(lengths[:, None] - n + jnp.arange(n)[None, :], 0)
            gram = jnp.take_along_axis(tokens, back, axis=1)  # [B, n], the last n tokens
            slot = (_hash_jnp(gram) & mask).astype(jnp.int32)  # [B]
            pos = self.slots[n - 1][slot]
            at = jnp.clip(pos[:, None] - n + jnp.arange(n)[None, :], 0, c - 1)
            same = jnp.all(self.tokens[at] == gram, axis=1)
            found = (pos >= 0) & same & (lengths >= n) & (n >= n_min)
            start = jnp.where(found, pos, start)  # a longer n overrides a shorter one
            span = jnp.where(found, self.spans[n - 1][slot].astype(jnp.int32), span)
        steps = jnp.arange(k)[None, :]
        drafts = self.tokens[jnp.clip(start[:, None] + steps, 0, c - 1)]
        valid = ((start[:, None] >= 0) & (steps < span[:, None])
                 & (jnp.cumprod(drafts >= 0, axis=1) > 0))
        return jnp.maximum(drafts, 0), valid


def read_corpus(path: str | Path, tokenizer=None) -> list[list[int]]:
    """Token ids from each JSON line of `path` (blank lines skipped): its 'ids' (a list of
    ints, used as is) or its 'text' (a string, tokenized by `tokenizer`, a
    `tokenizers.Tokenizer`, without special tokens), as `specjax.train.regenerate` writes
    them. Any other line, or a text without a tokenizer, is an error naming the file and
    line."""
    texts, docs = [], []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from e
        ids = entry.get("ids") if isinstance(entry, dict) else None
        text = entry.get("text") if isinstance(entry, dict) else None
        if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
            docs.append(ids)
        elif isinstance(text, str):
            if tokenizer is None:
                raise ValueError(f"{path}:{n}: a 'text' line needs the model's tokenizer")
            texts.append((len(docs), text))
            docs.append(None)
        else:
            raise ValueError(f"{path}:{n}: needs 'ids' (a list of ints) or 'text' (a string)")
    if not docs:
        raise ValueError(f"{path}: no texts")
    if texts:
        encoded = tokenizer.encode_batch([t for _, t in texts], add_special_tokens=False)
        for (i, _), e in zip(texts, encoded):
            docs[i] = e.ids
    return docs
