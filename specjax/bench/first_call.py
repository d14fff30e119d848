"""The first `generate` call's wait, in fresh processes: with an empty compilation cache,
with the cache an earlier process filled, and with the cache off.

A process's first call builds the CPU kernels (g++), races them against XLA's matmuls
per weight shape, and traces and compiles the prefill and decode programs. The
persistent compilation cache (`specjax.compile_cache`, on in the CLI) keeps the
compiled programs, the built kernels and the races' verdicts for the next process. Each
measurement runs in a process of its own (`--child`), so that no process finds another's
programs in memory; the settings alternate `--processes` times, each time with a new
empty cache directory.

  python -m specjax.bench.first_call [--target CKPT] [--speculators none,ngram]
      [--layouts auto] [--prompt-tokens 128] [--new 64] [--processes 2] [--json FILE]

Per speculator, layout and cache: seconds to import specjax, to load the target, the
first call's wait and its parts (the CPU kernels' builds, the decode layout with its
weight shapes' races, and `stats.compile_s`: tracing and compiling `generate`'s
programs or reading them from the cache), and the median of three later calls. The
prompt is the first `--prompt-tokens` tokens of the standard library's `argparse.py`
(`bench.prompts.source_ids`); every process's greedy tokens must be the same.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specjax.cli_args import at_least_one, comma_list

CACHES = ("empty", "filled", "off")
SPECULATORS = ("none", "ngram")


# A child process: its clock starts before specjax (and jax) are imported.
CHILD = ("import sys, time; t0 = time.perf_counter(); "
         "from specjax.bench.first_call import main; sys.exit(main(sys.argv[1:], t0))")


def child(args, t0: float) -> dict:
    """One process's measurement, `t0` its clock before specjax was imported (the caller
    runs it in a fresh interpreter)."""
    import specjax
    from specjax import compile_cache, cpu_attention, rows_matmul
    from specjax.bench.prompts import source_ids
    from specjax.speculators import NGram

    imported = time.perf_counter()
    compile_cache.enable(args.cache)
    model = specjax.load(args.target, dtype="float32")
    loaded = time.perf_counter()
    # what the first call does before it compiles, timed apart in the order it runs
    # them: the CPU kernels built (or found in the cache), then the decode layout,
    # whose weight shapes race the kernels (or read the cached verdicts); `generate`
    # reuses both
    rows_matmul.available(), rows_matmul.available_t(), cpu_attention.available()
    built = time.perf_counter()
    model.decode_params(args.layout)
    laid_out = time.perf_counter()
    ids = source_ids(model.tokenizer, model.config.vocab_size, args.prompt_tokens)
    spec = NGram(k=4) if args.speculator == "ngram" else None

    def call():
        t = time.perf_counter()
        out = specjax.generate(model, [ids], max_new_tokens=args.new, ignore_eos=True,
                               speculator=spec, layer_layout=args.layout)
        return out, time.perf_counter() - t

    first, call_s = call()
    later = [call()[1] for _ in range(3)]
    return dict(import_s=imported - t0, load_s=loaded - imported,
                kernels_s=built - loaded, layout_s=laid_out - built,
                first_s=laid_out - loaded + call_s, compile_s=first.stats.compile_s,
                later_s=statistics.median(later),
                tokens=[list(map(int, t)) for t in first.tokens])


def _run_child(args, speculator: str, layout: str, cache: str) -> dict:
    cmd = [sys.executable, "-c", CHILD, "--child", "--target",
           str(args.target), "--speculators", speculator, "--layouts", layout,
           "--prompt-tokens", str(args.prompt_tokens), "--new", str(args.new),
           "--cache", cache]
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if done.returncode != 0:
        raise SystemExit(f"first_call child ({speculator}, {layout}, cache {cache}) failed:\n"
                         + done.stderr[-4000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(args) -> list[dict]:
    """Every (speculator, layout) with an empty cache, then the same cache filled, then
    the cache off, `args.processes` times, alternating: one row per setting, medians."""
    settings = [(s, lay) for s in args.speculators for lay in args.layouts]
    runs = {(s, lay, c): [] for s, lay in settings for c in CACHES}
    for _ in range(args.processes):
        for s, lay in settings:
            directory = tempfile.mkdtemp(prefix="specjax-first-call-")
            try:
                for cache in CACHES:
                    where = "off" if cache == "off" else directory
                    runs[s, lay, cache].append(_run_child(args, s, lay, where))
            finally:
                shutil.rmtree(directory, ignore_errors=True)
    reference = next(iter(runs.values()))[0]["tokens"]
    rows = []
    for (s, lay, cache), got in runs.items():
        same = all(r["tokens"] == reference for r in got)  # greedy: lossless everywhere
        row = dict(speculator=s, layout=lay, cache=cache, processes=len(got), same_tokens=same)
        for key in ("import_s", "load_s", "first_s", "kernels_s", "layout_s", "compile_s",
                    "later_s"):
            row[key] = statistics.median(r[key] for r in got)
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| speculator | layout | compilation cache | import s | load s | first call s "
             "| of which: kernel builds s | layout and races s | compile_s | later call s "
             "| same tokens |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in rows:
        lines.append(f"| {r['speculator']} | {r['layout']} | {r['cache']} | {r['import_s']:.1f} "
                     f"| {r['load_s']:.1f} | {r['first_s']:.1f} | {r['kernels_s']:.1f} "
                     f"| {r['layout_s']:.1f} | {r['compile_s']:.1f} | {r['later_s']:.2f} "
                     f"| {'yes' if r['same_tokens'] else 'NO'} |")
    return "\n".join(lines)


def _parse(argv) -> argparse.Namespace:
    from specjax.model import LAYER_LAYOUTS

    ap = argparse.ArgumentParser(prog="python -m specjax.bench.first_call", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="anything specjax.load reads (default: "
                    "the packaged SmolLM2-135M-Instruct)")
    ap.add_argument("--speculators", default="none,ngram")
    ap.add_argument("--layouts", default="auto", help="generate's layer_layout values")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--processes", type=int, default=2,
                    help="times each setting runs (the median counts)")
    ap.add_argument("--json", default="", help="write the rows here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cache", default="off", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    at_least_one(ap, args, ("prompt_tokens", "new", "processes"))
    args.speculators = comma_list(ap, "--speculators", args.speculators, choices=SPECULATORS)
    args.layouts = comma_list(ap, "--layouts", args.layouts, choices=LAYER_LAYOUTS)
    return args


def main(argv=None, started: float | None = None) -> int:
    started = time.perf_counter() if started is None else started
    args = _parse(argv)
    if args.target is None:
        from specjax.checkpoint.packaged import smollm2
        args.target = str(smollm2())
    if args.child:
        args.speculator, args.layout = args.speculators[0], args.layouts[0]
        print(json.dumps(child(args, started)))
        return 0
    rows = measure(args)
    print(f"first generate call, {args.prompt_tokens}-token prompt, {args.new} new tokens, "
          f"batch 1, greedy; medians of {args.processes} processes per setting")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
