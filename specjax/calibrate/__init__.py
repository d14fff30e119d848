"""Calibration: the measured numbers `generate`'s adaptive draft length and analytical
speedup take, as library functions (the benchmarks and the quickstart call them).

- `draft_cost`: c, a draft call's wall time over a target step's (`measured_cost_ratio(s)`,
  `draft_cost_ratios`), as `generate(cost_ratio=)` takes it.
- `verify_cost`: what verifying T tokens costs over one (`measure_verify_cost`,
  `fit_verify_cost`, `fit_per_token`), the table `VerifyCost.from_table` takes.
- `priors`: on calibration prompts, a speculator's acceptance per depth at full depth
  (with the tries it is worth), its step's overhead per draft depth and what a step
  that drafts nothing costs in its loop (`calibration(s)`, `Calibration`), as
  `generate(acceptance_prior=, prior_tries=, step_overhead=, idle_overhead=)` take them.
- `pricing`: how those passes' timings become the rule's numbers (each call priced
  against its fitted plain step, `fitted_plain_steps`, `priced_median`).
- `choice`: of several calibrated speculators (one head's tree shapes), the one the
  rule expects to gain most (`best_calibrated`, `choose_tree`).
"""

from specjax.calibrate.choice import best_calibrated, choose_tree, chosen_shapes
from specjax.calibrate.draft_cost import (
    cost_ratio_of,
    draft_cost_ratios,
    measured_cost_ratio,
    measured_cost_ratios,
)
from specjax.calibrate.pricing import (
    MIN_IDLE,
    call_step,
    depth_overheads,
    drafting_steps,
    effective_tries,
    fitted_plain_steps,
    idle_overhead,
    loop_steps,
    pass_timing,
    priced_median,
    step_overhead,
)
from specjax.calibrate.priors import (
    MIN_TIMED_CALLS,
    PLAIN_PASSES,
    Calibration,
    calibrated_kwargs,
    calibration,
    calibrations,
    filled_batches,
    idle_kwargs,
    shallow_kwargs,
    timed_calls,
    warmup_calls,
)
from specjax.calibrate.verify_cost import (
    LINEAR_FROM,
    NO_YNN,
    fit_per_token,
    fit_verify_cost,
    measure_verify_cost,
)

__all__ = ["best_calibrated", "calibrated_kwargs", "calibration", "Calibration",
           "calibrations", "call_step", "choose_tree", "chosen_shapes", "cost_ratio_of",
           "depth_overheads", "draft_cost_ratios", "drafting_steps", "effective_tries",
           "filled_batches", "fit_per_token", "fit_verify_cost", "fitted_plain_steps",
           "idle_kwargs", "idle_overhead", "LINEAR_FROM", "loop_steps",
           "measure_verify_cost", "measured_cost_ratio", "measured_cost_ratios",
           "MIN_IDLE", "MIN_TIMED_CALLS", "NO_YNN", "pass_timing", "PLAIN_PASSES",
           "priced_median", "shallow_kwargs", "step_overhead", "timed_calls",
           "warmup_calls"]
