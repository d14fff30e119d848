"""Whole training jobs: data + method + trainer + export, as plain functions.

gin configures these (see configs/ and `specjax.train.run`), but they take ordinary Python
values, so scripts and tests call them directly. Each job writes into one workdir and
resumes there when re-run; a finished job exports a Hugging Face directory to
`<workdir>/export` (config.json, model.safetensors, tokenizer.json).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from specjax.checkpoint import load, save_hf
from specjax.config import ModelConfig
from specjax.corpus import CorpusConfig, heldout_prompts, load_corpus, token_counts
from specjax.heads import EagleConfig, MedusaConfig, build_vocab_map, save_heads, target_fingerprint
from specjax.model import Model
from specjax.sharding import make_mesh
from specjax.speculators import head_speculator
from specjax.train import (
    features as features_lib,
    regenerate as regenerate_lib,
    tokenizer as tok_lib,
)
from specjax.train.data import DataConfig, build_data, tokenize_corpus
from specjax.train.methods import Distill, Pretrain, TrainEagle, TrainMedusa
from specjax.train.regenerate import RegenerateConfig
from specjax.train.speculation import SpeculativeEval, speculative_run
from specjax.train.trainer import (
    DATA_AXIS,
    METRICS_FILE,
    MetricsLog,
    TrainConfig,
    TrainResult,
    train,
)

log = logging.getLogger("specjax.train")
TOKENIZER_FILE = "tokenizer.json"
EXPORT_DIR = "export"


@dataclasses.dataclass
class JobResult:
    workdir: Path
    export_dir: Path | None  # None until the run has finished
    train: TrainResult
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)  # heads: α, τ, eval


def data_parallel_mesh(devices=None) -> Mesh:
    """A 1-D mesh with a `data` axis over `devices` (default: all of them)."""
    return Mesh(np.asarray(devices if devices is not None else jax.devices()), (DATA_AXIS,))


def job_mesh(data_parallel: bool = False, mesh_shape: Mapping[str, int] | None = None
             ) -> Mesh | None:
    """The mesh a job trains on: `mesh_shape` over all (global) devices, e.g.
    {"data": -1, "model": 4} (`specjax.make_mesh`; the target, heads and draft are then
    split over `model` by the rules table), else a 1-D `data` mesh if `data_parallel`."""
    if mesh_shape is not None:
        return make_mesh(dict(mesh_shape))
    return data_parallel_mesh() if data_parallel else None


def _run_tokenizer(workdir: Path, texts, vocab_size: int, tokenizer_path, min_frequency: int):
    """The run's tokenizer: its own saved one on resume, else the given one, else a new BPE."""
    own = workdir / TOKENIZER_FILE
    if own.exists():
        return tok_lib.load_tokenizer(own)
    if tokenizer_path is not None:
        tok = tok_lib.load_tokenizer(tokenizer_path)
    else:
        tok = tok_lib.train_bpe(texts, vocab_size, min_frequency)
    tok.save(str(own))
    return tok


def _export(result: TrainResult, config: ModelConfig, tokenizer) -> Path | None:
    if not result.finished:
        return None
    out = result.workdir / EXPORT_DIR
    save_hf(Model(config, result.params, tokenizer), out)
    log.info("exported %s", out)
    return out


def _settings(job: str, data_config: DataConfig, **extra: Any) -> dict[str, Any]:
    return {"job": job, "data_config": dataclasses.asdict(data_config), **extra}


def load_target(target_dir, what: str, expect_target: ModelConfig | None = None,
                 mesh: Mesh | None = None) -> Model:
    """The float32 target at `target_dir` with its tokenizer, placed on `mesh` if given;
    with `expect_target`, an error naming every shape that differs from it."""
    target = load(target_dir, dtype="float32", mesh=mesh)
    if target.tokenizer is None:
        raise FileNotFoundError(f"{target_dir} has no tokenizer.json; {what} needs the "
                                f"target's tokenizer")
    if expect_target is not None:
        have, want = target_fingerprint(target.config), target_fingerprint(expect_target)
        bad = [f"{k}={have[k]!r} (expected {want[k]!r})" for k in want if have[k] != want[k]]
        if bad:
            raise ValueError(f"the target at {target_dir} is not the expected model "
                             f"(expect_target): " + ", ".join(bad))
    return target


