"""What a verify forward of T tokens costs, relative to a one-token decode step.

Leviathan et al.'s expected speedup assumes verifying k+1 tokens costs one target step.
That holds while the forward is memory-bound (GPU/TPU decode at small T); XLA:CPU's
small-M matmuls are compute-bound, so on CPU each verified token adds a measurable
share. This script times the jitted cached target step (`specjax.step`, the same call
the decode loop makes, tree mask included) at T = 1 and larger T, interleaved, on the
~25M-param benchmark Llama at a 128-token context, and fits
cost(T) / cost(1) = 1 + slope · log2(T) by least squares. The slope is what
`specjax.stats.VERIFY_COST_SLOPE` holds per backend (the adaptive draft length and the
analytical speedup use it).

  python -m specjax.bench.verify_cost [--tokens 1,2,3,5,9,17] [--batch 1] [--repeats 30]
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


def measure(tokens: list[int], batch: int, repeats: int, context: int = 128,
            config=None) -> dict:
    """Median seconds per step at each T, and the fitted slope (`config`: the model to
    time; default the ~25M benchmark Llama)."""
    import specjax
    from specjax.bench.decode import BENCH_CONFIG
    from specjax.cache import PagedKVCache
    from specjax.config import ModelConfig
    from specjax.model import decode_params
    from specjax.tree import ancestor_mask, chain

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
        fn = jax.jit(lambda p, c, i, q, m: specjax.step(config, p, c, i, q, mask=m)[0])
        fns[t] = (fn, (params, cache, ids, pos, mask))
        fn(*fns[t][1]).block_until_ready()  # compile
    times = {t: [] for t in tokens}
    for _ in range(repeats):  # interleaved: every T sees the same machine load
        for t, (fn, args) in fns.items():
            t0 = time.perf_counter()
            fn(*args).block_until_ready()
            times[t].append(time.perf_counter() - t0)
    med = {t: statistics.median(v) for t, v in times.items()}
    base = med[tokens[0]]
    x = np.log2(np.asarray(tokens, np.float64))
    y = np.asarray([med[t] / base - 1 for t in tokens], np.float64)
    slope = float(x @ y / (x @ x)) if x @ x > 0 else 0.0
    return dict(params=model.num_params(), seconds=med, ratio={t: med[t] / base for t in tokens},
                slope=slope)


def markdown(result: dict, batch: int, repeats: int, command: str) -> str:
    from specjax.bench.decode import _machine, _versions

    lines = [START, "## Verify cost: T tokens vs one (the adaptive rule's cost model)", "",
             f"- date: {datetime.date.today().isoformat()}", f"- machine: {_machine()}",
             f"- versions: {_versions()}", f"- command: `{command}`",
             f"- model: random Llama, {result['params']:,} params, float32, batch {batch}, "
             f"128-token context; median of {repeats} interleaved rounds", "",
             "| T (verified tokens) | ms per forward | cost / cost(T=1) |", "|---:|---:|---:|"]
    for t, s in result["seconds"].items():
        lines.append(f"| {t} | {s * 1e3:.2f} | {result['ratio'][t]:.2f} |")
    lines += ["", f"Least-squares slope of cost(T)/cost(1) = 1 + slope·log2(T): "
              f"**{result['slope']:.3f}**.", END]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specjax.bench.verify_cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,2,3,5,9,17")
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
    result = measure(tokens, args.batch, args.repeats)
    for t in tokens:
        print(f"T={t:3d}: {result['seconds'][t] * 1e3:7.2f} ms  ({result['ratio'][t]:.2f}x T=1)")
    print(f"slope {result['slope']:.3f}")
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
