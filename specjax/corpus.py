"""Text corpora: the embedded Python-stdlib corpus and user text / JSON-lines files.

A corpus is a list of documents (strings) split into train and held-out by a hash of
each document's text, so the split is deterministic, disjoint, and the same document
(a duplicate) always lands on the same side. Limits (`max_files`, `max_chars`) cut
the sorted document list before the split, so small runs read little.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sysconfig
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

STDLIB = "stdlib"
# Directories of the standard library that are not library source: installed
# packages, test suites, caches, and generated prose (pydoc's topic dump).
_STDLIB_SKIP = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                          "pydoc_data", "__pycache__"})
_HASH_BUCKETS = 10_000


@dataclasses.dataclass(frozen=True)
class CorpusConfig:
    """Where documents come from and how many to read.

    `source` is "stdlib" (the running Python's own standard library `.py` files) or a
    path / tuple of paths: `.jsonl` files give one document per line (`json_key`),
    any other file is one document, a directory contributes its files with
    `suffixes` (sorted, recursively).
    """

    source: str | tuple[str, ...] = STDLIB
    max_files: int | None = None  # documents read, in sorted order, before the split
    max_chars: int | None = None  # characters read in all; the last document is cut
    eval_fraction: float = 0.05  # share of documents (by text hash) held out
    json_key: str = "text"
    suffixes: tuple[str, ...] = (".txt", ".md", ".py", ".jsonl")

    def __post_init__(self):
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction={self.eval_fraction} must be in (0, 1)")
        for name in ("max_files", "max_chars"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be positive or None")
        if isinstance(self.source, list):
            object.__setattr__(self, "source", tuple(self.source))


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Documents after the split; `name` says where they came from."""

    train: tuple[str, ...]
    eval: tuple[str, ...]
    name: str


def stdlib_files(root: str | os.PathLike | None = None) -> list[Path]:
    """The standard library's `.py` files, sorted by relative path (deterministic)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP]
        found.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def is_held_out(text: str, eval_fraction: float) -> bool:
    """True if `text` belongs to the held-out split (a pure function of the text)."""
    bucket = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")
    return bucket % _HASH_BUCKETS < round(eval_fraction * _HASH_BUCKETS)


def split_documents(docs: Iterable[str], eval_fraction: float
                    ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(train, held-out) by text hash; order within each split is kept."""
    train, held = [], []
    for doc in docs:
        (held if is_held_out(doc, eval_fraction) else train).append(doc)
    return tuple(train), tuple(held)


def _user_files(source: Sequence[str], suffixes: Sequence[str]) -> list[Path]:
    files = []
    for entry in source:
        path = Path(entry)
        if path.is_dir():
            files.extend(sorted((p for p in path.rglob("*")
                                 if p.is_file() and p.suffix in suffixes),
                                key=lambda p: p.relative_to(path).as_posix()))
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"corpus source {str(path)!r} does not exist")
    return files


def _documents(files: Sequence[Path], json_key: str) -> Iterable[str]:
    for path in files:
        if path.suffix != ".jsonl":
            yield path.read_text(encoding="utf-8", errors="replace")
            continue
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    text = record[json_key]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{lineno}: expected a JSON object with a "
                                     f"string {json_key!r} field ({e!r})") from e
                if not isinstance(text, str):
                    raise ValueError(f"{path}:{lineno}: {json_key!r} is "
                                     f"{type(text).__name__}, expected str")
                yield text


def _limited(docs: Iterable[str], max_files: int | None, max_chars: int | None) -> list[str]:
    out, chars = [], 0
    for doc in docs:
        if (max_files is not None and len(out) >= max_files) or (
                max_chars is not None and chars >= max_chars):
            break
        if max_chars is not None:
            doc = doc[:max_chars - chars]
        if doc:
            out.append(doc)
            chars += len(doc)
    return out


def load_corpus(config: CorpusConfig = CorpusConfig()) -> Corpus:
    """Reads, limits and splits the documents `config` names."""
    if config.source == STDLIB:
        files, name = stdlib_files(), f"stdlib:{sysconfig.get_python_version()}"
    else:
        source = (config.source,) if isinstance(config.source, str) else config.source
        files, name = _user_files(source, config.suffixes), ",".join(map(str, source))
    docs = _limited(_documents(files, config.json_key), config.max_files, config.max_chars)
    if not docs:
        raise ValueError(f"corpus {name!r} has no non-empty documents")
    train, held = split_documents(docs, config.eval_fraction)
    if not train or not held:
        raise ValueError(
            f"corpus {name!r}: {len(docs)} documents split into {len(train)} train / "
            f"{len(held)} held-out; raise max_files/max_chars or change eval_fraction="
            f"{config.eval_fraction} so both splits are non-empty")
    return Corpus(train, held, name)


def encode_documents(tokenizer, documents: Sequence[str]) -> list[np.ndarray]:
    """Each document's token ids by `tokenizer` (a `tokenizers.Tokenizer`, no special
    tokens added), int32."""
    return [np.asarray(e.ids, np.int32)
            for e in tokenizer.encode_batch(list(documents), add_special_tokens=False)]


def token_counts(documents: Sequence[str], tokenizer, vocab_size: int) -> np.ndarray:
    """[vocab_size] int64: how often each id occurs in `documents` encoded by `tokenizer`
    (a `tokenizers.Tokenizer`, no special tokens added). A reduced vocabulary is the
    most frequent of these (`specjax.heads.build_vocab_map`): EAGLE-3's draft vocabulary
    and a trimmed draft model's LM head."""
    counts = np.zeros(vocab_size, np.int64)
    for ids in encode_documents(tokenizer, documents):
        if ids.size and ids.max() >= vocab_size:  # tokenizers' ids are unsigned
            raise ValueError(f"the tokenizer gives ids up to {int(ids.max())}, outside a "
                             f"vocabulary of vocab_size={vocab_size}")
        counts += np.bincount(ids, minlength=vocab_size)
    return counts


def heldout_prompts(corpus: Corpus, tokenizer, num: int, length: int,
                    seed: int) -> list[list[int]]:
    """`num` prompts of `length` tokens from held-out documents (never trained on)."""
    rng = np.random.default_rng(seed)
    docs = [tokenizer.encode(t).ids for t in corpus.eval]
    docs = [d for d in docs if len(d) > length + 8]
    if not docs:
        raise ValueError(f"no held-out document has more than {length + 8} tokens; lower "
                         f"prompt_len={length}")
    prompts = []
    for _ in range(num):
        d = docs[int(rng.integers(len(docs)))]
        start = int(rng.integers(0, len(d) - length))
        prompts.append(d[start:start + length])
    return prompts
