"""Target-generated training text: the target's own continuations of corpus prefixes,
written as a JSON-lines corpus that `specjax.corpus.CorpusConfig(source=...)` reads.

An EAGLE-style head (and a distilled draft) predicts the target's next token while the
target decodes its own output, so SpecForge and speculators train them on responses
the target regenerated rather than on the human text the prompts came from: the head
sees the features, loops and idioms it will draft for, and a reduced draft vocabulary
keeps the ids the target emits. Resumable: a killed run keeps its finished calls.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Sequence

import numpy as np

import specjax
from specjax.corpus import Corpus, encode_documents
from specjax.pysource import docstring_texts
from specjax.train.features import params_digest

log = logging.getLogger("specjax.train.regenerate")

PROMPT_STYLES = ("windows", "docstring")


@dataclasses.dataclass(frozen=True)
class RegenerateConfig:
    """How many continuations, of what, and how they are sampled."""

    prompts: int = 256  # continuations generated
    prompt_len: int = 64  # corpus tokens each continuation starts from (docstring: at most)
    # "windows": random windows of the training documents; "docstring": the `def` line(s)
    # and docstring of their functions, so the target writes bodies as HumanEval asks
    # (prompt_len/2 < length <= prompt_len tokens)
    prompt_style: str = "windows"
    new_tokens: int = 192  # tokens generated after each prompt (EOS ends one early)
    temperatures: tuple[float, ...] = (0.0, 1.0)  # cycled call by call
    batch: int = 16  # rows per `generate` call (one compiled program for all calls)
    seed: int = 0
    eval_fraction: float = 0.05  # continuations held out for the trainer's eval (by hash)

    def __post_init__(self):
        for name in ("prompts", "prompt_len", "new_tokens", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"RegenerateConfig.{name}={getattr(self, name)} must be >= 1")
        if self.prompt_style not in PROMPT_STYLES:
            raise ValueError(f"RegenerateConfig.prompt_style={self.prompt_style!r} must be one "
                             f"of {PROMPT_STYLES}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"RegenerateConfig.eval_fraction={self.eval_fraction} must be "
                             "in (0, 1)")
        if not self.temperatures or min(self.temperatures) < 0:
            raise ValueError(f"RegenerateConfig.temperatures={self.temperatures} must be a "
                             "non-empty tuple of temperatures >= 0")
        if isinstance(self.temperatures, list):
            object.__setattr__(self, "temperatures", tuple(self.temperatures))


def prefixes(docs: Sequence[np.ndarray], prompt_len: int, num: int, stride: int,
             seed: int) -> list[list[int]]:
    """`num` windows of `prompt_len` tokens, drawn at random (seeded) from the windows
    starting every `stride` tokens of the documents' ids; an error when there are fewer."""
    windows = [(d, s) for d, ids in enumerate(docs)
               for s in range(0, len(ids) - prompt_len + 1, stride)]
    if len(windows) < num:
        raise ValueError(f"the corpus's training documents give {len(windows)} prompts of "
                         f"{prompt_len} tokens (one every {stride} tokens); {num} asked: "
                         "use a larger corpus or fewer prompts")
    pick = np.random.default_rng(seed).permutation(len(windows))[:num]
    return [docs[windows[i][0]][windows[i][1]:windows[i][1] + prompt_len].tolist()
            for i in sorted(pick)]


def docstring_prompts(tokenizer, docs: Sequence[str], num: int, max_len: int,
                      seed: int) -> list[list[int]]:
    """`num` prompts drawn at random (seeded) from the documents' functions, each its
    `def` line(s) and docstring in max_len/2 < length <= max_len tokens, in source order;
    an error when fewer fit."""
    texts = [t for doc in docs for t in docstring_texts(doc)]
    ids = [e.ids for e in tokenizer.encode_batch(texts)] if texts else []
    fits = [x for x in ids if max_len // 2 < len(x) <= max_len]
    if len(fits) < num:
        raise ValueError(f"the training documents' functions give {len(fits)} docstring "
                         f"prompts of {max_len // 2 + 1}..{max_len} tokens ({len(texts)} "
                         f"with a docstring); {num} asked: use a larger corpus (e.g. "
                         "CorpusConfig.max_files=None), a longer prompt_len or fewer prompts")
    # the stream `specjax.bench.prompts` draws its docstring category from ([seed, 1]);
    # test_train_regenerate checks that the two draws agree
    pick = np.random.default_rng([seed, 1]).choice(len(fits), size=num, replace=False)
    return [fits[i] for i in sorted(pick.tolist())]


def training_prompts(tokenizer, corpus: Corpus, config: RegenerateConfig) -> list[list[int]]:
    """`config.prompts` prompts (token ids) of `config.prompt_style` from `corpus`'s
    training documents."""
    if config.prompt_style == "docstring":
        return docstring_prompts(tokenizer, corpus.train, config.prompts, config.prompt_len,
                                 config.seed)
    return prefixes(encode_documents(tokenizer, corpus.train), config.prompt_len,
                    config.prompts, config.prompt_len + config.new_tokens, config.seed)


def _settings_path(path: Path) -> Path:
    return path.with_name(path.name + ".settings.json")


def _finished_rows(path: Path, settings: dict, batch: int, total: int) -> int:
    """Rows already in `path` from whole calls of a run with the same `settings` (all
    `total` when finished); a partial call's lines (a killed write) are cut, so the call
    runs again whole; another run's file is started afresh."""
    meta = _settings_path(path)
    if not path.exists() or not meta.exists() or json.loads(meta.read_text()) != settings:
        path.write_text("", encoding="utf-8")
        meta.write_text(json.dumps(settings, indent=2))
        return 0
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    keep = [line for line in lines if line.endswith("\n")]
    rows = total if len(keep) >= total else len(keep) // batch * batch
    if len(lines) != rows:
        path.write_text("".join(keep[:rows]), encoding="utf-8")
    return rows


def regenerate(target: specjax.Model, corpus: Corpus, config: RegenerateConfig,
               path: str | Path) -> Path:
    """Writes `config.prompts` JSON lines to `path`, each {"text": prompt + the target's
    continuation, decoded, "temperature": T}, from prefixes of `corpus`'s training
    documents (never its held-out ones). Resumes after the last finished call of a run
    with the same settings, target and corpus (`<path>.settings.json`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok = target.tokenizer
    prompts = training_prompts(tok, corpus, config)
    settings = json.loads(json.dumps(dict(  # as the settings file reads back (lists)
        dataclasses.asdict(config), corpus=corpus.name, documents=len(corpus.train),
        params=params_digest(target.params))))
    start = _finished_rows(path, settings, config.batch, len(prompts))
    calls = range(start, len(prompts), config.batch)
    t0, made = time.perf_counter(), 0
    for c in calls:
        rows = prompts[c:c + config.batch]
        temp = config.temperatures[(c // config.batch) % len(config.temperatures)]
        out = specjax.generate(target, rows, max_new_tokens=config.new_tokens,
                               temperature=temp, seed=[config.seed + c + i for i in range(
                                   len(rows))] if temp > 0 else config.seed)
        with open(path, "a", encoding="utf-8") as f:
            for prompt, new in zip(rows, out.tokens):
                text = tok.decode(prompt + new, skip_special_tokens=True)
                f.write(json.dumps({"text": text, "temperature": temp}) + "\n")
        made += sum(map(len, out.tokens))
        log.info("regenerated %d/%d continuations (%.0f tokens/s)", c + len(rows),
                 len(prompts), made / (time.perf_counter() - t0))
    return path
