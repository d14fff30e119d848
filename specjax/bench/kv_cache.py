"""What the KV cache's dtype costs: greedy decode time and bytes per token, float32 vs
bfloat16 vs int8 caches, same model and prompts, one run.

The model is `bench decode`'s ~25M random Llama (float32 compute). For each context
length, a batch of prompts fills all but `--new-tokens` of it, and `generate` decodes
those tokens greedily with each `kv_cache_dtype`, in interleaved rounds after a warm-up
(the median per dtype). Reported per dtype: ms/token (prefill included) and its ratio to
the float32 cache, KV bytes per token (`plan_memory`'s arithmetic), and how many new
tokens equal the float32 cache's (a random model: a measure of drift, not of quality).

  python -m specjax.bench.kv_cache [--contexts 256,1024] [--batch 1] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

from specjax.bench.decode import BENCH_CONFIG, _machine, _prompts, _versions
from specjax.cli_args import comma_list

DTYPES = ("float32", "bfloat16", "int8")


def run(contexts: list[int], batch: int, new_tokens: int, repeats: int) -> list[dict]:
    import specjax
    from specjax.config import ModelConfig

    config = ModelConfig(**BENCH_CONFIG)
    model = specjax.init_model(config, seed=0)
    rows = []
    for ctx in contexts:
        prompts = _prompts(batch, ctx - new_tokens, config.vocab_size)

        def gen(dtype):
            return specjax.generate(model, prompts, max_new_tokens=new_tokens, ignore_eos=True,
                                    kv_cache_dtype=dtype)

        outs = {d: gen(d) for d in DTYPES}  # warm-up: each dtype compiles its own program
        times = {d: [] for d in DTYPES}
        for _ in range(repeats):
            for d in DTYPES:
                t0 = time.perf_counter()
                gen(d)
                times[d].append(time.perf_counter() - t0)
        base = statistics.median(times["float32"])
        for d in DTYPES:
            plan = specjax.plan_memory(config, {"data": 1, "model": 1}, batch=1, max_len=ctx,
                                       page_size=16, kv_cache_dtype=d)
            same = sum(a == b for r, f in zip(outs[d].tokens, outs["float32"].tokens)
                       for a, b in zip(r, f))
            t = statistics.median(times[d])
            rows.append(dict(context=ctx, dtype=d, ms_per_token=1e3 * t / new_tokens,
                             vs_float32=t / base, kv_bytes_per_token=plan.kv_cache / ctx,
                             same_tokens=same, new_tokens=batch * new_tokens))
            print(f"context {ctx}, {d:>8}: {rows[-1]['ms_per_token']:.2f} ms/token "
                  f"({rows[-1]['vs_float32']:.2f}x float32), "
                  f"{rows[-1]['kv_bytes_per_token']:,.0f} KV bytes/token, "
                  f"{same}/{batch * new_tokens} tokens as float32's", flush=True)
    return rows


def markdown(rows: list[dict], args, command: str) -> str:
    lines = [f"- date: {datetime.date.today().isoformat()}; machine: {_machine()}",
             f"- versions: {_versions()}",
             f"- command: `{command}`",
             f"- batch {args.batch}, {args.new_tokens} new tokens after a prompt filling the "
             f"rest of the context; median of {args.repeats} interleaved rounds",
             "",
             "| context | KV cache | ms/token | vs float32 cache | KV bytes/token "
             "| tokens as float32's |",
             "|---:|:---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['context']} | {r['dtype']} | {r['ms_per_token']:.2f} | "
                     f"{r['vs_float32']:.2f}x | {r['kv_bytes_per_token']:,.0f} | "
                     f"{r['same_tokens']}/{r['new_tokens']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specjax.bench.kv_cache",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="256,1024")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    contexts = comma_list(parser, "--contexts", args.contexts, int, minimum=1)
    if min(args.batch, args.new_tokens, args.repeats) < 1:
        parser.error(f"--batch={args.batch}, --new-tokens={args.new_tokens} and "
                     f"--repeats={args.repeats} must be >= 1")
    if min(contexts) <= args.new_tokens:
        parser.error(f"--contexts={args.contexts!r}: each must exceed "
                     f"--new-tokens={args.new_tokens}")
    rows = run(contexts, args.batch, args.new_tokens, args.repeats)
    print(markdown(rows, args, "python -m specjax.bench.kv_cache " + " ".join(
        sys.argv[1:] if argv is None else argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
