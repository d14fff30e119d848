"""What a speculative loop step costs against a plain decoding step, pass by pass, on a
quickstart run's target, speculator and held-out prompts.

  python -m specjax.bench.loop_steps --workdir runs/quickstart [--method eagle3]
      [--temperature 0] [--rounds 3] [--category completion [--prompts 16]
      [--calibrate 4]]

Passes: plain decoding; "adaptive", the timed run's own `generate` call (the rule fed the
calibration and draft cost ratio the run's results.json recorded); "no_peek", the same
with a speculator that peeks (the n-gram) asking for a draft wherever the rule drafts
(`NGram(peek=False)`); "full", every depth drafted every step (adaptive=False); "idle",
the speculative loop drafting nothing (`specjax.calibrate.idle_kwargs`). With
`--category`, the prompts are `specjax.bench.suite`'s of that category (its default
lengths and seed), and the calibration is measured first on `--calibrate` other prompts
of it, as the suite's `--calibrate` does at batch 1. Each pass decodes the prompts one
call at a time; the passes interleave in a balanced order per round
(`specjax.timing.side_by_side`: a noisy host slows whichever runs then), and each reports
the median over rounds of its decode seconds per loop step over plain decoding's, its
decode and prefill seconds, its loop steps, and the acceptance per draft position.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import specjax
from specjax.calibrate import Calibration, call_step, idle_kwargs, warmup_calls
from specjax.decoding.cost import default_verify_cost
from specjax.speculators import NGram
from specjax.stats import merge_stats
from specjax.timing import side_by_side

# the quickstart's method names -> `bench.speculative.build_speculators`' for the same
SPECULATOR_NAMES = {"ngram": "ngram", "draft": "draft", "eagle3": "eagle"}


def pass_kwargs(speculator, calibration: Calibration, cost_ratio: float | None,
                new_tokens: int, verify_cost=None) -> dict[str, dict]:
    """generate's speculator arguments for each pass, by name (plain first)."""
    adaptive = dict(speculator=speculator, adaptive=True, cost_ratio=cost_ratio,
                    **calibration.generate_kwargs())
    passes = {"plain": {}, "adaptive": adaptive}
    if speculator.peeks and isinstance(speculator, NGram):
        passes["no_peek"] = dict(adaptive, speculator=speculator.replace(peek=False))
    return {**passes,
            "full": dict(speculator=speculator, adaptive=False, cost_ratio=cost_ratio),
            "idle": idle_kwargs(speculator, new_tokens, verify_cost)}


def time_passes(target: specjax.Model, prompts: list[list[int]], passes: dict[str, dict], *,
                temperature: float, new_tokens: int, rounds: int, seed: int = 0) -> dict:
    """{pass: {step_ratio, decode_s, ttft_s, steps, acceptance}}: medians over `rounds`
    interleaved rounds of every prompt (call i seeded `seed + i`), each pass's decode
    seconds per loop step over the plain pass's; every pass first runs each prompt
    shape once untimed (`calibrate.warmup_calls`), so no timed call compiles."""
    if "plain" not in passes or rounds < 1 or not prompts:
        raise ValueError(f"need a 'plain' pass, rounds >= 1 (got {rounds}) and prompts "
                         f"(got {len(prompts)})")

    calls = [[p] for p in prompts]

    def run(kw, which):
        return [specjax.generate(target, rows, max_new_tokens=new_tokens,
                                 temperature=temperature, seed=seed + i, ignore_eos=True,
                                 **kw).stats for i, rows in which]

    for kw in passes.values():
        run(kw, warmup_calls(calls))
    runs = side_by_side({name: lambda kw=kw: run(kw, enumerate(calls))
                         for name, kw in passes.items()}, rounds)
    per_step = {}
    out = {}
    for name, per_round in runs.items():
        per_call = [[call_step(s) for s in stats] for stats in per_round]
        decode = [sum(secs for secs, _ in calls) for calls in per_call]
        steps = [sum(n for _, n in calls) for calls in per_call]
        per_step[name] = statistics.median(d / max(n, 1) for d, n in zip(decode, steps))
        out[name] = dict(decode_s=statistics.median(decode),
                         ttft_s=statistics.median(sum(s.ttft_s for s in st) for st in per_round),
                         steps=steps[-1],
                         acceptance=merge_stats(per_round[-1]).acceptance_by_position)
    for name, row in out.items():
        row["step_ratio"] = per_step[name] / per_step["plain"]
    return out


def format_table(results: dict) -> str:
    lines = ["| pass | step / plain step | decode speedup | decode s | prefill s | loop steps "
             "| α by position |", "|---|---|---|---|---|---|---|"]
    plain = results["plain"]["decode_s"]
    for name, r in results.items():
        acc = ", ".join("–" if a is None or a != a else f"{a:.2f}" for a in r["acceptance"]) or "–"
        lines.append(f"| {name} | {r['step_ratio']:.3f} | {plain / r['decode_s']:.2f}× | "
                     f"{r['decode_s']:.2f} | {r['ttft_s']:.3f} | {r['steps']} | {acc} |")
    return "\n".join(lines)