def pretrain(workdir: str | Path, model_config: ModelConfig, train_config: TrainConfig,
             data_config: DataConfig = DataConfig(), *, tokenizer_path: str | None = None,
             tokenizer_min_frequency: int = 2, data_parallel: bool = False,
             mesh_shape: Mapping[str, int] | None = None,
             stop_at: int | None = None) -> JobResult:
    """Pretrains a target from scratch with next-token CE.

    The tokenizer is `tokenizer_path` or a ByteLevel BPE of `model_config.vocab_size`
    tokens trained on the corpus's train split; either way it is saved to
    `<workdir>/tokenizer.json` and reused on resume.
    """
    workdir = Path(workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus(data_config.corpus)
    tok = _run_tokenizer(workdir, corpus.train, model_config.vocab_size, tokenizer_path,
                         tokenizer_min_frequency)
    if tok.get_vocab_size() > model_config.vocab_size:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} tokens but model_config."
                         f"vocab_size={model_config.vocab_size}")
    ids = tok_lib.special_ids(tok)
    model_config = model_config.replace(bos_token_id=ids.bos, eos_token_id=ids.eos)
    data = tokenize_corpus(corpus, tok, data_config.seq_len, train_config.seed)
    result = train(Pretrain(model_config), data, train_config, workdir,
                   mesh=job_mesh(data_parallel, mesh_shape), stop_at=stop_at,
                   settings=_settings("pretrain", data_config, tokenizer_path=tokenizer_path))
    return JobResult(workdir, _export(result, model_config, tok), result)


def distill(workdir: str | Path, target_dir: str | Path, draft_config: ModelConfig,
            train_config: TrainConfig, data_config: DataConfig = DataConfig(), *,
            divergence: str = "tvd", temperature: float = 1.0, source: str = "corpus",
            prompt_len: int = 16, sample_temperature: float = 1.0,
            draft_init_dir: str | Path | None = None, vocab=None, features: str = "online",
            features_dir: str | Path | None = None, features_dtype: str = "float32",
            data_parallel: bool = False, mesh_shape: Mapping[str, int] | None = None,
            stop_at: int | None = None) -> JobResult:
    """Distills the target at `target_dir` (HF layout with tokenizer.json) into a draft.

    The draft takes the target's vocabulary size and special ids (whatever
    `draft_config` says) and is exported with the target's tokenizer.
    `draft_init_dir`: start from this HF checkpoint's params instead of random ones.
    `vocab`: target ids [Vd] the draft's LM head keeps (`draft_vocab`), so it trains the
    distribution `DraftModel.create(vocab=)` proposes from; the export keeps every row.
    `mesh_shape` (see `job_mesh`): the target is loaded straight onto the mesh, split over
    `model` with the draft; `data_parallel`: a 1-D data mesh.
    features: "online" runs the target inside every step; "offline" reads its final hidden
      states from a dump (`features_dir`, default `<workdir>/features`; made there if
      missing, as `heads` makes it, and shared with heads trained on the same rows: a
      dump holding EAGLE-3's layers too serves both), so a step runs only the target's LM
      head. Corpus text only (source "corpus"). Same batches, same loss.
    """
    _check_features(features)
    if features == "offline" and source != "corpus":
        raise ValueError(f"features='offline' needs source='corpus' (source={source!r} "
                         "trains on the target's own samples, which no dump holds)")
    mesh = job_mesh(data_parallel, mesh_shape)
    target = load_target(target_dir, "distillation", mesh=mesh)
    if draft_config.vocab_size != target.config.vocab_size:
        log.info("draft vocab_size %d -> the target's %d", draft_config.vocab_size,
                 target.config.vocab_size)
    draft_config = draft_config.replace(vocab_size=target.config.vocab_size,
                                        bos_token_id=target.config.bos_token_id,
                                        eos_token_id=target.config.eos_token_id)
    init = None
    if draft_init_dir is not None:
        start = load(draft_init_dir, dtype="float32")
        if start.config.replace(bos_token_id=None, eos_token_id=None) != draft_config.replace(
                bos_token_id=None, eos_token_id=None):
            raise ValueError(f"{draft_init_dir}: its config does not match draft_config")
        init = start.params
    data = build_data(data_config, target.tokenizer, train_config.seed)
    method = Distill(draft_config, target.config, divergence=divergence,
                     temperature=temperature, source=source, prompt_len=prompt_len,
                     sample_temperature=sample_temperature,
                     vocab=None if vocab is None else tuple(np.sort(np.asarray(vocab)).tolist()))
    train_data, frozen = data, target.params
    if features == "offline":
        store = _features_store(Path(workdir).absolute(), features_dir, features_dtype,
                                target, data, (), train_config)
        # The step reads the final hidden state, not the target: only its LM head stays.
        train_data = features_lib.OfflineData(data, store)
        frozen = features_lib.embedding_and_head(target.params)
    result = train(method, train_data, train_config, workdir, frozen=frozen, init_params=init,
                   mesh=mesh, stop_at=stop_at,
                   settings=_settings("distill", data_config, target_dir=str(target_dir),
                                      draft_init_dir=draft_init_dir and str(draft_init_dir),
                                      features=features,
                                      features_dir=features_dir and str(features_dir)))
    return JobResult(Path(workdir).absolute(), _export(result, draft_config, target.tokenizer),
                     result)


