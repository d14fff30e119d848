"""Byte-level BPE tokenizers trained with the `tokenizers` library.

Byte-level means every string round-trips exactly (`decode(encode(s)) == s`): the
alphabet is the 256 bytes, merges only shorten. The three special tokens take ids
0, 1, 2 in a fresh tokenizer; callers read them with `special_ids` because a
tokenizer from elsewhere (a target's `tokenizer.json`) may place them differently.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, PAD)


@dataclasses.dataclass(frozen=True)
class SpecialIds:
    bos: int | None
    eos: int | None
    pad: int


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    """A ByteLevel BPE tokenizer with at most `vocab_size` tokens (specials included)."""
    floor = len(pre_tokenizers.ByteLevel.alphabet()) + len(SPECIAL_TOKENS)
    if vocab_size < floor:
        raise ValueError(f"vocab_size={vocab_size} must be at least {floor} "
                         f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on bad files
        raise ValueError(f"{path}: cannot read tokenizer ({e})") from e


def special_ids(tok: Tokenizer) -> SpecialIds:
    """Ids of bos/eos/pad. A foreign tokenizer without pad pads with eos (never trained on)."""
    bos, eos, pad = (tok.token_to_id(t) for t in SPECIAL_TOKENS)
    if pad is None:
        pad = eos if eos is not None else 0
    return SpecialIds(bos, eos, pad)


def fingerprint(tok: Tokenizer) -> str:
    """A short hash of the tokenizer's JSON, so a run can tell if its tokenizer changed."""
    return hashlib.sha256(tok.to_str().encode()).hexdigest()[:16]
