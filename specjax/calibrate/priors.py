"""The calibration passes on calibration prompts: per speculator and temperature, the
`Calibration` (acceptance per depth, proposal rate, step overhead per depth, idle
upkeep) that `generate(**c.generate_kwargs())` starts from."""

from __future__ import annotations

import dataclasses

import numpy as np

from specjax.calibrate.draft_cost import cost_ratio_of
from specjax.calibrate.pricing import (
    call_step,
    depth_overheads,
    drafting_steps,
    effective_tries,
    fitted_plain_steps,
    idle_overhead,
    pass_timing,
    priced_median,
    step_overhead,
)
from specjax.decoding.cost import VerifyCost, default_verify_cost
from specjax.model import Model


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


def calibrated_kwargs(calibration: Calibration | None, speculator) -> dict:
    """generate's calibrated arguments for a call with `speculator`: none for plain
    decoding (speculator None) or without a calibration."""
    if speculator is None or calibration is None:
        return {}
    return calibration.generate_kwargs()


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