def corpus_vocab(corpus: CorpusConfig, tokenizer, vocab_size: int, size: int) -> np.ndarray:
    """[size] int32: the `size` target ids most frequent in the training documents of
    `corpus`, EAGLE-3's reduced draft vocabulary, and a trimmed draft model's."""
    counts = token_counts(load_corpus(corpus).train, tokenizer, vocab_size)
    return build_vocab_map(counts, size)


def draft_vocab(workdir: str | Path, target: Model, size: int,
                data_config: DataConfig = DataConfig()) -> Path:
    """Writes `workdir/vocab.npy`: the `size` target ids most frequent in the corpus
    tokenized with `target`'s tokenizer, the vocabulary a draft trained on that corpus is
    trimmed to (`DraftModel.create(vocab=)`)."""
    from specjax.speculators.draft_model import VOCAB_FILE, save_vocab

    ids = corpus_vocab(data_config.corpus, target.tokenizer, target.config.vocab_size, size)
    out = Path(workdir)
    out.mkdir(parents=True, exist_ok=True)
    save_vocab(out / VOCAB_FILE, ids)
    return out / VOCAB_FILE


REGENERATED_FILE = "regenerated.jsonl"


def regenerate(workdir: str | Path, target: Model, data_config: DataConfig = DataConfig(),
               config: RegenerateConfig = RegenerateConfig()) -> DataConfig:
    """Writes `target`'s own continuations of prefixes of `data_config`'s training
    documents to `workdir/regenerated.jsonl` (`specjax.train.regenerate`; resumed if
    killed) and returns the data config that trains on them (`regenerated_data`)."""
    path = regenerate_lib.regenerate(target, load_corpus(data_config.corpus), config,
                                     Path(workdir) / REGENERATED_FILE)
    return regenerated_data(path, data_config, config)


def regenerated_data(path: str | Path, data_config: DataConfig,
                     config: RegenerateConfig) -> DataConfig:
    """`data_config` (its rows' length) reading the file `config` regenerated at `path`
    instead of its corpus, `config.eval_fraction` of the continuations held out."""
    corpus = CorpusConfig(source=str(path), eval_fraction=config.eval_fraction)
    return dataclasses.replace(data_config, corpus=corpus)


HEADS_DIR = "heads"
SERVING_DIRS = {"eagle": "speculators", "medusa": "medusa"}  # beside HEADS_DIR
FEATURES_DIR = "features"
SUMMARY_FILE = "summary.json"
SPECULATIVE_SPLIT = "speculative"  # the metrics.jsonl record of the end-of-run generation


