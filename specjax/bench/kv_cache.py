"""What the KV cache's dtype costs: greedy decode time, bytes per token and drift, float32
vs bfloat16 vs int8 caches, same model and prompts, one run.

The model is `--target` (default: the packaged SmolLM2-135M-Instruct, float32 compute).
For each context length, `--batch` rows of held-out standard-library code fill all but
`--new-tokens` of it, and `generate` decodes those tokens greedily with each
`kv_cache_dtype`, in interleaved rounds after a warm-up (the median per dtype). Reported
per dtype: ms/token (prefill included) and its ratio to the float32 cache, the decode step
alone (TPOT) and its ratio, KV bytes per token (`plan_memory`'s arithmetic), and the drift
from the float32 cache's greedy output over `--drift-prompts` other prompts of the same
length (one untimed call each): the new tokens equal to float32's, the rows equal
throughout, and the earliest new token that differs (greedy output parts at its first flip
and differs after it); and, over the same cache, n-gram speculation's (`NGram(k=4)`,
drafting wherever it finds a match) against plain decoding's: its verify computes a step's
new keys at a wider matmul than a plain step, and a rounding difference can move an int8
code.

  python -m specjax.bench.kv_cache [--target CKPT] [--contexts 256,2048] [--batch 1]
      [--new-tokens 64] [--repeats 3] [--drift-prompts 8]
      [--kv-cache-dtypes float32,bfloat16,int8]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

from specjax.bench.decode import _machine, _versions
from specjax.cli_args import comma_list

DTYPES = ("float32", "bfloat16", "int8")


def _agreement(rows: list[list[int]], want: list[list[int]]) -> dict:
    """How far `rows` follow `want`: new tokens equal at the same position, rows equal
    throughout, and the earliest index where a row differs (None: none does)."""
    same = sum(a == b for r, w in zip(rows, want) for a, b in zip(r, w))
    firsts = [next((i for i, (a, b) in enumerate(zip(r, w)) if a != b), None)
              for r, w in zip(rows, want)]
    differ = [i for i in firsts if i is not None]
    return dict(same_tokens=same, same_rows=len(firsts) - len(differ),
                first_difference=min(differ) if differ else None)


def run(model, prompts: dict[int, tuple[list[list[int]], list[list[int]]]], new_tokens: int,
        repeats: int, dtypes=DTYPES) -> list[dict]:
    """One row per (context, dtype) of `dtypes` (float32, the yardstick, among them).
    prompts: context -> (the timed call's rows, the drift prompts), each prompt
    context - new_tokens ids long."""
    if "float32" not in dtypes:
        raise ValueError(f"dtypes={dtypes!r} must include float32, the yardstick")
    import specjax
    from specjax.speculators.ngram import NGram

    rows = []
    for ctx, (timed, drift) in prompts.items():

        def gen(dtype, ids=timed):
            return specjax.generate(model, ids, max_new_tokens=new_tokens, ignore_eos=True,
                                    kv_cache_dtype=dtype)

        for d in dtypes:  # warm-up: each dtype compiles its own program
            gen(d)
        times = {d: [] for d in dtypes}
        tpot = {d: [] for d in dtypes}
        for _ in range(repeats):
            for d in dtypes:
                t0 = time.perf_counter()
                out = gen(d)
                times[d].append(time.perf_counter() - t0)
                tpot[d].append(out.stats.tpot_s)
        outs = {d: [t for p in drift for t in gen(d, [p]).tokens] for d in dtypes}
        spec = {d: [t for p in drift for t in specjax.generate(
            model, [p], max_new_tokens=new_tokens, ignore_eos=True, kv_cache_dtype=d,
            speculator=NGram(k=4), adaptive=False).tokens] for d in dtypes}
        base = statistics.median(times["float32"])
        base_tpot = statistics.median(tpot["float32"])
        for d in dtypes:
            plan = specjax.plan_memory(model.config, {"data": 1, "model": 1}, batch=1,
                                       max_len=ctx, page_size=16, kv_cache_dtype=d)
            t, step = statistics.median(times[d]), statistics.median(tpot[d])
            rows.append(dict(context=ctx, dtype=d, batch=len(timed),
                             ms_per_token=1e3 * t / new_tokens, vs_float32=t / base,
                             tpot_ms=1e3 * step, tpot_vs_float32=step / base_tpot,
                             kv_bytes_per_token=plan.kv_cache / ctx, rows=len(drift),
                             new_tokens=len(drift) * new_tokens,
                             **_agreement(outs[d], outs["float32"]),
                             ngram=_agreement(spec[d], outs[d])))
            r = rows[-1]
            print(f"context {ctx}, {d:>8}: {r['ms_per_token']:.2f} ms/token "
                  f"({r['vs_float32']:.2f}x float32), TPOT {r['tpot_ms']:.2f} ms "
                  f"({r['tpot_vs_float32']:.2f}x), {r['kv_bytes_per_token']:,.0f} KV "
                  f"bytes/token, {r['same_tokens']}/{r['new_tokens']} tokens and "
                  f"{r['same_rows']}/{r['rows']} rows as float32's; n-gram: "
                  f"{r['ngram']['same_rows']}/{r['rows']} rows as plain decoding's",
                  flush=True)
    return rows


def markdown(rows: list[dict], args, command: str, model_line: str) -> str:
    lines = [f"- date: {datetime.date.today().isoformat()}; machine: {_machine()}",
             f"- versions: {_versions()}",
             f"- command: `{command}`",
             f"- model: {model_line}",
             f"- timed: batch {args.batch}, {args.new_tokens} new tokens after a prompt "
             f"filling the rest of the context; median of {args.repeats} interleaved rounds; "
             f"drift: {args.drift_prompts} other prompts, one row each",
             "",
             "| context | KV cache | ms/token | vs float32 cache | TPOT ms | vs float32 "
             "| KV bytes/token | new tokens as float32's | rows as float32's "
             "| earliest difference | n-gram rows as plain's, same cache "
             "| earliest difference |",
             "|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def first(i):
        return "–" if i is None else f"token {i}"

    for r in rows:
        lines.append(f"| {r['context']} | {r['dtype']} | {r['ms_per_token']:.2f} | "
                     f"{r['vs_float32']:.2f}x | {r['tpot_ms']:.2f} | "
                     f"{r['tpot_vs_float32']:.2f}x | {r['kv_bytes_per_token']:,.0f} | "
                     f"{r['same_tokens']}/{r['new_tokens']} | {r['same_rows']}/{r['rows']} | "
                     f"{first(r['first_difference'])} | {r['ngram']['same_rows']}/{r['rows']} "
                     f"| {first(r['ngram']['first_difference'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specjax.bench.kv_cache",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="anything specjax.load reads "
                        "(default: the packaged SmolLM2-135M-Instruct)")
    parser.add_argument("--contexts", default="256,2048")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--drift-prompts", type=int, default=8)
    parser.add_argument("--kv-cache-dtypes", default=",".join(DTYPES),
                        help="the caches compared, float32 (the yardstick) among them")
    args = parser.parse_args(argv)
    contexts = comma_list(parser, "--contexts", args.contexts, int, minimum=1)
    dtypes = tuple(comma_list(parser, "--kv-cache-dtypes", args.kv_cache_dtypes,
                              choices=DTYPES))
    if "float32" not in dtypes:
        parser.error(f"--kv-cache-dtypes={args.kv_cache_dtypes!r} must include float32 "
                     "(the yardstick)")
    if min(args.batch, args.new_tokens, args.repeats, args.drift_prompts) < 1:
        parser.error(f"--batch={args.batch}, --new-tokens={args.new_tokens}, "
                     f"--repeats={args.repeats} and --drift-prompts={args.drift_prompts} "
                     "must be >= 1")
    if min(contexts) <= args.new_tokens:
        parser.error(f"--contexts={args.contexts!r}: each must exceed "
                     f"--new-tokens={args.new_tokens}")
    from specjax.bench.prompts import heldout_windows
    from specjax.bench.target import load_target

    model = load_target(args.target)
    limit = model.config.max_position_embeddings
    if max(contexts) > limit:
        parser.error(f"--contexts={args.contexts!r}: {max(contexts)} exceeds the model's "
                     f"{limit} positions")
    n = args.batch + args.drift_prompts
    prompts = {}
    for ctx in contexts:
        ids = heldout_windows(model.tokenizer, model.config.vocab_size, n,
                              ctx - args.new_tokens, seed=0)
        prompts[ctx] = (ids[:args.batch], ids[args.batch:])
    rows = run(model, prompts, args.new_tokens, args.repeats, dtypes)
    c = model.config
    model_line = (f"{args.target or 'the packaged SmolLM2-135M-Instruct'}: {c.num_layers} "
                  f"layers, {c.num_kv_heads} KV heads of {c.head_dim} dims, float32 compute")
    print(markdown(rows, args, "python -m specjax.bench.kv_cache " + " ".join(
        sys.argv[1:] if argv is None else argv), model_line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
