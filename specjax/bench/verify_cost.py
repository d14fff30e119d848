"""What a verify forward of T tokens costs, relative to a one-token decode step.

Leviathan et al.'s expected speedup assumes verifying k+1 tokens costs one target step.
That holds while the forward is memory-bound (GPU/TPU decode at small T). On XLA:CPU one
token runs a memory-bound GEMV and two or more a GEMM that repacks the weights per call,
so the cost jumps at T = 2 and then grows slowly. This script times the jitted cached
target step (`specjax.step`, the same call the decode loop makes, tree mask included)
at T = 1 and larger T, interleaved, at a 128-token context, on the target's shapes
(default: the packaged SmolLM2-135M-Instruct, random weights of its config; `--target
bench`: the ~25M-param benchmark Llama), compiled as `generate` compiles
(`specjax.xla_options`) and without XLA:CPU's YNNPACK fusions side by side, and fits cost(T) / cost(1) = 1 + jump·[T > 1] + slope·log2(T)
by least squares over T < 33, and per_token·T over T >= 33 where the forward turns
compute-bound (a batch verifies rows × T tokens at once, so wide trees at batch > 1 land
there). `specjax.decoding.cost.VERIFY_COST` holds the measured ratios themselves
(`VerifyCost.from_table`; the adaptive draft length and the analytical speedup use it).

  python -m specjax.bench.verify_cost [--target CKPT|bench] [--tokens 1,2,3,5,9,17,33,65,129]
      [--batch 1] [--repeats 30]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

START, END = "<!-- bench:verify_cost:start -->", "<!-- bench:verify_cost:end -->"
# XLA:CPU without its YNNPACK fusions: timed beside generate's options (the option
# generate compiled with until measured on a real checkpoint; `specjax.xla_options`)
NO_YNN = {"xla_cpu_experimental_ynn_fusion_type": ""}


def measure(tokens: list[int], batch: int, repeats: int, context: int = 128,
            config=None) -> dict:
    """Median seconds per step at each T, and the fitted jump and slope (`config`: the model to
    time; default the ~25M benchmark Llama).

    Each T is compiled twice: with the options `generate` compiles with
    (`specjax.xla_options`, the figures the fit uses) and without YNNPACK fusions
    (`NO_YNN`), so one run shows what that option would change."""
    import specjax
    from specjax.bench.decode import BENCH_CONFIG
    from specjax.cache import PagedKVCache
    from specjax.config import ModelConfig
    from specjax.model import decode_params
    from specjax.tree import ancestor_mask, chain
    from specjax.xla_options import compile_decode

    config = config or ModelConfig(**BENCH_CONFIG)
    model = specjax.init_model(config, seed=0)
    params = decode_params(config, model.params)  # the layout `generate` decodes with
    page = 16
    pages = -(-(context + max(tokens)) // page)
    table = jnp.arange(batch * pages, dtype=jnp.int32).reshape(batch, pages)
    cache = PagedKVCache.create(config, table, num_pages=batch * pages, page_size=page,
                                lengths=jnp.full((batch,), context, jnp.int32))
    fns = {}
    for t in tokens:
        ids = jnp.asarray(np.random.default_rng(t).integers(0, config.vocab_size, (batch, t)))
        pos = context + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (batch, t))
        mask = None if t == 1 else ancestor_mask(chain(ids[:, 1:]).parents, t - 1)
        args = (params, cache, ids, pos, mask)
        lowered = jax.jit(lambda p, c, i, q, m: specjax.step(config, p, c, i, q, mask=m)[0]
                          ).lower(*args)
        for variant, fn in (("generate", compile_decode(lowered)),
                            ("no_ynn", lowered.compile(compiler_options=NO_YNN))):
            fn(*args).block_until_ready()  # first run
            fns[variant, t] = (fn, args)
    times = {key: [] for key in fns}
    for _ in range(repeats):  # interleaved: every T sees the same machine load
        for key, (fn, args) in fns.items():
            t0 = time.perf_counter()
            fn(*args).block_until_ready()
            times[key].append(time.perf_counter() - t0)
    med = {key: statistics.median(v) for key, v in times.items()}
    out = dict(params=model.num_params(),
               name=f"{config.model_type}, {config.num_layers} layers x {config.hidden_size}")
    for variant, suffix in (("generate", ""), ("no_ynn", "_no_ynn")):
        sec = {t: med[variant, t] for t in tokens}
        out["seconds" + suffix] = sec
        out["ratio" + suffix] = {t: sec[t] / sec[tokens[0]] for t in tokens}
    small = {t: r for t, r in out["ratio"].items() if t < LINEAR_FROM}
    out["jump"], out["slope"] = fit(small)
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


def fit(ratio: dict[int, float]) -> tuple[float, float]:
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


def markdown(result: dict, batch: int, repeats: int, command: str) -> str:
    from specjax.bench.decode import _machine, _versions

    lines = [START, "## Verify cost: T tokens vs one (the adaptive rule's cost model)", "",
             f"- date: {datetime.date.today().isoformat()}", f"- machine: {_machine()}",
             f"- versions: {_versions()}", f"- command: `{command}`",
             f"- model: {result['name']}, random weights, {result['params']:,} params, float32, "
             f"batch {batch}, "
             f"128-token context; median of {repeats} interleaved rounds",
             "- generate's options: `specjax.xla_options.DECODE_OPTIONS`; the other columns: "
             "without YNNPACK fusions (`xla_cpu_experimental_ynn_fusion_type=''`), the "
             "option generate used before", "",
             "| T (verified tokens) | ms, generate's options | cost / cost(T=1) "
             "| ms, no YNNPACK | cost / cost(T=1), no YNNPACK |",
             "|---:|---:|---:|---:|---:|"]
    for t, sec in result["seconds"].items():
        lines.append(f"| {t} | {sec * 1e3:.2f} | {result['ratio'][t]:.2f} | "
                     f"{result['seconds_no_ynn'][t] * 1e3:.2f} | "
                     f"{result['ratio_no_ynn'][t]:.2f} |")
    lines += ["", "Least-squares fit of cost(T)/cost(1) = 1 + jump·[T > 1] + slope·log2(T) "
              f"over T < {LINEAR_FROM} and of per_token·T over T >= {LINEAR_FROM} (compute-"
              "bound; a batch verifies rows × T tokens in one forward), generate's options: "
              f"**jump {result['jump']:.3f}, slope {result['slope']:.3f}, per_token "
              f"{result['per_token']:.4f}**. `specjax.decoding.cost.VERIFY_COST` holds the ratios "
              "themselves (`VerifyCost.from_table`, linear between them): the fit misses the "
              "compute-bound knee around T = 33 by up to a third.", END]
    return "\n".join(lines) + "\n"


def target_config(target: str | None):
    """The config `--target` names: a checkpoint's (None: the packaged SmolLM2), or None
    for 'bench' (`measure`'s default, the benchmark Llama)."""
    if target == "bench":
        return None
    import specjax
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
    result = measure(tokens, args.batch, args.repeats, config=target_config(args.target))
    for t in tokens:
        print(f"T={t:3d}: {result['seconds'][t] * 1e3:7.2f} ms  ({result['ratio'][t]:.2f}x T=1)"
              f"   no YNNPACK {result['seconds_no_ynn'][t] * 1e3:7.2f} ms  "
              f"({result['ratio_no_ynn'][t]:.2f}x)")
    print(f"fit: jump {result['jump']:.3f}, slope {result['slope']:.3f}, "
          f"per_token {result['per_token']:.4f}")
    table = ", ".join(f"{t}: {r:.2f}" for t, r in result["ratio"].items())
    print(f"table: VerifyCost.from_table({{{table}}})")
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