def _speculative_record(result: TrainResult, heads_dir: Path, target: Model, data_config,
                        config: SpeculativeEval) -> dict[str, Any]:
    """α and τ of a short greedy generation through the heads' speculator, appended to
    metrics.jsonl once per finished run (a re-run finds it there)."""
    path = result.workdir / METRICS_FILE
    for line in path.read_text().splitlines() if path.exists() else ():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line torn by a kill; MetricsLog drops it below
            continue
        if record.get("split") == SPECULATIVE_SPLIT and record.get("step") == result.step:
            return record
    prompts = heldout_prompts(load_corpus(data_config.corpus), target.tokenizer,
                              config.num_prompts, config.prompt_len, config.seed)
    spec = head_speculator(heads_dir, target, config.eagle_tree)
    _, record = speculative_run(target, spec, prompts, new_tokens=config.new_tokens)
    record = {"step": result.step, "split": SPECULATIVE_SPLIT, "temperature": 0.0,
              "speculator": type(spec).__name__, "prompts": len(prompts),
              "prompt_len": config.prompt_len, "new_tokens": config.new_tokens, **record}
    MetricsLog(path, result.step).write(record)
    log.info("speculative (greedy, %d prompts): alpha=%.3f tau=%.2f", len(prompts),
             record["alpha"], record["tau"])
    return record


def serving_export(workdir: Path, kind: str, head_config, params, target: Model,
                   target_dir: str | Path, d2t=None) -> Path | str:
    """Writes finished heads beside specjax's own in the layout servers load: EAGLE-3 in
    speculators' format (`<workdir>/speculators`, which `vllm serve` loads), Medusa in the
    Medusa repository's (`<workdir>/medusa`). Returns the directory, or why none was
    written (EAGLE-1 has no such layout; a head a layout cannot hold is logged, and the
    run's own heads stand)."""
    from specjax.export import export_medusa, export_speculators
    from specjax.speculators import Eagle, Medusa

    if kind == "eagle" and head_config.version != 3:
        return "EAGLE-1 heads have no serving layout"
    out = workdir / SERVING_DIRS[kind]
    try:
        if kind == "medusa":
            tree = [(0,) * d for d in range(1, head_config.num_heads + 1)]
            medusa = Medusa.create(params, head_config, target=target, tree=tree)
            return export_medusa(medusa, out, base_model_name_or_path=str(target_dir))
        eagle = Eagle.create(params, head_config, target=target, vocab_map=d2t, top_k=1,
                             depth=1, total_tokens=1)
        return export_speculators(eagle, out, target=target, verifier=str(target_dir))
    except ValueError as e:
        log.warning("heads not written for serving (%s): %s", SERVING_DIRS[kind], e)
        return f"not written: {e}"


def _check_features(features: str) -> None:
    """Refuses a features mode other than `features_lib.MODES` (heads and distill)."""
    if features not in features_lib.MODES:
        raise ValueError(f"features={features!r} must be one of {features_lib.MODES}")


def _check_heads_args(features: str, head_config, method_kwargs: Mapping[str, Any]) -> None:
    """Refuses a bad `features` mode or a setting the training method does not take, before
    anything is loaded (a misspelled gin binding lands here)."""
    _check_features(features)
    method_cls = TrainMedusa if isinstance(head_config, MedusaConfig) else TrainEagle
    settings = {f.name for f in dataclasses.fields(method_cls)} - {"target", "heads", "head"}
    unknown = sorted(set(method_kwargs) - settings)
    if unknown:
        raise ValueError(f"jobs.heads got {unknown}, which {method_cls.__name__} does not "
                         f"take (its settings: {sorted(settings)})")


