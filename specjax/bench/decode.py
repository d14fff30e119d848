"""Greedy decode speed: specjax `generate` vs transformers `generate`, same weights, same run.

The model is `--target` (default: the packaged SmolLM2-135M-Instruct) in float32, exported
with `specjax.save_hf` and loaded into transformers' class for its architecture (PyTorch). Both
generate exactly N new tokens greedily from the same prompts, windows of held-out
standard-library code of `--prompt-len` tokens (specjax: `ignore_eos=True`; transformers:
`min_new_tokens = max_new_tokens = N`), each after a warm-up call (specjax compiles there).
ms/token = wall time of one `generate` call / N, prefill included for both; the median of
`--repeats` interleaved rounds. transformers runs twice, with torch's default thread count
and with one thread (on a shared, oversubscribed CPU its spinning OpenMP threads can be
several times slower), and the ratio is taken against the faster of the two. The table
goes into docs/benchmarks.md between markers.

  python -m specjax.bench.decode [--target CKPT] [--new-tokens 64] [--batch-sizes 1,8]
      [--prompt-len 128]
  specjax bench decode [same flags]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import re
import statistics
import sys
import time
from pathlib import Path

from specjax.cli_args import at_least_one, comma_list

# The ~25M random Llama the benchmarks ran on before a real checkpoint: kept here, where
# `bench.ab`'s toy workload imports it on both checkouts it compares, and for `verify_cost
# --target bench`
BENCH_CONFIG = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_layers=8,
                    num_heads=8, num_kv_heads=4, max_position_embeddings=2048,
                    rms_norm_eps=1e-5)
START, END = "<!-- bench:decode:start -->", "<!-- bench:decode:end -->"


def _timed_rounds(ours, theirs, default_threads: int, repeats: int) -> tuple:
    """Interleaved rounds, so both libraries see the same load on a shared machine, each
    in its own order (`timing.balanced_order`: the one after torch's runs pays for its
    spinning threads): the wall times per variant, specjax's TTFT and TPOT, and each
    library's last output."""
    from specjax.timing import balanced_order

    times = {"specjax": [], "scan": [], "small_pages": [], default_threads: [], 1: []}
    names = list(times)
    ttft, tpot = [], []
    for r in range(repeats):
        for name in (names[i] for i in balanced_order(len(names), r)):
            t0 = time.perf_counter()
            if isinstance(name, str):
                got = ours(name)
            else:
                got = theirs(name)
            times[name].append(time.perf_counter() - t0)
            if name == "specjax":
                out = got
                ttft.append(got.stats.ttft_s)
                tpot.append(got.stats.tpot_s)
            elif not isinstance(name, str):  # transformers' (a thread count)
                hf_out = got
    return times, ttft, tpot, out, hf_out


def _batch_row(b: int, times: dict, ttft: list, tpot: list, same: bool, new_tokens: int,
               default_threads: int) -> dict:
    """One batch size's row (medians per token, the speedup over the better transformers
    setting), printed as it is made."""
    t_ours = statistics.median(times["specjax"])
    t_scan = statistics.median(times.pop("scan"))
    t_small = statistics.median(times.pop("small_pages"))
    t_hf = {k: statistics.median(v) for k, v in times.items() if k != "specjax"}
    row = dict(batch=b, specjax_ms=1e3 * t_ours / new_tokens,
               scan_ms=1e3 * t_scan / new_tokens, small_pages_ms=1e3 * t_small / new_tokens,
               hf_ms=1e3 * t_hf[default_threads] / new_tokens,
               hf1_ms=1e3 * t_hf[1] / new_tokens, ttft_ms=1e3 * statistics.median(ttft),
               tpot_ms=1e3 * statistics.median(tpot), same=same)
    row["speedup"] = min(row["hf_ms"], row["hf1_ms"]) / row["specjax_ms"]
    print(f"batch {b}: specjax {row['specjax_ms']:.2f} ms/token ({row['scan_ms']:.2f} with "
          f"the scanned layer layout, {row['small_pages_ms']:.2f} on 4 KB pages; TTFT "
          f"{row['ttft_ms']:.1f} ms, TPOT {row['tpot_ms']:.2f} ms) | transformers "
          f"{row['hf_ms']:.2f} ms/token ({default_threads} threads), {row['hf1_ms']:.2f} "
          f"(1 thread) | best transformers / specjax = {row['speedup']:.2f}x | "
          f"same tokens: {same}")
    return row


