"""From a calibration's timed passes to the rule's numbers: each pass priced per call
against that call's fitted plain step, the step overheads and the tries an acceptance
is worth."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from specjax.stats import GenerationStats, accepted_at_least


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