def _heads_method(head_config, target: Model, corpus: CorpusConfig, train_config: TrainConfig,
                  features: str, method_kwargs: Mapping[str, Any]):
    """Builds the Medusa or EAGLE training method with its initial params, frozen inputs,
    EAGLE-3 draft vocabulary map and tapped layers: the per-kind half of `heads`."""
    d2t, init, layers = None, None, ()
    if isinstance(head_config, MedusaConfig):
        kind, method = "medusa", TrainMedusa(target.config, head_config, **method_kwargs)
        init = method.initial_params(target.params)
        frozen = None if method.joint else target.params
        if method.joint and features == "offline":
            raise ValueError("joint Medusa-2 trains the target, so it cannot read offline "
                             "features; use features='online'")
    elif isinstance(head_config, EagleConfig):
        kind, method = "eagle", TrainEagle(target.config, head_config, **method_kwargs)
        layers = method.hidden_layers
        vd = method.head.draft_vocab_size
        if vd is not None and vd < target.config.vocab_size:
            d2t = corpus_vocab(corpus, target.tokenizer, target.config.vocab_size, vd)
        if method.init_from_target:
            init = method.initial_params(target.params, d2t, train_config.seed)
        frozen = {"target": target.params, "d2t": d2t}
    else:
        raise ValueError(f"head_config={head_config!r} must be a MedusaConfig or EagleConfig")
    return kind, method, init, frozen, d2t, layers


def _features_store(workdir: Path, features_dir, features_dtype: str, target: Model, data,
                    layers, train_config: TrainConfig) -> features_lib.FeatureStore:
    """The dump at `features_dir` (default `<workdir>/features`) of `target`'s features
    over `data`, made or resumed there first, in batches of the run's micro-batch."""
    return features_lib.dump_features(
        features_dir or workdir / FEATURES_DIR, target.config, target.params, data,
        layers=layers, dtype=features_dtype, batch_size=train_config.micro_batch,
        progress=train_config.progress)


def _offline_heads_data(workdir: Path, features_dir, features_dtype: str, target: Model, data,
                        layers, kind: str, d2t, train_config: TrainConfig):
    """Dumps (or resumes) the target's features and returns the data that streams them plus
    the frozen inputs the step still needs, so training never runs the target."""
    store = _features_store(workdir, features_dir, features_dtype, target, data, layers,
                            train_config)
    train_data = features_lib.OfflineData(data, store, layers)
    # The step reads features, not the target: only the embedding and LM head stay.
    if kind == "medusa":
        frozen = None
    else:
        frozen = {"target": features_lib.embedding_and_head(target.params), "d2t": d2t}
    return train_data, frozen


