"""The quickstart experiment: from nothing to a trustworthy comparison table on a CPU.

Stages, each in its own sub-directory of the workdir and skipped when finished:
  target/   BPE tokenizer + a small Llama pretrained on the Python standard library
  draft/    a smaller Llama distilled from it (TVD)
  medusa/   Medusa-1 heads on the frozen target
  eagle/    an EAGLE head on the frozen target
  results.json, results.md, plots: autoregressive vs n-gram vs draft vs Medusa vs EAGLE
  on held-out stdlib prompts, greedy and temperature 1 — α, τ, tokens/s, measured and
  analytical speedup — and a check that every greedy output is identical.

Run it with `specjax run configs/experiments/quickstart.gin --workdir runs/quickstart`.
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
from train.corpus import load_corpus
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
            temperatures=(0.0, 1.0), seed: int = 0, cost_ratios: dict | None = None) -> list:
    """Every method on the same prompts, per temperature: stats and speedup vs plain.
    cost_ratios: {temperature: {method: measured c}} for the analytical figure
    (`bench.speculative.measured_cost_ratios`), else the run's own estimate."""
    from specjax.bench.speculative import cost_ratio_of

    rows = []
    for temp in temperatures:
        base = None
        outputs = {}
        for name, spec in speculators.items():
            tokens, r = speculative_run(target, spec, prompts, new_tokens=new_tokens,
                                        temperature=temp, seed=seed)
            base = base or r["tokens_per_s"]
            c = cost_ratio_of(cost_ratios, temp, name, r["cost_ratio"])
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


def quickstart(workdir: str | Path, *, target_config: ModelConfig, draft_config: ModelConfig,
               target_train: TrainConfig, draft_train: TrainConfig,
               data_config: DataConfig = DataConfig(),
               head_stages: dict[str, Callable] | None = None,
               num_prompts: int = 8, prompt_len: int = 64, new_tokens: int = 64, k: int = 4,
               sweep_k: tuple[int, ...] = (1, 2, 4, 6), temperatures=(0.0, 1.0),
               seed: int = 0) -> dict:
    """Runs (or resumes) every stage, then the comparison; returns the results dict."""
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
    for name, make in (head_stages or {}).items():
        # The stage's own α/τ record uses the comparison's greedy prompts: same numbers,
        # and the same compiled generation.
        tau = SpeculativeEval(num_prompts, prompt_len, new_tokens, seed, make.eagle_tree)
        hdir = _stage(workdir, name, lambda d, make=make, tau=tau: make(d, tdir / "export", tau),
                      dict(common, stage=make.settings))
        specs[name] = make.speculator(hdir, target, k)

    settings = dict(common, prompts=num_prompts, prompt_len=prompt_len, new=new_tokens, k=k,
                    sweep_k=list(sweep_k), temperatures=list(temperatures),
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
    prompts = heldout_prompts(load_corpus(data_config.corpus), target.tokenizer,
                              num_prompts, prompt_len, seed)
    from specjax.bench.speculative import measured_cost_ratios

    costs = measured_cost_ratios(target, specs, temperatures)
    rows = compare(target, specs, prompts, new_tokens=new_tokens, temperatures=temperatures,
                   seed=seed, cost_ratios=costs)
    sweep = []
    for kk in sweep_k:
        sub = {"autoregressive": None, "ngram": NGram(k=kk),
               "draft": DraftModel(model=draft, k=kk)}
        for r in compare(target, sub, prompts, new_tokens=new_tokens, temperatures=(0.0,),
                         seed=seed, cost_ratios=costs):
            if r["method"] != "autoregressive":
                sweep.append(dict(method=r["method"], k=kk, speedup=r["speedup"],
                                  alpha=r["alpha"], tau=r["tau"]))
    greedy_same = all(r["identical_to_plain"] for r in rows if r["temperature"] == 0)
    text = table(rows)
    results = dict(settings=settings, rows=rows, sweep=sweep, table=text,
                   greedy_identical=greedy_same, versions=versions(),
                   date=time.strftime("%Y-%m-%d"),
                   target_params=target.num_params(), draft_params=draft.num_params(),
                   plots=plots(rows, sweep, workdir))
    res_file.write_text(json.dumps(results, indent=2))
    (workdir / "results.md").write_text(text + "\n")
    print(text)
    print(f"greedy outputs identical across methods: {greedy_same}")
    if not greedy_same:
        raise AssertionError("greedy outputs differ between methods: speculation was lossy")
    return results


@dataclasses.dataclass(frozen=True)
class HeadStage:
    """Trains Medusa heads or an EAGLE head on the frozen target (`jobs.heads`), and
    builds the speculator that uses them."""

    head_config: Any  # MedusaConfig | EagleConfig
    train_config: TrainConfig
    data_config: DataConfig
    eagle_tree: tuple = (4, 4, 16)  # EAGLE-2 dynamic tree: top_k, depth, total_tokens

    @property
    def settings(self) -> dict:
        return _jsonable(self)

    def __call__(self, stage_dir: Path, target_export: Path,
                 speculative: SpeculativeEval | None = None):
        return jobs.heads(stage_dir, target_export, self.head_config, self.train_config,
                          self.data_config, speculative=speculative or SpeculativeEval(
                              eagle_tree=self.eagle_tree))

    def speculator(self, stage_dir: Path, target: specjax.Model, k: int):
        return head_speculator(stage_dir / jobs.HEADS_DIR, target, self.eagle_tree)


def default_head_stages(train_config: TrainConfig, data_config: DataConfig = DataConfig(),
                        medusa_heads: int = 4, eagle_version: int = 1) -> dict[str, HeadStage]:
    """The quickstart's head stages: Medusa-1 heads and an EAGLE head, same training."""
    from specjax.heads import EagleConfig, MedusaConfig

    return {"medusa": HeadStage(MedusaConfig(num_heads=medusa_heads), train_config,
                                data_config),
            "eagle": HeadStage(EagleConfig(version=eagle_version), train_config, data_config)}
