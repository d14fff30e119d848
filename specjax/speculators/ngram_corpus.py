"""`CorpusIndex`: n-gram lookup into a fixed token corpus, for `NGram(corpus=)`.

Prompt lookup finds continuations only in the row's own tokens. A model also repeats
itself across requests: the same phrasing, the same closing lines. SuffixDecoding
(vLLM's `suffix` method) and REST draft from earlier outputs or a datastore for that
reason. Here the corpus is a list of token sequences, for example the target's own
continuations of training prompts (`train.regenerate`).

The index is built once on the host. For each n in 1..n_max, a direct-mapped hash table
maps an n-gram to the position right after its first occurrence in the corpus. On device
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
    position right after its first occurrence, or -1 where no n-gram hashes there."""

    tokens: jax.Array
    slots: jax.Array

    @property
    def n_max(self) -> int:
        return int(self.slots.shape[0])

    @classmethod
    def build(cls, documents: Sequence[Sequence[int]], n_max: int = 3,
              vocab_size: int | None = None) -> "CorpusIndex":
        """The index of `documents` (token-id lists) for n-grams of 1..n_max tokens. A
        table has at least twice as many slots as the corpus has tokens, so few n-grams
        collide. vocab_size: when given, every id must lie in [0, vocab_size)."""
        if n_max < 1:
            raise ValueError(f"CorpusIndex n_max={n_max} must be >= 1")
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
        for n in range(1, n_max + 1):
            # n-gram ending at p - 1, followed by the token at p (a continuation exists)
            ends = np.arange(n, flat.size)
            grams = np.stack([flat[ends - n + i] for i in range(n)], axis=-1)
            ok = (grams >= 0).all(axis=-1) & (flat[ends] >= 0)
            ends, grams = ends[ok], grams[ok]
            where = (_hash(grams) & np.uint32(size - 1)).astype(np.int64)
            # the first occurrence wins its slot; a later n-gram that collides is not kept
            first = np.unique(where, return_index=True)[1]
            slots[n - 1, where[first]] = ends[first]
        return cls(tokens=jnp.asarray(flat, jnp.int32), slots=jnp.asarray(slots))

    def lookup(self, tokens: jax.Array, lengths: jax.Array, n_min, n_max: int,
               k: int) -> tuple[jax.Array, jax.Array]:
        """The corpus's continuation of each row's last n tokens, for the longest n in
        n_min..n_max found: (drafts [B, k] int32, valid [B, k] bool, a prefix of each
        row: up to the end of the corpus document). tokens [B, S], lengths [B]."""
        if n_max > self.n_max:
            raise ValueError(f"NGram n_max={n_max} exceeds the corpus index's n_max="
                             f"{self.n_max}; build it with n_max >= {n_max}")
        c = self.tokens.shape[0]
        mask = jnp.uint32(self.slots.shape[1] - 1)
        start = jnp.full(lengths.shape, -1, jnp.int32)
        for n in range(1, n_max + 1):
            back = jnp.maximum(lengths[:, None] - n + jnp.arange(n)[None, :], 0)
            gram = jnp.take_along_axis(tokens, back, axis=1)  # [B, n], the last n tokens
            pos = self.slots[n - 1][(_hash_jnp(gram) & mask).astype(jnp.int32)]  # [B]
            at = jnp.clip(pos[:, None] - n + jnp.arange(n)[None, :], 0, c - 1)
            same = jnp.all(self.tokens[at] == gram, axis=1)
            found = (pos >= 0) & same & (lengths >= n) & (n >= n_min)
            start = jnp.where(found, pos, start)  # a longer n overrides a shorter one
        idx = jnp.clip(start[:, None] + jnp.arange(k)[None, :], 0, c - 1)
        drafts = self.tokens[idx]
        valid = (start[:, None] >= 0) & (jnp.cumprod(drafts >= 0, axis=1) > 0)
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
