"""The run directory `specjax bench suite` reads: a quickstart or recipe run's target,
draft and heads, and the corpus its held-out prompts come from."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

# Which workdir files each method needs (besides the target, always needed).
_NEEDS = {"draft": ("draft",), "hf_assistant": ("draft",), "llamacpp_draft": ("draft",),
          "medusa": ("medusa",), "eagle": ("eagle",), "ngram_eagle": ("eagle",)}


@dataclasses.dataclass(frozen=True)
class Workdir:
    """The paths of a quickstart run directory that the suite reads."""

    target: Path
    draft: Path
    draft_vocab: Path  # the draft's trimmed vocabulary, where the quickstart wrote one
    medusa: Path
    eagle: Path
    done: Path  # target/DONE.json: the stage settings, corpus included

    @classmethod
    def check(cls, workdir: str | Path, methods) -> "Workdir":
        """Raises FileNotFoundError naming every missing file the `methods` need."""
        from specjax.bench.speculative import workdir_paths

        w = Path(workdir)
        if not w.is_dir():
            raise FileNotFoundError(f"--workdir {str(w)!r} is not a directory (a quickstart "
                                    "run: specjax run configs/experiments/quickstart.gin)")
        paths = cls(**workdir_paths(w), done=w / "target" / "DONE.json")
        need = [paths.target / "config.json", paths.target / "tokenizer.json", paths.done]
        for method in methods:
            for part in _NEEDS.get(method, ()):
                d = getattr(paths, part)
                need.append(d / ("config.json" if part == "draft" else "heads.json"))
        missing = list(dict.fromkeys(str(p) for p in need if not p.exists()))
        if missing:
            raise FileNotFoundError(f"--workdir {str(w)!r} lacks {', '.join(missing)} (needed "
                                    f"by --methods {','.join(methods)})")
        return paths

    def target_source(self) -> Path:
        """The GGUF file the target stage converted (target/DONE.json's settings.target)."""
        try:
            source = json.loads(self.done.read_text())["settings"]["target"]["source"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{self.done}: no settings.target.source ({e!r}); llamacpp_q4_1 "
                             "needs the GGUF file the target came from") from e
        if not (Path(source).is_file() and Path(source).suffix == ".gguf"):
            raise ValueError(f"{self.done}: the target came from {source!r}, not a GGUF file; "
                             "llamacpp_q4_1 needs one")
        return Path(source)

    def heldout_documents(self) -> tuple[list[str], str]:
        """The held-out documents of the corpus the run trained on, and its config. For a
        pretrained target (the real-target quickstart) the whole corpus's held-out split,
        as its comparison draws them: the split is by document hash, so no document of
        it was in the smaller training subset."""
        corpus, config = self.corpus()
        return list(corpus.eval), repr(config)

    def corpus(self):
        """(`specjax.corpus.Corpus`, its `CorpusConfig`): the corpus whose held-out split
        `heldout_documents` gives, both splits."""
        from specjax.corpus import CorpusConfig, load_corpus

        try:
            settings = json.loads(self.done.read_text())["settings"]
            corpus = settings["data"]["corpus"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{self.done}: no settings.data.corpus ({e!r})") from e
        config = CorpusConfig(**corpus)
        if "target" in settings:  # not trained on the corpus: widen to all of it
            config = dataclasses.replace(config, max_files=None, max_chars=None)
        return load_corpus(config), config
