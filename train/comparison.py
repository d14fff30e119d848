"""The comparison every quickstart ends with: each method on the same held-out prompts,
greedy and sampled, timed in interleaved rounds; the table, results.json / results.md and
plots, and the check that every greedy output is identical (lossless speculation)."""

from __future__ import annotations

import dataclasses
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import jax
import numpy as np

import specjax
from specjax.calibrate import (
    calibrations,
    choose_tree,
    chosen_shapes,
    cost_ratio_of,
    measured_cost_ratios,
)
from specjax.corpus import CorpusConfig, heldout_prompts, load_corpus
from specjax.passes import generate_calls
from specjax.speculators import method_of
from specjax.speculators.eagle import tree_label
from specjax.stats import loop_kind, untimed_methods
from specjax.timing import paired_ratios, side_by_side_calls
from specjax.train.speculation import run_record

DONE = "DONE.json"  # a finished stage's marker in its directory (specjax.train.quickstart)


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
            batch: int | None = None, adaptive: bool = False, repeats: int = 1,
            priors: dict | None = None, alternatives: dict | None = None,
            choices: dict | None = None) -> list:
    """Every method on the same prompts, per temperature: stats and speedup vs plain.

    After one warm-up call per method (compilation, `warmup_prompts`), `repeats` rounds
    run every method once, interleaved call by call (each generate call of `batch` rows
    of every method before the next call of any, in a new order each call:
    `specjax.timing.side_by_side_calls`), so that each sees the same machine load;
    tokens/s is the median over the rounds (each round's in `round_tokens_per_s`), the
    speedup the median of each round's ratio to the first method's (`paired_ratios`; a
    timed speculator's ratios in `round_speedups`),
    the stats are the last round's (greedy ones are the same in every round).
    A speculator whose warm-up ran plain decoding's programs in every call
    (`specjax.stats.untimed_methods`) is not run again: its warm-up gives its stats and
    its greedy identity (against the first method's warm-up on the same prompts), and it
    reports the first method's tokens/s with a speedup of 1 (`timed` False; `loop`:
    `specjax.stats.loop_kind`). Running it again would time the same programs twice.
    cost_ratios: {temperature: {method: measured c}} for the adaptive rule and the
    analytical figure (`specjax.calibrate.measured_cost_ratios`), else the run's own
    estimate. priors: {temperature: {method: `Calibration`}} for the adaptive rule's start
    (`specjax.calibrate.calibrations`). batch: rows per generate call
    (None: all prompts at once). adaptive: the draft-length rule on (what `generate` does
    by default), else full depth every step. alternatives: {name: speculator} other tree
    shapes of a method, priced and calibrated under their own names; choices:
    {(temperature, method): name} the one a temperature runs as `method` (`choose_trees`),
    its tree in the row's `tree`."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    rows = []
    warm = warmup_prompts(prompts, batch)
    for temp in temperatures:
        pick, cell = chosen_shapes(speculators, alternatives, choices,
                                   lambda name, temp=temp: (temp, name))

        def calls(name, prompts=prompts):
            return generate_calls(target, cell[name], prompts, new=new_tokens,
                                  batch=len(prompts) if batch is None else batch,
                                  temperature=temp, seed=seed,
                                  adaptive=adaptive, cost_ratio=cost_ratio_of(
                                      cost_ratios, temp, pick[name]),
                                  calibration=(priors or {}).get(temp, {}).get(pick[name]))

        names = list(speculators)
        base = names[0]
        warmed = {name: run_record([c() for c in calls(name, warm)])  # compiles
                  for name in cell}
        plain = untimed_methods(cell, {n: (r["speculative_calls"], r["calls"])
                                       for n, (_, r) in warmed.items()})
        timed = side_by_side_calls({name: calls(name) for name in names
                                    if name not in plain}, repeats)
        results = {name: [run_record(outs) for outs in got] for name, got in timed.items()}
        speeds = {name: [r["tokens_per_s"] for _, r in rounds]
                  for name, rounds in results.items()}  # per timed round
        results.update({name: [warmed[name]] for name in plain})  # its warm-up is its run
        for name in names:
            tokens, r = results[name][-1]
            # a plain-program method ran on the warm-up prompts: compare it with the baseline there
            baseline = warmed[base][0] if name in plain else results[base][-1][0]
            # tokens/s ratios per round: the inverse of the time ratios paired_ratios takes
            same = speeds[base if name in plain else name]
            ratios = paired_ratios(same, speeds[base])
            rows.append(dict(r, method=name, temperature=temp,
                             loop=loop_kind(r["speculative_calls"], r["calls"]),
                             timed=name not in plain,
                             tokens_per_s=float(np.median(same)),
                             # each round's, so that a speedup read low or high can be
                             # traced to the rounds the host sped up or slowed
                             round_tokens_per_s=[float(x) for x in same],
                             speedup=statistics.median(ratios),
                             identical_to_plain=tokens == baseline,
                             # a timed speculator's ratio per round, for the table's range
                             **({"round_speedups": ratios}
                                if name not in plain and name != base else {}),
                             **({"tree": tree_label(cell[name])}
                                if (temp, name) in (choices or {}) else {})))
    return rows


def check_tree_choice(trees, calibrate: int, adaptive: bool) -> None:
    """A choice between tree shapes (`choose_trees`) is made by their calibration: an
    error naming `trees` without one (or without the adaptive rule that reads it)."""
    if not (calibrate and adaptive):
        raise ValueError(f"{trees!r}: choosing between trees needs calibrate > 0 and "
                         f"adaptive (calibrate={calibrate}, adaptive={adaptive})")


def choose_trees(target: specjax.Model, candidates: dict, priors: dict, *,
                 cost_ratios: dict | None, batch: int, context: int) -> tuple[dict, list[dict]]:
    """Per temperature calibrated, for each method with other tree shapes among
    `candidates` (named `method@top_k,depth,nodes`), the shape the adaptive rule expects
    to gain most from its calibration (`specjax.calibrate.choose_tree`):
    ({(temperature, method): name}, a record per choice of every shape's gain)."""
    choices, records = {}, []
    methods = sorted({method_of(n) for n in candidates if method_of(n) != n})
    for temp, per in priors.items():
        costs = {n: cost_ratio_of(cost_ratios, temp, n) for n in candidates}
        for method in methods:
            best, record = choose_tree(target, method, candidates, per, costs, batch=batch,
                                       context=context)
            choices[temp, method] = best
            records.append(dict(record, temperature=temp))
    return choices, records


def warmup_prompts(prompts: list, batch: int | None) -> list:
    """The prompts whose run compiles every program the timed rounds will use: one call's
    rows when all prompts have the same length (a call's programs depend on its shapes
    only), else all of them. With 8 one-row calls per pass, warming up on one of them
    instead of all saves nearly a quarter of a 3-round comparison's calls."""
    rows = len(prompts) if batch is None else batch
    return list(prompts[:rows]) if len({len(p) for p in prompts}) == 1 else list(prompts)


def table(rows: list) -> str:
    """The comparison's markdown table; a timed speculator's measured speedup carries the
    range of its rounds' ratios, since on a host whose speed swings the rounds differ."""
    lines = ["| method | T | α | τ | tokens/s | speedup (measured; rounds' range) "
             "| speedup (analytical) | greedy identical |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        same = str(r["identical_to_plain"]) if r["temperature"] == 0 else "–"
        method = f"{r['method']} (tree {r['tree']})" if r.get("tree") else r["method"]
        ratios = r.get("round_speedups")  # a timed speculator's (`compare`)
        spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else ""
        lines.append(f"| {method} | {r['temperature']:g} | {r['alpha']:.3f} | "
                     f"{r['tau']:.2f} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}×{spread} | "
                     f"{r['analytical']:.2f}× | {same} |")
    plain = [f"{r['method']} at T = {r['temperature']:g}" for r in rows
             if not r.get("timed", True)]  # rows of an earlier version were all timed
    if plain:
        lines += ["", "On plain decoding's programs (the rule saw that drafting could never "
                  "pay; not run again after its warm-up: autoregressive's tokens/s): "
                  + ", ".join(plain) + "."]
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


def _calibrated_priors(target, specs: dict, prompt_corpus: CorpusConfig, prompts,
                       calibrate: int, num_prompts: int, prompt_len: int, new_tokens: int,
                       temperatures, seed: int, costs, batch: int) -> dict:
    """The adaptive rule's calibration (acceptance per depth, proposal rate, step
    overhead), measured on `calibrate` other held-out prompts (never the evaluation's
    own) in calls of `batch` rows, as the comparison runs them."""
    pool = heldout_prompts(load_corpus(prompt_corpus), target.tokenizer,
                           calibrate + num_prompts, prompt_len, seed + 1)
    calib = [p for p in pool if p not in prompts][:calibrate]
    return calibrations(target, specs, calib, new_tokens=new_tokens,
                        temperatures=temperatures, seed=seed + 1, cost_ratios=costs,
                        batch=batch)


def _k_sweep(target, draft, prompts, sweep_k, *, new_tokens: int, seed: int, costs,
             batch: int | None, adaptive: bool, repeats: int) -> list[dict]:
    """Greedy n-gram (and draft-model) speedup, α and τ at every draft length in `sweep_k`;
    `draft` is the comparison's `DraftModel` speculator (or None), re-made at each k."""
    from specjax.speculators import NGram

    sweep = []
    for kk in sweep_k:
        sub = {"autoregressive": None, "ngram": NGram(k=kk)}
        if draft is not None:  # the comparison's draft (its trimmed vocabulary kept)
            sub["draft"] = draft.replace(k=kk)
        for r in compare(target, sub, prompts, new_tokens=new_tokens, temperatures=(0.0,),
                         seed=seed, cost_ratios=costs, batch=batch, adaptive=adaptive,
                         repeats=repeats):
            if r["method"] != "autoregressive":
                sweep.append(dict(method=r["method"], k=kk, speedup=r["speedup"],
                                  alpha=r["alpha"], tau=r["tau"]))
    return sweep


def _lookup_settings(specs: dict) -> dict:
    """{name: its settings} of the speculators with no trained stage (n-gram, with the
    size of its corpus), so that a finished evaluation is reused only if they drafted
    the same way (the trained ones are keyed by their stages' settings)."""
    from specjax.speculators import NGram

    def settings(s: NGram) -> dict:
        out = dict(k=s.k, n_min=s.n_min, n_max=s.n_max)
        if s.corpus is not None:
            out.update(corpus_k=s.corpus_k, corpus_tokens=int(s.corpus.tokens.shape[0]))
        return out

    return {name: settings(s) for name, s in specs.items() if isinstance(s, NGram)}


def evaluate(workdir: Path, target: specjax.Model, draft: specjax.Model | None, specs: dict,
             settings: dict, prompt_corpus: CorpusConfig, *, num_prompts: int,
             prompt_len: int, new_tokens: int, k: int, sweep_k: tuple[int, ...],
             temperatures, seed: int, batch: int | None = None,
             adaptive: bool = False, repeats: int = 1, calibrate: int = 0,
             alternatives: dict | None = None) -> dict:
    """Every method on prompts from `prompt_corpus`'s held-out split (greedy and
    sampled), the k sweep, the table, results.json / results.md / plots; a finished
    evaluation with the same settings is printed again, not recomputed. Raises if greedy
    outputs differ (lossy speculation). repeats: interleaved timed rounds (`compare`);
    calibrate: with `adaptive`, other held-out prompts whose full-depth acceptance and
    step overhead start the rule (`specjax.calibrate.calibrations`; 0: the defaults).
    alternatives: {`method@top_k,depth,nodes`: speculator} other tree shapes of an EAGLE
    method, calibrated beside it; each temperature runs the shape its calibration prices
    best (`choose_trees`; needs `calibrate` and `adaptive`)."""
    if alternatives:
        check_tree_choice(sorted(alternatives), calibrate, adaptive)
    settings = dict(settings, prompts=num_prompts, prompt_len=prompt_len, new=new_tokens,
                    k=k, sweep_k=list(sweep_k), temperatures=list(temperatures),
                    **({} if batch is None else {"batch": batch}),
                    **({"adaptive": True} if adaptive else {}),
                    **({"repeats": repeats} if repeats != 1 else {}),
                    **({"calibrate": calibrate} if calibrate and adaptive else {}),
                    **({"trees": sorted(alternatives)} if alternatives else {}),
                    methods=list(specs), lookups=_lookup_settings(specs),
                    stages={p.name: json.loads((p / DONE).read_text())["settings"]
                            for p in workdir.iterdir() if (p / DONE).exists()})
    res_file = workdir / "results.json"
    if res_file.exists():
        old = json.loads(res_file.read_text())
        if old.get("settings") == settings:
            print(old["table"])
            print(f"(finished earlier: {res_file})")
            print(generate_hint(workdir, specs))
            return old
    prompts = heldout_prompts(load_corpus(prompt_corpus), target.tokenizer,
                              num_prompts, prompt_len, seed)

    candidates = {**specs, **(alternatives or {})}
    costs = measured_cost_ratios(target, candidates, temperatures, batch=batch or 1)
    priors, choices, trees = None, None, []
    if calibrate and adaptive:
        priors = _calibrated_priors(target, candidates, prompt_corpus, prompts, calibrate,
                                    num_prompts, prompt_len, new_tokens, temperatures, seed,
                                    costs, batch or len(prompts))
    if alternatives:
        choices, trees = choose_trees(target, candidates, priors, cost_ratios=costs,
                                      batch=batch or len(prompts), context=prompt_len)
    rows = compare(target, specs, prompts, new_tokens=new_tokens, temperatures=temperatures,
                   seed=seed, cost_ratios=costs, batch=batch, adaptive=adaptive,
                   repeats=repeats, priors=priors, alternatives=alternatives, choices=choices)
    sweep = _k_sweep(target, specs.get("draft"), prompts, sweep_k, new_tokens=new_tokens, seed=seed,
                     costs=costs, batch=batch, adaptive=adaptive, repeats=repeats)
    greedy_same = all(r["identical_to_plain"] for r in rows if r["temperature"] == 0)
    text = table(rows)
    # the prompts' ids, so that a later tool times exactly these (`bench.loop_steps`)
    results = dict(settings=settings, prompts=prompts, rows=rows, sweep=sweep, table=text,
                   priors=priors and {t: {m: dataclasses.asdict(c) for m, c in per.items()}
                                      for t, per in priors.items()},
                   **({"trees": trees} if trees else {}),
                   greedy_identical=greedy_same, versions=versions(),
                   date=time.strftime("%Y-%m-%d"),
                   target_params=target.num_params(),
                   draft_params=draft.num_params() if draft is not None else None,
                   plots=plots(rows, sweep, workdir))
    res_file.write_text(json.dumps(results, indent=2))
    (workdir / "results.md").write_text(text + "\n")
    print(text)
    print(f"greedy outputs identical across methods: {greedy_same}")
    print(generate_hint(workdir, specs))
    if not greedy_same:
        raise AssertionError("greedy outputs differ between methods: speculation was lossy")
    return results


# the comparison's methods as `specjax generate --speculator` names them
_CLI_SPECULATORS = {"ngram": "ngram", "draft": "draft", "medusa": "medusa",
                    "eagle": "eagle", "eagle3": "eagle"}


def generate_hint(workdir: Path, methods) -> str:
    """The command that decodes with the run's target and what it trained, the adaptive
    rule primed by this comparison's calibration (`specjax generate --workdir`)."""
    names = dict.fromkeys(_CLI_SPECULATORS[m] for m in methods if m in _CLI_SPECULATORS)
    return (f"decode with them: specjax generate --workdir {workdir} --speculator "
            f"{'|'.join(names)} --prompt TEXT")