def run(model, new_tokens: int, batch_sizes: list[int], prompt_len: int,
        repeats: int) -> dict:
    import torch

    import specjax
    from specjax import huge_pages
    from specjax.bench.prompts import heldout_windows
    from specjax.bench.speculative import load_hf

    n_params = model.num_params()
    print(f"model: {n_params:,} params")
    hf = load_hf(model)
    default_threads = torch.get_num_threads()
    small = on_small_pages(model)
    rows = []
    for b in batch_sizes:
        prompts = heldout_windows(model.tokenizer, model.config.vocab_size, b, prompt_len)
        ids = torch.tensor(prompts)

        def ours(variant="specjax"):
            return specjax.generate(small if variant == "small_pages" else model, prompts,
                                    max_new_tokens=new_tokens, ignore_eos=True,
                                    layer_layout="scan" if variant == "scan" else "auto")

        def theirs(threads, n=new_tokens):
            torch.set_num_threads(threads)
            with torch.no_grad():
                return hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=n, min_new_tokens=n)

        ours()  # warm-up: specjax compiles here; torch warms its allocator and threads
        ours("scan")
        ours("small_pages")
        for threads in (default_threads, 1):
            theirs(threads, n=2)
        huge_pages.wait()  # the weights' pages settled before any round is timed
        times, ttft, tpot, out, hf_out = _timed_rounds(ours, theirs, default_threads, repeats)
        torch.set_num_threads(default_threads)
        same = out.tokens == hf_out[:, prompt_len:].tolist()
        rows.append(_batch_row(b, times, ttft, tpot, same, new_tokens, default_threads))
    return dict(params=n_params, rows=rows, threads=default_threads)


def on_small_pages(model):
    """A second `Model` on `model`'s params whose decode layout stays on the kernel's base
    pages (`specjax.huge_pages` off while it is made): the A/B of huge pages in one run."""
    from unittest import mock

    from specjax import huge_pages

    twin = dataclasses.replace(model)
    with mock.patch.dict(os.environ, {huge_pages.ENV: "off"}):
        twin.decode_params()
    return twin


def _versions() -> str:
    import flax
    import jax
    import torch
    import transformers
    return (f"jax {jax.__version__}, flax {flax.__version__}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}")


def _machine() -> str:
    import jax
    if jax.default_backend() == "cpu":
        return f"{os.cpu_count()}-core CPU, no accelerator"
    return f"{jax.devices()[0].device_kind} ({jax.default_backend()})"


def markdown(result: dict, args, command: str) -> str:
    lines = [
        START,
        "## Greedy decode: specjax vs transformers",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- machine: {_machine()}",
        f"- versions: {_versions()}",
        f"- command: `{command}`",
        f"- model: {result['model']}, {result['params']:,} params, float32; the same "
        "weights in both (`save_hf`)",
        f"- prompts: held-out standard-library code, {args.prompt_len} tokens a row; "
        f"{args.new_tokens} new tokens per row, greedy; median of {args.repeats} interleaved "
        "rounds after a warm-up",
        "- ms/token = wall time of one `generate` call / new tokens per row (prefill included)",
        "- specjax decodes with `layer_layout='auto'` (on CPU the layers scanned with each "
        "layer's weights read in place by its kernels); the scan column is the same run with "
        "`layer_layout='scan'`, the stored layout (XLA:CPU copies each layer's weights out of "
        "the stack every step, docs/design.md); the 4 KB column is the decode layout left "
        "on the kernel's base pages (`SPECJAX_HUGE_PAGES=off` while it is made, "
        "docs/design.md: \"Huge pages for the decode weights\")",
        f"- transformers timed with torch's default {result['threads']} thread(s) and with 1; "
        "the ratio uses the faster",
        "",
        "| batch | specjax ms/token | specjax, scan layout | specjax, 4 KB pages "
        f"| transformers ms/token ({result['threads']} thr) "
        "| transformers ms/token (1 thr) | best transformers / specjax "
        "| specjax TTFT ms | specjax TPOT ms | same tokens |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['batch']} | {r['specjax_ms']:.2f} | {r['scan_ms']:.2f} | "
                     f"{r['small_pages_ms']:.2f} | {r['hf_ms']:.2f} | "
                     f"{r['hf1_ms']:.2f} | {r['speedup']:.2f}x | {r['ttft_ms']:.1f} | "
                     f"{r['tpot_ms']:.2f} | {'yes' if r['same'] else 'no'} |")
    lines.append(END)
    return "\n".join(lines) + "\n"


def write_section(path: Path, section: str, start: str = START, end: str = END) -> None:
    """Replaces one benchmark's section of `path` (between its markers; others are kept)."""
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end) + "\n?", re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else (
        text.rstrip("\n") + "\n\n" + section)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="specjax bench decode", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="anything specjax.load reads "
                        "(default: the packaged SmolLM2-135M-Instruct)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="docs/benchmarks.md",
                        help="markdown file to write the table into ('' = don't write)")
    args = parser.parse_args(argv)
    batch_sizes = comma_list(parser, "--batch-sizes", args.batch_sizes, int, minimum=1)
    at_least_one(parser, args, ("new_tokens", "prompt_len", "repeats"))
    from specjax.bench.target import load_target

    model = load_target(args.target)
    result = run(model, args.new_tokens, batch_sizes, args.prompt_len, args.repeats)
    result["model"] = args.target or "SmolLM2-135M-Instruct (the packaged GGUF)"
    command = " ".join(["python -m specjax.bench.decode", *(argv if argv is not None
                                                              else sys.argv[1:])])
    if args.out:
        write_section(Path(args.out), markdown(result, args, command))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