def _finish_heads(result: TrainResult, kind: str, method, d2t, target: Model, target_dir,
                  data_config: DataConfig, features: str, serving: bool,
                  speculative: SpeculativeEval | None) -> tuple[Path, dict[str, Any]]:
    """Writes a finished run's heads (and a Medusa-2 run's target), the serving export, the
    speculative evaluation and summary.json; returns the heads' directory and the summary."""
    params = method.head_params(result.params) if kind == "medusa" else result.params
    head = method.heads if kind == "medusa" else method.head
    out = save_heads(result.workdir / HEADS_DIR, kind, head, params, target.config,
                     vocab_map=d2t)
    log.info("wrote heads %s", out)
    if kind == "medusa" and method.joint:  # Medusa-2 changed the target too
        target = Model(target.config, result.params["target"], target.tokenizer)
        save_hf(target, result.workdir / EXPORT_DIR)
    summary = {"step": result.step, "eval": result.eval, "heads": str(out),
               "features": features}
    if serving:  # a Medusa-2 run's heads serve its own trained target
        joint = kind == "medusa" and method.joint
        served = result.workdir / EXPORT_DIR if joint else target_dir
        summary["serving"] = str(serving_export(result.workdir, kind, head, params,
                                                target, served, d2t))
    if speculative is not None:
        summary["speculative"] = _speculative_record(result, out, target, data_config,
                                                     speculative)
    (result.workdir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
    return out, summary


def heads(workdir: str | Path, target_dir: str | Path, head_config: MedusaConfig | EagleConfig,
          train_config: TrainConfig, data_config: DataConfig = DataConfig(), *,
          features: str = "online", features_dir: str | Path | None = None,
          features_dtype: str = "float32",
          speculative: SpeculativeEval | None = SpeculativeEval(),
          expect_target: ModelConfig | None = None, data_parallel: bool = False,
          mesh_shape: Mapping[str, int] | None = None, serving: bool = True,
          stop_at: int | None = None, **method_kwargs: Any) -> JobResult:
    """Trains Medusa heads (`MedusaConfig`) or an EAGLE head (`EagleConfig`) on the frozen
    target at `target_dir` and, when finished, writes them with `specjax.heads.save_heads`
    to `<workdir>/heads` (what `Medusa.load(...)` / `Eagle.load(...)` load); a joint
    Medusa-2 run also exports its trained target to `<workdir>/export`. `serving`: also
    write them for servers (`serving_export`: EAGLE-3 in speculators' format, Medusa in
    the Medusa repository's); the summary's "serving" says where, or why not.

    features: "online" runs the target inside every step; "offline" dumps its features
      once to `features_dir` (default `<workdir>/features`; resumed if partial, reused if
      complete, refused if foreign; see `specjax.train.features`) in `features_dtype` and streams
      them back, so training never runs the target. Same batches, same loss.
    speculative: at the end, a short greedy generation through the heads' speculator on
      held-out prompts; its α and τ go to metrics.jsonl (split "speculative") and to
      `<workdir>/summary.json`. None skips it.
    expect_target: the target's expected config (gin: %MODEL); a target of other shapes is
      an error.
    EAGLE-3 with a reduced `draft_vocab_size`: d2t keeps the ids most frequent in the
    training split. `method_kwargs` go to `TrainMedusa` / `TrainEagle`. `mesh_shape` (see
    `job_mesh`): the target is loaded straight onto the mesh, split over `model` with the
    heads.
    """
    _check_heads_args(features, head_config, method_kwargs)
    workdir = Path(workdir).absolute()
    mesh = job_mesh(data_parallel, mesh_shape)
    target = load_target(target_dir, "training heads", expect_target, mesh=mesh)
    data = build_data(data_config, target.tokenizer, train_config.seed)
    kind, method, init, frozen, d2t, layers = _heads_method(
        head_config, target, data_config.corpus, train_config, features, method_kwargs)
    train_data = data
    if features == "offline":
        train_data, frozen = _offline_heads_data(workdir, features_dir, features_dtype, target,
                                                 data, layers, kind, d2t, train_config)
    result = train(method, train_data, train_config, workdir, frozen=frozen, init_params=init,
                   mesh=mesh, stop_at=stop_at,
                   settings=_settings(f"heads/{kind}", data_config, target_dir=str(target_dir),
                                      features=features,
                                      features_dir=features_dir and str(features_dir)))
    out, summary = None, {}
    if result.finished:
        out, summary = _finish_heads(result, kind, method, d2t, target, target_dir, data_config,
                                     features, serving, speculative)
    return JobResult(workdir, out, result, summary)


def offline_features(workdir: str | Path, target_dir: str | Path,
                     data_config: DataConfig = DataConfig(), *,
                     head_config: MedusaConfig | EagleConfig | Sequence | None = None,
                     dtype: str = "float32",
                     batch_size: int = 8, expect_target: ModelConfig | None = None,
                     progress: bool = True) -> features_lib.FeatureStore:
    """Dumps the target's features for `data_config` into `workdir` (a features directory,
    see `specjax.train.features`) without training anything: run it where the target fits, then
    train heads with `heads(..., features="offline", features_dir=workdir)`. Resumes a
    killed dump; refuses a directory holding another one.

    head_config: the heads the dump serves (one config, or a sequence of them); an EAGLE-3
      config adds its low/mid/high layers (resolved for this target), anything else
      stores the final hidden state only (all a Medusa run or a distillation reads).
    """
    target = load_target(target_dir, "dumping features", expect_target)
    configs = head_config if isinstance(head_config, (list, tuple)) else (head_config,)
    layers = tuple(sorted({i for c in configs if isinstance(c, EagleConfig)  # TrainEagle's
                           for i in TrainEagle(target.config, c).hidden_layers}))
    data = build_data(data_config, target.tokenizer, seed=0)  # the rows; order is per run
    return features_lib.dump_features(workdir, target.config, target.params, data,
                                      layers=layers, dtype=dtype, batch_size=batch_size,
                                      progress=progress)
