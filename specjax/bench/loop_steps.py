"""What a speculative loop step costs against a plain decoding step, pass by pass, on a
quickstart run's target, speculator and held-out prompts.

  python -m specjax.bench.loop_steps --workdir runs/quickstart [--method eagle3]
      [--temperature 0] [--rounds 3]

Passes: plain decoding; "adaptive", the timed run's own `generate` call (the rule fed the
calibration and draft cost ratio the run's results.json recorded); "full", every depth
drafted every step (adaptive=False); "idle", the speculative loop drafting nothing
(`specjax.calibrate.idle_kwargs`). Each decodes the run's prompts one call at a time;
the passes interleave in a balanced order per round (`specjax.timing.side_by_side`: a
noisy host slows whichever runs then), and each reports the median over rounds of its
decode seconds per loop step over plain decoding's, its decode and prefill seconds, its
loop steps, and the acceptance per draft position.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import specjax
from specjax.calibrate import (
    Calibration,
    call_step,
    default_verify_cost,
    idle_kwargs,
    warmup_calls,
)
from specjax.stats import merge_stats
from specjax.timing import side_by_side

# the quickstart's method names -> `bench.speculative.build_speculators`' for the same
SPECULATOR_NAMES = {"ngram": "ngram", "draft": "draft", "eagle3": "eagle"}


def pass_kwargs(speculator, calibration: Calibration, cost_ratio: float | None,
                new_tokens: int, verify_cost=None) -> dict[str, dict]:
    """generate's speculator arguments for each pass, by name (plain first)."""
    return {"plain": {},
            "adaptive": dict(speculator=speculator, adaptive=True, cost_ratio=cost_ratio,
                             **calibration.generate_kwargs()),
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
    lines = ["| pass | step / plain step | decode s | prefill s | loop steps | α by position |",
             "|---|---|---|---|---|---|"]
    for name, r in results.items():
        acc = ", ".join("–" if a is None or a != a else f"{a:.2f}" for a in r["acceptance"]) or "–"
        lines.append(f"| {name} | {r['step_ratio']:.3f} | {r['decode_s']:.2f} | "
                     f"{r['ttft_s']:.3f} | {r['steps']} | {acc} |")
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specjax.bench.loop_steps",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True, type=Path, help="a quickstart run directory")
    ap.add_argument("--method", default="eagle3", choices=sorted(SPECULATOR_NAMES))
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds} must be >= 1")
    target, spec, cal, cost, prompts, new = _run_inputs(args.workdir, args.method,
                                                        args.temperature)
    passes = pass_kwargs(spec, cal, cost, new, default_verify_cost(target.config))
    res = time_passes(target, prompts, passes, temperature=args.temperature,
                      new_tokens=new, rounds=args.rounds)
    print(f"{args.method} at T = {args.temperature:g}, {len(prompts)} prompts of {new} new "
          f"tokens, {args.rounds} rounds (medians); calibration {cal}")
    print(format_table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
