"""Packed token sequences and a step-addressed batch order.

Documents become `<|bos|> ids <|eos|>` and are concatenated and cut into rows of
`seq_len` tokens (the remainder is dropped). Training batches are addressed by step:
example `i = step * batch_size + j` is row `perm_e[i % n]` of epoch `e = i // n`, where
`perm_e` is a permutation keyed by `(seed, e)`. A run resumed at step s therefore sees
exactly the batches an uninterrupted run sees. Held-out batches are the eval rows in
order; the last one is padded (mask 0) so every batch has one static shape.

Batch layout, for every method: `{"tokens": int32 [B, T], "mask": float32 [B, T]}`,
mask 1 where the token is real.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any, Sequence

import numpy as np

from specjax.corpus import Corpus, CorpusConfig, encode_documents, load_corpus
from specjax.train import tokenizer as tok_lib


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Corpus plus packing: what a run trains and evaluates on."""

    corpus: CorpusConfig = CorpusConfig()
    seq_len: int = 256
    # At most this many training rows, evenly spaced over the packed split (None: all):
    # fewer distinct rows, which a run on offline features passes over several times
    # for the price of one target forward each.
    train_rows: int | None = None

    def __post_init__(self):
        if self.seq_len < 2:
            raise ValueError(f"seq_len={self.seq_len} must be at least 2")
        if self.train_rows is not None and self.train_rows < 1:
            raise ValueError(f"train_rows={self.train_rows} must be at least 1 (or None)")


def pack(docs: Sequence[np.ndarray], seq_len: int, bos: int | None, eos: int | None
         ) -> np.ndarray:
    """int32 [N, seq_len]: documents framed by bos/eos, concatenated, cut into rows."""
    pieces = []
    for ids in docs:
        if bos is not None:
            pieces.append(np.asarray([bos], np.int32))
        pieces.append(np.asarray(ids, np.int32))
        if eos is not None:
            pieces.append(np.asarray([eos], np.int32))
    stream = np.concatenate(pieces) if pieces else np.zeros((0,), np.int32)
    n = len(stream) // seq_len
    return stream[:n * seq_len].reshape(n, seq_len)


@functools.lru_cache(maxsize=8)
def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """The order of the n rows in `epoch`; a pure function of (n, seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def batch_rows(step: int, batch_size: int, n: int, seed: int) -> np.ndarray:
    """Row indices of training batch `step` (epochs wrap mid-batch without a gap)."""
    example = step * batch_size + np.arange(batch_size)
    epochs, offsets = np.divmod(example, n)
    return np.asarray([epoch_permutation(n, seed, int(e))[o] for e, o in zip(epochs, offsets)])


@dataclasses.dataclass(frozen=True, eq=False)
class TokenData:
    """Train and held-out rows, and the batch order. The trainer's data interface."""

    train: np.ndarray  # [N, T] int32
    eval: np.ndarray  # [M, T] int32
    pad_id: int
    seed: int
    name: str = ""
    tokenizer_fingerprint: str = ""

    def __post_init__(self):
        for split, rows in (("train", self.train), ("eval", self.eval)):
            if len(rows) == 0:
                raise ValueError(f"{self.name or 'data'}: the {split} split packs into no "
                                 f"sequences of {self.seq_len} tokens; use a larger corpus "
                                 f"or a smaller seq_len")

    @property
    def seq_len(self) -> int:
        return self.train.shape[1]

    def train_rows(self, step: int, batch_size: int) -> np.ndarray:
        """Indices into `train` of the rows of training batch `step`."""
        return batch_rows(step, batch_size, len(self.train), self.seed)

    def train_batch(self, step: int, batch_size: int) -> dict[str, np.ndarray]:
        tokens = self.train[self.train_rows(step, batch_size)]
        return {"tokens": tokens, "mask": np.ones(tokens.shape, np.float32)}

    def eval_slices(self, batch_size: int, max_batches: int | None = None) -> list[slice]:
        """The `eval` rows of each held-out batch, in order (the last may be short)."""
        starts = range(0, len(self.eval), batch_size)
        if max_batches is not None:
            starts = starts[:max_batches]
        return [slice(s, min(s + batch_size, len(self.eval))) for s in starts]

    def eval_batches(self, batch_size: int, max_batches: int | None = None
                     ) -> list[dict[str, np.ndarray]]:
        """Held-out rows in order, `batch_size` at a time (at most `max_batches`); the
        last batch is padded to `batch_size` rows with mask 0."""
        out = []
        for rows in self.eval_slices(batch_size, max_batches):
            n = rows.stop - rows.start
            mask = np.zeros((batch_size, self.seq_len), np.float32)
            mask[:n] = 1.0
            tokens = np.full((batch_size, self.seq_len), self.pad_id, np.int32)
            tokens[:n] = self.eval[rows]
            out.append({"tokens": tokens, "mask": mask})
        return out

    def describe(self) -> dict[str, Any]:
        """What a resumed run must match: the rows (by hash), the order seed, the tokenizer."""
        digest = hashlib.sha256(self.train.tobytes()).hexdigest()[:16]
        return {"name": self.name, "seq_len": self.seq_len, "train_rows": len(self.train),
                "eval_rows": len(self.eval), "train_sha256": digest, "seed": self.seed,
                "tokenizer": self.tokenizer_fingerprint}


def tokenize_corpus(corpus: Corpus, tokenizer, seq_len: int, seed: int) -> TokenData:
    """Encodes and packs both splits of `corpus` with `tokenizer`."""
    ids = tok_lib.special_ids(tokenizer)
    train = pack(encode_documents(tokenizer, corpus.train), seq_len, ids.bos, ids.eos)
    held = pack(encode_documents(tokenizer, corpus.eval), seq_len, ids.bos, ids.eos)
    return TokenData(train, held, ids.pad, seed, corpus.name, tok_lib.fingerprint(tokenizer))


def build_data(config: DataConfig, tokenizer, seed: int) -> TokenData:
    data = tokenize_corpus(load_corpus(config.corpus), tokenizer, config.seq_len, seed)
    n = len(data.train)
    if config.train_rows is None or config.train_rows >= n:
        return data
    keep = np.linspace(0, n - 1, config.train_rows).round().astype(np.int64)  # distinct
    return dataclasses.replace(data, train=data.train[keep])
