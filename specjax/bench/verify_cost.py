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

  python -m specjax.bench.verify_cost [--target CKPT|bench] [--tokens 1,2,3,5,9,17,33,65,129]
      [--batch 1] [--repeats 30] [--context 128] [--far N]
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

from specjax.calibrate import LINEAR_FROM, measure_verify_cost

START, END = "<!-- bench:verify_cost:start -->", "<!-- bench:verify_cost:end -->"


def markdown(result: dict, batch: int, repeats: int, command: str) -> str:
    from specjax.bench.decode import _machine, _versions

    lines = [START, "## Verify cost: T tokens vs one (the adaptive rule's cost model)", "",
             f"- date: {datetime.date.today().isoformat()}", f"- machine: {_machine()}",
             f"- versions: {_versions()}", f"- command: `{command}`",
             f"- model: {result['name']}, random weights, {result['params']:,} params, float32, "
             f"batch {batch}, "
             f"{result.get('context', 128)}-token context; median of {repeats} interleaved "
             "rounds, every program timed once a round in a seeded order, right after an "
             "untimed run of itself",
             "- generate's options: `specjax.xla_options.DECODE_OPTIONS`; the other columns: "
             "without YNNPACK fusions (`xla_cpu_experimental_ynn_fusion_type=''`), the "
             "option generate used before", "",
             "| T (verified tokens) | ms, generate's options | cost / cost(T=1) "
             "| ms, no YNNPACK | cost / cost(T=1), no YNNPACK |",
             "|---:|---:|---:|---:|---:|"]
    far = "far" in result
    if far:
        lines[-2] = lines[-2][:-1] + (f"| ms after {result['far_context']} tokens | cost / "
                                      f"cost(T=1) after {result.get('context', 128)} |")
        lines[-1] += "---:|---:|"
    for t, sec in result["seconds"].items():
        lines.append(f"| {t} | {sec * 1e3:.2f} | {result['ratio'][t]:.2f} | "
                     f"{result['seconds_no_ynn'][t] * 1e3:.2f} | "
                     f"{result['ratio_no_ynn'][t]:.2f} |"
                     + (f" {result['far_seconds'][t] * 1e3:.2f} | {result['far'][t]:.2f} |"
                        if far else ""))
    lines += ["", "Least-squares fit of cost(T)/cost(1) = 1 + jump·[T > 1] + slope·log2(T) "
              f"over T < {LINEAR_FROM} and of per_token·T over T >= {LINEAR_FROM} (compute-"
              "bound; a batch verifies rows × T tokens in one forward), generate's options: "
              f"**jump {result['jump']:.3f}, slope {result['slope']:.3f}, per_token "
              f"{result['per_token']:.4f}**. `specjax.decoding.cost.VERIFY_COST` holds the ratios "
              "themselves (`VerifyCost.from_table`, linear between them): the fit misses the "
              "compute-bound knee around T = 33 by up to a third.", END]
    return "\n".join(lines) + "\n"


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
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--context", type=int, default=128,
                    help="cached tokens before the verified ones")
    ap.add_argument("--far", type=int, default=None,
                    help="also time every T after this many cached tokens, for "
                    "VerifyCost.from_table(contexts=(context, far), far=...)")
    ap.add_argument("--out", default="docs/benchmarks.md",
                    help="markdown file to write the table into ('' = don't write)")
    args = ap.parse_args(argv)
    try:
        tokens = sorted({int(x) for x in args.tokens.split(",")})
    except ValueError:
        ap.error(f"--tokens={args.tokens!r} must be comma-separated integers")
    if tokens[0] != 1 or args.batch < 1 or args.repeats < 1:
        ap.error(f"--tokens must start at 1 (got {args.tokens!r}); --batch={args.batch} and "
                 f"--repeats={args.repeats} must be >= 1")
    if args.context < 0 or (args.far is not None and args.far <= args.context):
        ap.error(f"--context={args.context} must be >= 0 and --far={args.far} above it")
    result = measure_verify_cost(tokens, args.batch, args.repeats, args.context,
                                 config=target_config(args.target), far=args.far)
    result.update(context=args.context, far_context=args.far)
    for t in tokens:
        print(f"T={t:3d}: {result['seconds'][t] * 1e3:7.2f} ms  ({result['ratio'][t]:.2f}x T=1)"
              f"   no YNNPACK {result['seconds_no_ynn'][t] * 1e3:7.2f} ms  "
              f"({result['ratio_no_ynn'][t]:.2f}x)")
    print(f"fit: jump {result['jump']:.3f}, slope {result['slope']:.3f}, "
          f"per_token {result['per_token']:.4f}")
    table = ", ".join(f"{t}: {r:.2f}" for t, r in result["ratio"].items())
    print(f"table: VerifyCost.from_table({{{table}}})")
    if args.far is not None:
        points = ", ".join(f"{t}: {r:.2f}" for t, r in result["far"].items())
        near, far = result["capacity"]  # what the reference backend's attention reads
        print(f"after {args.far} tokens: contexts=({near}, {far}), "
              f"far={{{args.batch}: {{{points}}}}}")
    command = " ".join(["python -m specjax.bench.verify_cost",
                        *(argv if argv is not None else sys.argv[1:])])
    if args.out:
        from specjax.bench.decode import write_section

        write_section(Path(args.out), markdown(result, args.batch, args.repeats, command),
                      START, END)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
