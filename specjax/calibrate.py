"""Calibration: the measured numbers `generate`'s adaptive draft length and analytical
speedup take, as library functions (the benchmarks and the quickstart call them).

- `measured_cost_ratio(s)`, `draft_cost_ratios`: c, a draft call's wall time over a
  target step's, as `generate(cost_ratio=)` takes it.
- `measure_verify_cost` (+ `fit_verify_cost`, `fit_per_token`): what verifying T tokens
  costs over one, the table `specjax.decoding.cost.VerifyCost.from_table` takes.
- `best_calibrated`: of several calibrated speculators (e.g. one head's tree shapes),
  the one the adaptive rule expects to gain most (`choose_tree`: one head's trees).
- `calibration(s)`: on calibration prompts, a speculator's acceptance per depth at full
  depth (with the tries it is worth, `effective_tries`), its step's overhead per draft
  depth and what a step that drafts nothing costs in its loop, as
  `generate(acceptance_prior=, prior_tries=, step_overhead=, idle_overhead=)` take them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax import rng, rows_matmul
from specjax.cache import PagedKVCache
from specjax.config import ModelConfig
from specjax.decoding.cost import VerifyCost, default_verify_cost
from specjax.decoding.policy import attended_tokens
from specjax.model import Model, init_model, step, step_kv
from specjax.speculators.base import ProposeContext
from specjax.stats import GenerationStats, accepted_at_least
from specjax.timing import interleaved_medians
from specjax.tree import ancestor_mask, chain
from specjax.xla_options import compile_decode

# XLA:CPU without its YNNPACK fusions: timed beside generate's options (the option
# generate compiled with until measured on a real checkpoint; `specjax.xla_options`)
NO_YNN = {"xla_cpu_experimental_ynn_fusion_type": ""}


def measured_cost_ratio(target: Model, speculator, *, context: int = 128,
                        repeats: int = 20, seed: int = 0, temperature: float = 0.0,
                        batch: int = 1) -> float:
    """c as Leviathan et al. define it, measured at one temperature (`draft_cost_ratios`)."""
    return draft_cost_ratios(target, speculator, (temperature,), context=context,
                             repeats=repeats, seed=seed, batch=batch)[temperature]


def draft_cost_ratios(target: Model, speculator, temperatures=(0.0,), *, context: int = 128,
                      repeats: int = 20, seed: int = 0, batch: int = 1) -> dict[float, float]:
    """{temperature: c}, c as Leviathan et al. define it, measured: the wall time of one
    draft call relative to one target decode step (T = 1), both over `batch` rows and as
    `generate` runs them (its layer layout and compiler options, timed interleaved). The
    ratio moves with the batch (a small draft's fixed work per call is spread over more
    rows, and the target step turns from a GEMV into a GEMM), so time it at the batch it
    will price.

    The draft side is the speculator's whole `propose` at full depth after a
    `context`-token prompt (the draft model's queue forward and chain, Medusa's heads,
    EAGLE's tree levels with their top-k and reranking), divided by the draft calls it
    makes there (`DraftCost.calls_per_step`). Parameter counts miss exactly that work
    around the matmuls, which on a CPU is a large share of a small draft's time. 0 for
    a speculator without draft calls (n-gram). The sampling settings are an argument of
    the one compiled propose, as in `generate` (temperature is traced there): each
    temperature times the code it runs (sampling costs a draft more than argmax) with
    no second compile, from one greedy prefill (a propose's work has fixed shapes, so
    the prompt's sampled first token would not change it)."""
    from specjax.decoding.state import LoopState
    from specjax.inspect import prefilled_state
    from specjax.sampling import Sampling

    calls = speculator.cost.calls_per_step
    if calls == 0:
        return {t: 0.0 for t in temperatures}
    cfg = target.config
    spec = speculator.for_decoding()
    params = target.decode_params()  # the layout generate uses
    prompt = np.random.default_rng(seed).integers(0, cfg.vocab_size, context).tolist()
    state, _ = prefilled_state(target, prompt, spec, params=params, batch=batch)

    def propose(p, sp, st: LoopState, sampling: Sampling):
        ctx = ProposeContext(st.tokens, st.lengths, ~st.done, sampling,
                             rng.step_keys(st.keys, st.lengths, rng.PROPOSE),
                             jnp.full_like(st.lengths, sp.shape.max_depth))
        return sp.propose(st.spec_state, ctx, p)[0].tokens

    def target_step(p, st: LoopState):
        root = jnp.take_along_axis(st.tokens, (st.lengths - 1)[:, None], axis=1)
        return step(cfg, p, st.cache, root, (st.lengths - 1)[:, None])[0]

    with rows_matmul.any_rows():  # the products as generate's decode loop traces them
        draft = compile_decode(jax.jit(propose).lower(params, spec, state, Sampling.create()))
        fns = {"target": (compile_decode(jax.jit(target_step).lower(params, state)),
                          (params, state))}
    fns.update({t: (draft, (params, spec, state, Sampling.create(t))) for t in temperatures})
    for f, args in fns.values():
        jax.block_until_ready(f(*args))  # first run
    med = interleaved_medians(fns, repeats)  # every program beside the same machine load
    return {t: med[t] / calls / med["target"] for t in temperatures}


def measured_cost_ratios(target: Model, speculators: dict,
                         temperatures=(0.0,), batch: int = 1) -> dict:
    """{temperature: {method: c}} at `batch` rows for every speculator (None:
    autoregressive, skipped; `draft_cost_ratios`). Sampling costs the draft more than
    argmax does, and any T > 0 runs the same sampling code, so c is measured once greedy
    and once sampled, from one compiled propose per speculator."""
    sampled = [t for t in temperatures if t > 0][:1]  # every T > 0 takes this one's c
    timed = tuple([0.0] if 0 in temperatures else []) + tuple(sampled)
    per = {name: draft_cost_ratios(target, spec, timed, batch=batch)
           for name, spec in speculators.items() if spec is not None}
    return {t: {name: c[sampled[0] if t > 0 else 0.0] for name, c in per.items()}
            for t in temperatures}


def cost_ratio_of(cost_ratios: dict | None, temperature: float, name: str, default=None):
    """The measured c of method `name` at `temperature` from `measured_cost_ratios`'
    {T: {method: c}} (None or a missing entry: `default`)."""
    return (cost_ratios or {}).get(temperature, {}).get(name, default)


def measure_verify_cost(tokens: list[int], batch: int, repeats: int, context: int = 128, *,
                        config: ModelConfig, far: int | None = None) -> dict:
    """What a verify forward of T tokens costs relative to a one-token step after
    `context` cached tokens, on `config`'s shapes (random weights): median seconds per
    step at each T, their ratios, and the fitted jump, slope (`fit_verify_cost`) and
    per_token (`fit_per_token`). Each forward runs as the speculative loop's verify does
    on CPU: the pages untouched, the new tokens' keys/values beside them (`step_kv(
    write_in_layers=False)`); a write here would copy the whole pool, since nothing
    donates it as the loop's carry does.

    Each T is compiled twice: with the options `generate` compiles with
    (`specjax.xla_options`, the figures the fit uses) and without YNNPACK fusions
    (`NO_YNN`), so one run shows what that option would change. With `far`, each T is
    also timed after `far` cached tokens (generate's options), interleaved with the rest:
    `far_seconds`, and `far` = those seconds over T = 1's at `context`
    (`VerifyCost.from_table(contexts=, far=)`). `attended`: the cached tokens each
    context's attention reads (`policy.attended_tokens`: the context itself where the
    CPU attention kernel runs, else the page table), so what `contexts=` takes."""
    model = init_model(config, seed=0)
    params = model.decode_params()  # the layout `generate` decodes with
    page = 16
    contexts = (context,) if far is None else (context, far)
    fns, attended = {}, []
    for c in contexts:
        pages = -(-(c + max(tokens)) // page)
        attended.append(int(attended_tokens(None, pages * page, [c])))
        table = jnp.arange(batch * pages, dtype=jnp.int32).reshape(batch, pages)
        cache = PagedKVCache.create(config, table, num_pages=batch * pages, page_size=page,
                                    lengths=jnp.full((batch,), c, jnp.int32))
        for t in tokens:
            ids = jnp.asarray(np.random.default_rng(t).integers(0, config.vocab_size,
                                                                 (batch, t)))
            pos = c + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (batch, t))
            mask = None if t == 1 else ancestor_mask(chain(ids[:, 1:]).parents, t - 1)
            args = (params, cache, ids, pos, mask)
            with rows_matmul.any_rows():  # as generate's decode loop traces a verify
                lowered = jax.jit(lambda p, kv, i, q, m: step_kv(
                    config, p, kv, i, q, mask=m, write_in_layers=False)[0]).lower(*args)
            variants = (("generate", compile_decode(lowered)),)
            if c == context:
                variants += (("no_ynn", lowered.compile(compiler_options=NO_YNN)),)
            for variant, fn in variants:
                fn(*args).block_until_ready()  # first run
                fns[variant if c == context else "far", t] = (fn, args)
    med = interleaved_medians(fns, repeats)
    out = dict(params=model.num_params(), attended=tuple(attended),
               name=f"{config.model_type}, {config.num_layers} layers x {config.hidden_size}")
    for variant, suffix in (("generate", ""), ("no_ynn", "_no_ynn")):
        sec = {t: med[variant, t] for t in tokens}
        out["seconds" + suffix] = sec
        out["ratio" + suffix] = {t: sec[t] / sec[tokens[0]] for t in tokens}
    if far is not None:
        out["far_seconds"] = {t: med["far", t] for t in tokens}
        out["far"] = {t: med["far", t] / med["generate", tokens[0]] for t in tokens}
    small = {t: r for t, r in out["ratio"].items() if t < LINEAR_FROM}
    out["jump"], out["slope"] = fit_verify_cost(small)
    out["per_token"] = fit_per_token(out["ratio"])
    return out


# From this many tokens on, the forward is compute-bound: cost grows linearly in T.
LINEAR_FROM = 33


def fit_per_token(ratio: dict[int, float]) -> float:
    """per_token of cost(T)/cost(1) ≈ per_token·T over the measured T >= LINEAR_FROM
    (least squares through the origin); 0 when none was measured."""
    ts = np.asarray([t for t in ratio if t >= LINEAR_FROM], np.float64)
    if not len(ts):
        return 0.0
    y = np.asarray([ratio[int(t)] for t in ts], np.float64)
    return float(ts @ y / (ts @ ts))


def fit_verify_cost(ratio: dict[int, float]) -> tuple[float, float]:
    """(jump, slope) of cost(T)/cost(1) = 1 + jump + slope·log2(T) for T > 1, by least
    squares over the measured T > 1, both kept >= 0 (`specjax.decoding.cost.VerifyCost`)."""
    ts = [t for t in ratio if t > 1]
    if not ts:
        return 0.0, 0.0
    x = np.log2(np.asarray(ts, np.float64))
    y = np.asarray([ratio[t] - 1 for t in ts], np.float64)
    if len(ts) > 1:
        jump, slope = np.linalg.lstsq(np.stack([np.ones_like(x), x], 1), y, rcond=None)[0]
        if jump >= 0 and slope >= 0:
            return float(jump), float(slope)
        if slope < 0:  # flat or falling: a pure jump
            return max(float(y.mean()), 0.0), 0.0
    return 0.0, max(float(x @ y / (x @ x)), 0.0)  # one point, or no jump: slope alone


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What a calibration pass measured for one speculator at one temperature: the
    acceptance per depth the adaptive rule starts from, and the speculative step's
    overhead (`step_overhead`), one value or one per draft depth 1..max_depth
    (`depth_overheads`), with the tries the acceptance is measured from
    (`effective_tries`); `generate(**c.generate_kwargs())` takes them."""

    prior: list | None = None
    overhead: float | list[float] = 0.0
    proposal: float | None = None  # how often the speculator found a draft when asked
    idle: float = 0.0  # a step at k = 0 in the speculative loop, over a plain one, less 1
    tries: list | None = None  # per depth; None: unknown (the prior taken as exact)
    # per timed call, seconds per loop step of each pass priced here and the fitted plain
    # step they were priced against (`pass_timing`): not for generate, so that a figure
    # read high or low can be traced to the calls and passes that made it
    timing: dict | None = None

    def generate_kwargs(self) -> dict:
        return dict(acceptance_prior=self.prior, step_overhead=self.overhead,
                    proposal_prior=self.proposal, idle_overhead=self.idle,
                    prior_tries=self.tries)


def best_calibrated(target: Model, candidates: dict, calibrations: dict, *,
                    cost_ratios: dict | None = None, batch: int = 1, context: int = 0,
                    verify_cost: VerifyCost | None = None) -> tuple[str, dict[str, float]]:
    """(the name, {name: expected gain}) of the candidate speculator that the adaptive
    rule, from each one's calibration on the same prompts, expects to gain most: e.g.
    one head's tree shapes, where a wide tree's verify costs more than its deeper
    acceptance returns on one machine and pays on another. Ties go to the first;
    candidates without a calibration are left out. verify_cost: as `generate` takes it
    (None: this backend's table). Each is priced by `generate.expected_gain`."""
    from specjax.decoding.generate import expected_gain

    gains = {name: expected_gain(target, spec, batch=batch, context=context,
                                 cost_ratio=(cost_ratios or {}).get(name),
                                 verify_cost=verify_cost,
                                 **calibrations[name].generate_kwargs())
             for name, spec in candidates.items() if calibrations.get(name) is not None}
    if not gains:
        raise ValueError(f"no calibration for any of {list(candidates)}")
    return max(gains, key=lambda n: gains[n]), gains


def choose_tree(target: Model, method: str, candidates: dict, calibrations: dict,
                cost_ratios: dict, *, batch: int = 1, context: int = 0) -> tuple[str, dict]:
    """Of `method`'s EAGLE tree shapes among `candidates` (`method` itself and
    `method@top_k,depth,nodes`), with their calibrations and c by name, the one the
    rule prices best (`best_calibrated`): (its name, a record of the chosen tree and
    every shape's expected gain, by "top_k,depth,nodes")."""
    from specjax.speculators import method_of
    from specjax.speculators.eagle import tree_label

    shapes = {n: spec for n, spec in candidates.items() if method_of(n) == method}
    best, gains = best_calibrated(target, shapes, calibrations, cost_ratios=cost_ratios,
                                  batch=batch, context=context)
    return best, dict(method=method, chosen=tree_label(shapes[best]),
                      gains={tree_label(shapes[n]): g for n, g in gains.items()})


def chosen_shapes(speculators: dict, alternatives: dict | None, choices: dict | None,
                  key) -> tuple[dict, dict]:
    """For one cell of a comparison, each method's chosen tree shape (`choose_tree`):
    ({method: the name it is calibrated and priced under}, {method: the speculator it
    runs}). choices: {key(method): name}; alternatives: {name: speculator}; a method
    with no choice runs as itself."""
    pick = {name: (choices or {}).get(key(name), name) for name in speculators}
    return pick, {name: (alternatives or {}).get(pick[name], spec)
                  for name, spec in speculators.items()}


def calibrated_kwargs(calibration: Calibration | None, speculator) -> dict:
    """generate's calibrated arguments for a call with `speculator`: none for plain
    decoding (speculator None) or without a calibration."""
    if speculator is None or calibration is None:
        return {}
    return calibration.generate_kwargs()


def step_overhead(full: GenerationStats, full_decode_s: float, plain_step_s: float,
                  steps: int | None = None, drafting: int | None = None,
                  empty: float = 0.0) -> float:
    """A speculative step's cost beyond what the rule models for it, in one-token target
    steps of the batch (>= 0): a full-depth pass's seconds per loop step over a plain
    step's, less its modelled draft calls (n·c) and verify forward (v, `VerifyCost`). It
    is the work the model has no term for: building and reranking the tree, the verifier
    (sampled at T > 0), the commit and the speculator's own state, in the compiled loop
    itself. steps: the loop steps the pass ran (None: its target calls, one row).
    drafting: the steps that drafted, to charge the excess to them, less `empty` for
    each other step (what a step that drafts nothing costs beyond its model, e.g. the
    `idle_overhead` of the same calls); None: spread over every loop step. Where a
    speculator peeks, only its drafting steps run in the verify switch
    (`Speculator.peeks`): spread over a pass whose lookup finds a match at 10 % of the
    steps, the verifier's work would read a tenth of its cost."""
    calls = full.target_calls
    steps = calls if steps is None else steps
    if calls == 0 or steps == 0 or plain_step_s <= 0 or drafting == 0:
        return 0.0
    measured = full_decode_s / steps / plain_step_s
    modelled = full.verify_cost + full.cost_ratio * full.draft_calls / calls
    excess = measured - modelled
    if drafting is not None:
        excess = (excess * steps - empty * (steps - drafting)) / drafting
    return max(excess, 0.0)


def drafting_steps(stats: GenerationStats, speculator, batch: int) -> int | None:
    """The steps that drafted in a calibration pass at `batch` rows, for `step_overhead`,
    where they alone carry the step's overhead: a speculator that peeks at batch 1 (its
    other steps run as plain steps, priced apart); None elsewhere (at batch > 1 a row
    asked to draft pays the batch's step whether or not it finds a draft)."""
    if not (speculator.peeks and batch == 1):
        return None
    return int(stats.tried_hist[0]) if stats.tried_hist else 0


def idle_kwargs(speculator, new_tokens: int, verify_cost: VerifyCost | None = None) -> dict:
    """generate's arguments that keep every row of a speculative call at k = 0 with no
    probe, yet not settled: the loop a call that could still draft runs while its rows
    draft nothing (`idle_overhead`). A prior α of 0 keeps k at 0; free draft calls and
    verify forwards make four accepted probes look worth drafting, so the rows stay
    able to probe (not settled); and no probe is due within the call. The free verify
    takes `verify_cost`'s form (`VerifyCost.free`; None: `VerifyCost()`), so that with
    the cost model the other passes run, this pass runs their compiled loop."""
    free = (verify_cost if verify_cost is not None else VerifyCost()).free()
    return dict(speculator=speculator, adaptive=True,
                acceptance_prior=[0.0] * speculator.shape.max_depth, cost_ratio=0.0,
                verify_cost=free, step_overhead=0.0, idle_overhead=0.0,
                probe_gap=new_tokens + 1)


def shallow_kwargs(speculator, new_tokens: int, cost_ratio: float | None) -> dict:
    """generate's arguments that keep every row of a speculative call drafting depth 1:
    a prior α of 1 at depth 1 and 0 deeper, deeper depths never tried so never raised,
    and no probe due within the call; the draft calls and verify forwards priced as the
    timed runs price them (`cost_ratio`, the default table), so a row whose depth-1
    drafts do not pay at all falls to k = 0 and its steps are priced as such."""
    depth = speculator.shape.max_depth
    return dict(speculator=speculator, adaptive=True,
                acceptance_prior=[1.0] + [0.0] * (depth - 1), cost_ratio=cost_ratio,
                step_overhead=0.0, idle_overhead=0.0, probe_gap=new_tokens + 1)


def depth_overheads(shallow: float, full: float, max_depth: int) -> list[float]:
    """The step's overhead at each draft depth 1..max_depth, linear between what a
    depth-1 pass (`shallow`) and a full-depth pass (`full`) measured: a deeper tree
    takes more draft calls' bookkeeping, top-k and reranking, which the verify table and
    c do not price. One depth: the full-depth pass's figure. A convex combination, so
    that each figure lies between the two exactly (`shallow + (full - shallow) * t` came
    out at -4e-19 for a full-depth 0, which `generate` rejects as a negative overhead)."""
    if max_depth == 1:
        return [full]
    weights = [(k - 1) / (max_depth - 1) for k in range(1, max_depth + 1)]
    return [shallow * (1 - t) + full * t for t in weights]


# The least upkeep a calibration reports for a step of the speculative loop that drafts
# nothing (`idle_overhead`), in plain steps. That loop does more than a plain step, and
# the timing reads its upkeep at 0.00-0.04 from run to run. With a reading of 0 every
# probe looks free to the rule, so a row whose drafts are rarely accepted keeps
# probing, and a call that gains nothing runs the speculative loop (0.97× plain
# decoding, docs/benchmarks.md, "n-gram over a corpus").
MIN_IDLE = 0.01


def idle_overhead(idle_decode_s: float, idle_steps: int, plain_step_s: float) -> float:
    """What a step that drafts nothing costs inside the speculative loop beyond a plain
    decoding step, in plain steps (>= `MIN_IDLE`): the speculator's commit and its queue
    calls, the nested loop and the outer step's decision; from a pass run with
    `idle_kwargs`."""
    if idle_steps == 0 or plain_step_s <= 0:
        return MIN_IDLE
    return max(idle_decode_s / idle_steps / plain_step_s - 1.0, MIN_IDLE)


def effective_tries(calls: list[GenerationStats]) -> list[float | None]:
    """Per draft depth, the tries the pooled acceptance of `calls` is worth (None where
    the depth was never tried): its tries over every call, or fewer where the calls
    disagree more than independent tries would, n = α(1 - α) / Var(α), Var(α) being the
    ratio estimator's variance between calls (`generate(prior_tries=)`). A call's tries
    are of one prompt and move together: 100 tries over 4 prompts whose acceptance
    differs say less about a fifth prompt than 100 tries of one coin. The design effect
    of cluster sampling (Kish), the calls the clusters."""
    depth = max((len(c.tried_hist) for c in calls), default=0)
    tried = np.zeros((len(calls), depth))
    hits = np.zeros((len(calls), depth))
    for i, c in enumerate(calls):
        tried[i, :len(c.tried_hist)] = c.tried_hist
        at_least = accepted_at_least(np.asarray(c.accepted_hist, np.float64))
        hits[i, :len(at_least)] = at_least[:depth]
    out: list[float | None] = []
    for a, n in zip(hits.T, tried.T):
        total = n.sum()
        if total == 0:
            out.append(None)
            continue
        p = a.sum() / total
        m = int((n > 0).sum())
        if m < 2 or p in (0.0, 1.0):
            out.append(float(total))
            continue
        var = m / (m - 1) * np.sum((a - p * n) ** 2) / total ** 2
        out.append(float(min(total, p * (1 - p) / var)) if var > 0 else float(total))
    return out


def call_step(stats: GenerationStats) -> tuple[float, int]:
    """(decode seconds, loop steps) of one `generate` call."""
    return stats.wall_s - stats.ttft_s, loop_steps(stats)


def fitted_plain_steps(step_s: np.ndarray, plain: int) -> np.ndarray:
    """[calls] each call's plain step in seconds, fitted from `step_s` [calls, passes],
    every pass's seconds per loop step (the `plain` plain passes first; nan: it ran
    none): log times as a call's load plus a pass's cost, by one sweep of Tukey's median
    polish, every plain pass of every call counted in the plain step's cost. A call the
    host slowed throughout prices its passes as slowed, while one pass the host sped up
    or slowed alone, a plain one too, prices none of them: on a shared host one pass can
    run much faster or slower than the passes beside it. Written here: no library of the
    project's offers a median polish, and it is three medians."""
    logs = np.log(step_s)
    plain_logs = logs[:, :plain]
    if np.isnan(plain_logs).all():  # no plain pass ran a step: nothing to price against
        return np.full(len(logs), np.nan)
    logs = logs[:, ~np.isnan(logs).all(axis=0)]
    passes = np.nanmedian(logs, axis=0, keepdims=True)  # each pass's cost over the calls
    calls = np.nanmedian(logs - passes, axis=1)  # each call's load
    return np.exp(calls + np.nanmedian(plain_logs - calls[:, None]))


def pass_timing(step_s: dict, fitted: np.ndarray) -> dict:
    """`Calibration.timing`: {pass: [calls] seconds per loop step} and "fitted": the
    fitted plain steps, as JSON takes them (a call whose pass ran no step: None)."""
    listed = lambda a: [float(x) if np.isfinite(x) else None for x in np.asarray(a).ravel()]
    return {**{kind: listed(s) for kind, s in step_s.items()}, "fitted": listed(fitted)}


def priced_median(passes: list[GenerationStats], plain_step_s: np.ndarray,
                  price: Callable[[GenerationStats, float, int, float], float]) -> float:
    """The median over calls of `price(stats, decode seconds, loop steps, plain step
    seconds)`, each call's pass priced against that call's fitted plain step
    (`fitted_plain_steps`): the same prompts, beside the same machine load. Taking the
    fastest of each pass instead compares moments the host was quiet for one pass and
    not the other; the median of `MIN_TIMED_CALLS` or more calls leaves a mistimed
    pass out. Calls where the pass ran no step are left out (0.0 when none is left)."""
    priced = []
    for s, plain_s in zip(passes, plain_step_s):
        secs, steps = call_step(s)
        if steps > 0 and np.isfinite(plain_s):
            priced.append(price(s, secs, steps, float(plain_s)))
    return float(np.median(priced)) if priced else 0.0


def loop_steps(stats: GenerationStats) -> int:
    """The loop steps a `generate` call (or calls, merged) ran: each call runs until its
    longest-running row is done, so the most target calls of any of its rows."""
    return max((r["target_calls"] for r in stats.rows), default=0)


def filled_batches(prompts, batch: int) -> list[list]:
    """`prompts` in calls of exactly `batch` rows, repeated in order to fill the last
    (none without prompts)."""
    if not prompts:
        return []
    n = -(-max(len(prompts), batch) // batch) * batch
    return [[prompts[j % len(prompts)] for j in range(i, i + batch)] for i in range(0, n, batch)]


# Timed calls per pass at the least: each pass is priced at the median of its calls
# against their fitted plain steps (`priced_median`), and a median of five leaves two
# mistimed passes out, where one call alone on a shared host can read a loop's upkeep as
# 0 in one run and a third of a step in the next, and of three calls two plain passes
# caught running fast read every T = 1 overhead high (docs/benchmarks.md, "Earlier
# runs, in short" and "The quickstart").
MIN_TIMED_CALLS = 5

# The plain passes of each calibration call, the one that opens it and the one that
# closes it (`calibrations`); both count in the call's plain step (`fitted_plain_steps`).
PLAIN_PASSES = ("plain", "closing")


def timed_calls(calls: list[list], least: int = MIN_TIMED_CALLS) -> list[list]:
    """`calls` repeated in order until there are at least `least` of them (none stay
    none): at batch > 1 a few calibration prompts fill one call."""
    if not calls:
        return []
    return [calls[i % len(calls)] for i in range(max(len(calls), least))]


def warmup_calls(calls: list[list]) -> list[tuple[int, list]]:
    """(index, rows) of the first call of each shape (its rows' lengths): the calls that
    compile and first run every program all of `calls` use."""
    first = {}
    for i, rows in enumerate(calls):
        first.setdefault(tuple(len(r) for r in rows), (i, rows))
    return list(first.values())


def calibrations(target: Model, speculators: dict, prompts, *, new_tokens: int,
                 temperatures=(0.0,), seed: int = 0, cost_ratios: dict | None = None,
                 verification: str | None = None, batch: int = 1) -> dict:
    """{temperature: {method: `Calibration`}} for every speculator (None: autoregressive,
    skipped), in `generate` calls of `batch` rows (the prompts repeated to fill the last;
    call i seeded `seed + i`; at least `MIN_TIMED_CALLS` calls, repeating them
    (`timed_calls`)): calibrate at the batch size the runs will use, since a verify's
    cost and the loop's own work grow differently with the batch.

    Per call, plain decoding and then every speculator at full depth (adaptive=False:
    every depth is tried whenever the one before was accepted), at depth 1
    (`shallow_kwargs`; speculators deeper than 1) and drafting nothing (`idle_kwargs`),
    then plain decoding again, so that each sees the same machine load. The full-depth
    pass gives the acceptance per depth, so a good draft drafts deep from its first
    step, and how often the speculator finds a draft; timed against the plain passes, it
    and the depth-1 pass give the step's overhead at both ends (`step_overhead`,
    `depth_overheads`): one figure from the full depth would price a one-level tree's
    step at a four-level tree's bookkeeping. The idle pass gives what its loop costs
    where it drafts nothing (`idle_overhead`). The acceptance comes with the tries it is
    worth, its calls' disagreement counted (`effective_tries`, over the calls of
    distinct prompts), which bounds generate's choice to draft at all
    (`policy.may_draft`). Each pass runs once untimed first (on the first call of each
    shape, `warmup_calls`), at the first temperature only: temperature is traced, so
    every temperature runs the same programs. Each pass is priced per call against that
    call's plain step as fitted from all of the call's passes, both plain ones in its
    cost (`fitted_plain_steps`), and the median over calls counts (`priced_median`): on
    a shared host one slowed pass of a few seconds would read as a large overhead, and a
    plain pass slowed or sped up alone would misprice every pass of its call. Each
    `Calibration` keeps the per-call timings it was priced from (`timing`).
    cost_ratios: {temperature: {method: c}} as the timed runs price draft calls
    (`measured_cost_ratios`, at this batch). Compilation is not timed."""
    from specjax.decoding.generate import generate
    from specjax.stats import merge_stats

    specs = {name: spec for name, spec in speculators.items() if spec is not None}
    distinct = filled_batches(list(prompts), batch)
    calls = timed_calls(distinct)
    out = {}
    for n, temp in enumerate(temperatures):
        def passes(i, rows, closing=True):
            """Call i's plain pass, then each speculator's full-depth, depth-1 and idle
            passes, then (`closing`) plain decoding again."""
            kw = dict(max_new_tokens=new_tokens, temperature=temp, seed=seed + i,
                      ignore_eos=True, verification=verification)
            plain = lambda: generate(target, rows, **{**kw, "verification": None}).stats
            yield "plain", None, plain()
            for name, spec in specs.items():
                c = cost_ratio_of(cost_ratios, temp, name)
                yield "full", name, generate(target, rows, **kw, speculator=spec,
                                             adaptive=False, cost_ratio=c).stats
                if spec.shape.max_depth > 1:
                    yield "shallow", name, generate(
                        target, rows, **kw, **shallow_kwargs(spec, new_tokens, c)).stats
                yield "idle", name, generate(target, rows, **kw, **idle_kwargs(
                    spec, new_tokens, default_verify_cost(target.config))).stats
            if closing:
                yield "closing", None, plain()

        # A program's first run after compiling is slower by a fixed cost per call, which
        # weighs more on the speculative pass's fewer steps and would read as overhead:
        # every program runs once before the timed pass. A call's programs depend on its
        # shapes only (not on the temperature), so one call per shape, at the first
        # temperature, runs them all (the closing plain pass runs the opening one's).
        for i, rows in warmup_calls(calls) if n == 0 else ():
            for _ in passes(i, rows, closing=False):
                pass
        stats = {(kind, None): [] for kind in PLAIN_PASSES}
        stats.update({(kind, name): [] for name in specs for kind in ("full", "shallow", "idle")})
        for i, rows in enumerate(calls):
            for kind, name, s in passes(i, rows):
                stats[kind, name].append(s)
        step_s = {key: np.array([secs / steps if steps > 0 else np.nan
                                 for secs, steps in map(call_step, timed)])
                  for key, timed in stats.items() if timed}
        # both plain passes of each call count, so that openings the host sped up in more
        # than half the calls misprice none
        fitted = (fitted_plain_steps(np.stack(list(step_s.values()), axis=1),
                                     plain=len(PLAIN_PASSES)) if calls else np.zeros(0))
        out[temp] = {}
        for name, spec in specs.items():
            if not stats["full", name]:
                out[temp][name] = Calibration()
                continue
            idle = priced_median(stats["idle", name], fitted,
                                 lambda s, secs, steps, plain_step_s: idle_overhead(
                                     secs, steps, plain_step_s))
            # where only drafting steps carry it, the other steps' share is the idle one
            over = {kind: priced_median(
                        stats[kind, name], fitted, lambda s, secs, steps, plain_step_s:
                        step_overhead(s, secs, plain_step_s, steps,
                                      drafting_steps(s, spec, batch), idle))
                    for kind in ("full", "shallow") if stats[kind, name]}
            full = merge_stats(stats["full", name])
            out[temp][name] = Calibration(
                full.acceptance_by_position,
                depth_overheads(over.get("shallow", over["full"]), over["full"],
                                spec.shape.max_depth),
                full.proposal_rate, idle,
                # a repeated call's prompts are no new prompts: its tries are not counted
                effective_tries(stats["full", name][:len(distinct)]),
                pass_timing({kind: s for (kind, m), s in step_s.items()
                             if m in (None, name)}, fitted))
    return out


def calibration(target: Model, speculator, prompts, *, new_tokens: int,
                temperature: float = 0.0, seed: int = 0, cost_ratio: float | None = None,
                verification: str | None = None, batch: int = 1) -> Calibration:
    """`calibrations` for one speculator at one temperature (no prompts: the defaults)."""
    return calibrations(target, {"spec": speculator}, prompts, new_tokens=new_tokens,
                        temperatures=(temperature,), seed=seed,
                        cost_ratios={temperature: {"spec": cost_ratio}},
                        verification=verification, batch=batch)[temperature]["spec"]