def _run_inputs(workdir: Path, method: str, temperature: float):
    """(target, speculator, calibration, cost ratio, prompts, new tokens) as the
    quickstart run in `workdir` timed `method` at `temperature`."""
    from specjax.bench.speculative import build_speculators, workdir_paths

    res_file = workdir / "results.json"
    if not res_file.exists():
        raise SystemExit(f"{res_file} is missing: run the quickstart into {workdir} first")
    res = json.loads(res_file.read_text())
    if "prompts" not in res:
        raise SystemExit(f"{res_file} records no prompt ids (an older evaluation): remove "
                         "it and run the quickstart again to re-evaluate")
    priors = (res.get("priors") or {}).get(str(float(temperature)), {})
    if method not in priors:
        raise SystemExit(f"--method {method!r} at temperature {temperature}: the run "
                         f"calibrated {sorted(priors)}")
    paths = workdir_paths(workdir)
    target = specjax.load(paths["target"], dtype="float32")
    draft = specjax.load(paths["draft"], dtype="float32") if method == "draft" else None
    specs = build_speculators(target, draft=draft, eagle=paths["eagle"],
                              k=res["settings"]["k"], draft_vocab=paths["draft_vocab"])
    cost = next(r["cost_ratio"] for r in res["rows"]
                if r["method"] == method and r["temperature"] == temperature)
    return (target, specs[SPECULATOR_NAMES[method]], Calibration(**priors[method]), cost,
            res["prompts"], res["settings"]["new"])


def _category_inputs(workdir: Path, method: str, temperature: float, category: str,
                     num: int, calibrate: int, suite_flags: tuple[str, ...] = ()):
    """`_run_inputs` for `specjax.bench.suite`'s prompts of `category` (`num` of them) at
    batch 1: c measured and the rule calibrated on `calibrate` other prompts of the
    category, as the suite does (`suite_flags`: more of its flags, e.g. lengths)."""
    from specjax.bench import suite
    from specjax.bench.speculative import build_speculators
    from specjax.calibrate import cost_ratio_of, measured_cost_ratios

    name = SPECULATOR_NAMES[method]
    args = suite.parse_args(["--workdir", str(workdir), "--categories", category,
                             "--methods", name, "--batches", "1", "--prompts", str(num),
                             "--temperatures", str(temperature),
                             "--calibrate", str(calibrate), *suite_flags])
    paths = suite.Workdir.check(workdir, args.methods)
    docs, _ = paths.heldout_documents()
    target = specjax.load(paths.target, dtype="float32")
    draft = specjax.load(paths.draft, dtype="float32") if method == "draft" else None
    spec = build_speculators(target, draft=draft, eagle=paths.eagle if name == "eagle" else None,
                             k=args.k, eagle_tree=args.eagle_tree,
                             draft_vocab=paths.draft_vocab)[name]
    lengths = suite.category_lengths(args)
    sets = suite.build_prompt_sets([category], docs, target.tokenizer, num, lengths, args.seed)
    costs = measured_cost_ratios(target, {name: spec}, args.temperatures)
    cal = suite._calibrated_priors(args, target, {name: spec}, sets, docs, lengths,
                                   {1: costs}, log=lambda _: None)
    return (target, spec, cal[category, temperature, 1, name],
            cost_ratio_of(costs, temperature, name), [p.ids for p in sets[category]],
            args.new)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specjax.bench.loop_steps",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True, type=Path, help="a quickstart run directory")
    ap.add_argument("--method", default="eagle3", choices=sorted(SPECULATOR_NAMES))
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--category", default=None,
                    help="time the suite's prompts of this category instead of the run's "
                         "(specjax.bench.suite's --categories)")
    ap.add_argument("--prompts", type=int, default=16, help="with --category: how many")
    ap.add_argument("--calibrate", type=int, default=4,
                    help="with --category: other prompts of it the rule is calibrated on")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds} must be >= 1")
    if args.category is None:
        target, spec, cal, cost, prompts, new = _run_inputs(args.workdir, args.method,
                                                            args.temperature)
    else:
        if args.prompts < 1 or args.calibrate < 1:
            ap.error(f"--prompts {args.prompts} and --calibrate {args.calibrate} must be >= 1")
        target, spec, cal, cost, prompts, new = _category_inputs(
            args.workdir, args.method, args.temperature, args.category, args.prompts,
            args.calibrate)
    passes = pass_kwargs(spec, cal, cost, new, default_verify_cost(target.config))
    res = time_passes(target, prompts, passes, temperature=args.temperature,
                      new_tokens=new, rounds=args.rounds)
    print(f"{args.method} at T = {args.temperature:g}, {len(prompts)} prompts of {new} new "
          f"tokens, {args.rounds} rounds (medians); calibration {cal}")
    print(format_table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
