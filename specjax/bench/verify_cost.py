"""What a verify forward of T tokens costs, relative to a one-token decode step.

Leviathan et al.'s expected speedup assumes verifying k+1 tokens costs one target step.
That holds while the forward is memory-bound (GPU/TPU decode at small T). On XLA:CPU one
token runs a memory-bound GEMV and two or more a GEMM that repacks the weights per call,
so the cost jumps at T = 2 and then grows slowly. This script times the jitted cached
target step (`specjax.step`, the same call the decode loop makes, tree mask included)
at T = 1 and larger T, interleaved, at a 128-token context, on the target's shapes
(default: the packaged SmolLM2-135M-Instruct, random weights of its config; `--target
bench`: the ~25M-param benchmark Llama), compiled as `generate` compiles
(`specjax.xla_options`) and without XLA:CPU's YNNPACK fusions side by side
(`specjax.calibrate.measure_verify_cost`), and fits cost(T) / cost(1) = 1 +
jump·[T > 1] + slope·log2(T)
by least squares over T < 33, and per_token·T over T >= 33 where the forward turns
compute-bound (a batch verifies rows × T tokens at once, so wide trees at batch > 1 land
there). `specjax.decoding.cost.VERIFY_COST` holds the measured ratios themselves
(`VerifyCost.from_table`; the adaptive draft length and the analytical speedup use it).

With `--far N` every T is timed again after N cached tokens, interleaved: the
reference attention reads every page of a row's table, so a verify's share of the step
grows with the context, and `VerifyCost.from_table(contexts=, far=)` makes each cost
affine in it between the two.

With `--batches 1,4,16` each batch size is timed in turn (T tokens per row) and the
docs section holds every table and the `VerifyCost.from_table` call for all of them.

  python -m specjax.bench.verify_cost [--target CKPT|bench] [--tokens 1,2,3,5,9,17,33,65,129]
      [--batches 1] [--repeats 30] [--context 128] [--far N] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

from specjax.bench.target import decode_matmul
from specjax.calibrate import LINEAR_FROM, measure_verify_cost
from specjax.cli_args import comma_list

START, END = "<!-- bench:verify_cost:start -->", "<!-- bench:verify_cost:end -->"


def markdown(results: dict[int, dict], repeats: dict[int, int], command: str) -> str:
    """The docs section: one table per batch size of `results` ({batch:
    `measure_verify_cost`'s result}), their fits, and the `VerifyCost.from_table` call
    that holds them."""
    from specjax.bench.decode import _machine, _versions

    first = next(iter(results.values()))
    near = first.get("context", 128)
    far = first.get("far_context")
    where = (f"after {near:,} cached tokens" if far is None else
             f"after {near:,} and after {far:,} cached tokens (the attention reads "
             f"{first['attended'][0]:,} and {first['attended'][1]:,} of them)")
    lines = [START, "## Verify cost: T tokens vs one, by context (the adaptive rule's cost "
             "model)", "", f"- date: {datetime.date.today().isoformat()}",
             f"- machine: {_machine()}", f"- versions: {_versions()}",
             f"- command: `{command}`",
             f"- model: {first['name']}, random weights, {first['params']:,} params, "
             f"float32; T tokens per row verified {where}; compiled as generate compiles "
             "(`specjax.xla_options.DECODE_OPTIONS`), beside the same forward without "
             "YNNPACK fusions (`xla_cpu_experimental_ynn_fusion_type=''`); median of the "
             "rounds (" + ", ".join(f"batch {b}: {repeats[b]}" for b in results) + "), every "
             "program timed once a round in a seeded random order, each right after an "
             "untimed run of itself"]
    for b, result in results.items():
        head = (f"| T | ms after {near:,} | cost / cost(T=1) | ms, no YNNPACK "
                "| cost / cost(T=1), no YNNPACK |")
        rule = "|---:|---:|---:|---:|---:|"
        if far is not None:
            head += (f" ms after {far:,} | that / cost(T=1) after {near:,} (`far`) | that / "
                     f"cost(T=1) after {far:,} |")
            rule += "---:|---:|---:|"
        lines += ["", f"Batch {b}:" if b == 1 else f"Batch {b} (T tokens per row):", "",
                  head, rule]
        for t, sec in result["seconds"].items():
            row = (f"| {t} | {sec * 1e3:.2f} | {result['ratio'][t]:.2f} | "
                   f"{result['seconds_no_ynn'][t] * 1e3:.2f} | "
                   f"{result['ratio_no_ynn'][t]:.2f} |")
            if far is not None:
                fs = result["far_seconds"]
                row += f" {fs[t] * 1e3:.2f} | {result['far'][t]:.2f} | {fs[t] / fs[1]:.2f} |"
            lines.append(row)
        lines += ["", f"Least-squares fit of cost(T)/cost(1) = 1 + jump·[T > 1] + "
                  f"slope·log2(T) over T < {LINEAR_FROM} and of per_token·T over T >= "
                  f"{LINEAR_FROM}, generate's options: **jump {result['jump']:.3f}, slope "
                  f"{result['slope']:.3f}, per_token {result['per_token']:.4f}** (a summary: the "
                  "rule uses the measured ratios, linear between them)."]
    lines += ["", "The tables as `specjax.decoding.cost.VERIFY_COST` takes them (its `branch`, "
              "the verify switch's own cost, comes from `python -m specjax.bench.branching`):",
              "", "```python", from_table_call(results), "```", END]
    return "\n".join(lines) + "\n"


def _points(table: dict) -> str:
    return "{" + ", ".join(f"{t}: {r:.2f}" for t, r in table.items()) + "}"


def from_table_call(results: dict[int, dict]) -> str:
    """`VerifyCost.from_table(...)` holding `results` ({batch: `measure_verify_cost`'s
    result}; the smallest batch must be 1): the ratios, `by_rows` for the other batches
    and, where timed after a second context, `contexts` and `far`."""
    batches = sorted(results)
    if batches[0] != 1:
        raise ValueError(f"batches={batches}: VerifyCost.from_table needs batch 1's table")
    args = [_points(results[1]["ratio"])]
    if len(batches) > 1:
        args.append("by_rows={" + ", ".join(f"{b}: {_points(results[b]['ratio'])}"
                                            for b in batches[1:]) + "}")
    if "far" in results[1]:
        args.append(f"contexts={tuple(results[1]['attended'])}")
        args.append("far={" + ", ".join(f"{b}: {_points(results[b]['far'])}"
                                        for b in batches) + "}")
    return "VerifyCost.from_table(" + ", ".join(args) + ")"


def target_config(target: str | None):
    """The config `--target` names: a checkpoint's (None: the packaged SmolLM2), or the
    ~25M benchmark Llama for 'bench'."""
    import specjax
    from specjax.bench.decode import BENCH_CONFIG
    from specjax.config import ModelConfig

    if target == "bench":
        return ModelConfig(**BENCH_CONFIG)
    from specjax.checkpoint import packaged

    return specjax.load(str(packaged.smollm2() if target is None else target)).config


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specjax.bench.verify_cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="a checkpoint whose config to time "
                    "(anything specjax.load reads; default: the packaged SmolLM2), or "
                    "'bench' for the ~25M benchmark Llama")
    ap.add_argument("--tokens", default="1,2,3,5,9,17,33,65,129")
    ap.add_argument("--batches", default="1",
                    help="batch sizes, each timed in turn (VERIFY_COST: 1,4,16)")
    ap.add_argument("--repeats", default="30",
                    help="rounds per batch size: one number, or one per --batches entry")
    ap.add_argument("--context", type=int, default=128,
                    help="cached tokens before the verified ones")
    ap.add_argument("--far", type=int, default=None,
                    help="also time every T after this many cached tokens, for "
                    "VerifyCost.from_table(contexts=(context, far), far=...)")
    ap.add_argument("--out", default="docs/benchmarks.md",
                    help="markdown file to write the tables into ('' = don't write)")
    args = ap.parse_args(argv)
    tokens = sorted(set(comma_list(ap, "--tokens", args.tokens, int, minimum=1)))
    batches = comma_list(ap, "--batches", args.batches, int, minimum=1)
    repeats = comma_list(ap, "--repeats", args.repeats, int, minimum=1)
    if len(repeats) == 1:
        repeats *= len(batches)
    if tokens[0] != 1:
        ap.error(f"--tokens must start at 1 (got {args.tokens!r})")
    if sorted(set(batches)) != batches or batches[0] != 1:
        ap.error(f"--batches={args.batches!r} must rise from 1 without repeats")
    if len(repeats) != len(batches) or min(repeats) < 1:
        ap.error(f"--repeats={args.repeats!r} must be one count >= 1, or one per batch in "
                 f"--batches={args.batches!r}")
    if args.context < 0 or (args.far is not None and args.far <= args.context):
        ap.error(f"--context={args.context} must be >= 0 and --far={args.far} above it")
    config = target_config(args.target)
    results = {}
    for b, r in zip(batches, repeats):
        result = measure_verify_cost(tokens, b, r, args.context, config=config, far=args.far)
        results[b] = dict(result, context=args.context, far_context=args.far)
        print(f"batch {b}:")
        for t in tokens:
            print(f"  T={t:3d}: {result['seconds'][t] * 1e3:7.2f} ms  "
                  f"({result['ratio'][t]:.2f}x T=1)   no YNNPACK "
                  f"{result['seconds_no_ynn'][t] * 1e3:7.2f} ms  "
                  f"({result['ratio_no_ynn'][t]:.2f}x)")
        print(f"  fit: jump {result['jump']:.3f}, slope {result['slope']:.3f}, "
              f"per_token {result['per_token']:.4f}")
    print(f"table: {from_table_call(results)}")
    print(f"decode matmuls: {decode_matmul(config)}")  # which kernel's table this is
    command = " ".join(["python -m specjax.bench.verify_cost",
                        *(argv if argv is not None else sys.argv[1:])])
    if args.out:
        from specjax.bench.decode import write_section

        write_section(Path(args.out), markdown(results, dict(zip(batches, repeats)), command),
                      START, END)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
