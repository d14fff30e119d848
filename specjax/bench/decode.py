"""Greedy decode speed: specjax `generate` vs transformers `generate`, same weights, same run.

A ~25M-param random Llama (vocab 8192, hidden 512, 8 layers, 8 heads / 4 KV heads,
mlp 1408) is built with specjax, exported with `specjax.save_hf` and loaded into
transformers' `LlamaForCausalLM` (float32, PyTorch). Both generate exactly N new tokens
greedily from the same fixed prompts (specjax: `ignore_eos=True`; transformers:
`min_new_tokens = max_new_tokens = N`), each after a warm-up call (specjax compiles
there). ms/token = wall time of one `generate` call / N, prefill included for both;
the median of `--repeats` interleaved rounds. transformers runs twice, with torch's default thread
count and with one thread (on a shared, oversubscribed CPU its spinning OpenMP threads
can be several times slower), and the ratio is taken against the faster of the two.
The table goes into docs/benchmarks.md between markers.

  python -m specjax.bench.decode [--new-tokens 64] [--batch-sizes 1,8] [--prompt-len 32]
  specjax bench decode [same flags]
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from specjax.cli_args import at_least_one, comma_list

BENCH_CONFIG = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_layers=8,
                    num_heads=8, num_kv_heads=4, max_position_embeddings=2048,
                    rms_norm_eps=1e-5)
START, END = "<!-- bench:decode:start -->", "<!-- bench:decode:end -->"


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(1234)  # fixed prompts, the same for both libraries
    return [[int(x) for x in rng.integers(1, vocab, length)] for _ in range(batch)]


def _timed_rounds(ours, theirs, default_threads: int, repeats: int) -> tuple:
    """Interleaved rounds, so both libraries see the same load on a shared machine: the wall
    times per variant, specjax's TTFT and TPOT, and each library's last output."""
    times = {"specjax": [], "scan": [], default_threads: [], 1: []}
    ttft, tpot = [], []
    for _ in range(repeats):
        for name in times:
            t0 = time.perf_counter()
            if name in ("specjax", "scan"):
                got = ours("auto" if name == "specjax" else "scan")
            else:
                got = theirs(name)
            times[name].append(time.perf_counter() - t0)
            if name == "specjax":
                out = got
                ttft.append(got.stats.ttft_s)
                tpot.append(got.stats.tpot_s)
            else:
                hf_out = got
    return times, ttft, tpot, out, hf_out


def _batch_row(b: int, times: dict, ttft: list, tpot: list, same: bool, new_tokens: int,
               default_threads: int) -> dict:
    """One batch size's row (medians per token, the speedup over the better transformers
    setting), printed as it is made."""
    t_ours = statistics.median(times["specjax"])
    t_scan = statistics.median(times.pop("scan"))
    t_hf = {k: statistics.median(v) for k, v in times.items() if k != "specjax"}
    row = dict(batch=b, specjax_ms=1e3 * t_ours / new_tokens,
               scan_ms=1e3 * t_scan / new_tokens,
               hf_ms=1e3 * t_hf[default_threads] / new_tokens,
               hf1_ms=1e3 * t_hf[1] / new_tokens, ttft_ms=1e3 * statistics.median(ttft),
               tpot_ms=1e3 * statistics.median(tpot), same=same)
    row["speedup"] = min(row["hf_ms"], row["hf1_ms"]) / row["specjax_ms"]
    print(f"batch {b}: specjax {row['specjax_ms']:.2f} ms/token ({row['scan_ms']:.2f} with "
          f"the scanned layer layout; TTFT "
          f"{row['ttft_ms']:.1f} ms, TPOT {row['tpot_ms']:.2f} ms) | transformers "
          f"{row['hf_ms']:.2f} ms/token ({default_threads} threads), {row['hf1_ms']:.2f} "
          f"(1 thread) | best transformers / specjax = {row['speedup']:.2f}x | "
          f"same tokens: {same}")
    return row


def run(new_tokens: int, batch_sizes: list[int], prompt_len: int, repeats: int) -> dict:
    import torch
    import transformers

    import specjax
    from specjax.config import ModelConfig

    config = ModelConfig(**BENCH_CONFIG)
    model = specjax.init_model(config, seed=0)
    n_params = model.num_params()
    print(f"model: random Llama, {n_params:,} params ({config.param_count():,} by arithmetic)")
    with tempfile.TemporaryDirectory() as tmp:
        specjax.save_hf(model, tmp)
        hf = transformers.LlamaForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    default_threads = torch.get_num_threads()
    rows = []
    for b in batch_sizes:
        prompts = _prompts(b, prompt_len, config.vocab_size)
        ids = torch.tensor(prompts)

        def ours(layout="auto"):
            return specjax.generate(model, prompts, max_new_tokens=new_tokens, ignore_eos=True,
                                    layer_layout=layout)

        def theirs(threads, n=new_tokens):
            torch.set_num_threads(threads)
            with torch.no_grad():
                return hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=n, min_new_tokens=n)

        ours()  # warm-up: specjax compiles here; torch warms its allocator and threads
        ours("scan")
        for threads in (default_threads, 1):
            theirs(threads, n=2)
        times, ttft, tpot, out, hf_out = _timed_rounds(ours, theirs, default_threads, repeats)
        torch.set_num_threads(default_threads)
        same = out.tokens == hf_out[:, prompt_len:].tolist()
        rows.append(_batch_row(b, times, ttft, tpot, same, new_tokens, default_threads))
    return dict(params=n_params, rows=rows, threads=default_threads)


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
        f"- model: random Llama, {result['params']:,} params (vocab 8192, hidden 512, 8 layers, "
        f"8 heads / 4 KV heads, mlp 1408), float32; the same weights in both (`save_hf`)",
        f"- {args.prompt_len}-token prompts, {args.new_tokens} new tokens per row, greedy; "
        f"median of {args.repeats} interleaved rounds after a warm-up",
        "- ms/token = wall time of one `generate` call / new tokens per row (prefill included)",
        "- specjax decodes with `layer_layout='auto'` (on CPU the layers scanned with each "
        "layer's weights read in place by its kernels); the scan column is the same run with "
        "`layer_layout='scan'`, the stored layout (XLA:CPU copies each layer's weights out of "
        "the stack every step, docs/design.md)",
        f"- transformers timed with torch's default {result['threads']} thread(s) and with 1; "
        "the ratio uses the faster",
        "",
        "| batch | specjax ms/token | specjax, scan layout "
        f"| transformers ms/token ({result['threads']} thr) "
        "| transformers ms/token (1 thr) | best transformers / specjax "
        "| specjax TTFT ms | specjax TPOT ms | same tokens |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['batch']} | {r['specjax_ms']:.2f} | {r['scan_ms']:.2f} | "
                     f"{r['hf_ms']:.2f} | "
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
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="docs/benchmarks.md",
                        help="markdown file to write the table into ('' = don't write)")
    args = parser.parse_args(argv)
    batch_sizes = comma_list(parser, "--batch-sizes", args.batch_sizes, int, minimum=1)
    at_least_one(parser, args, ("new_tokens", "prompt_len", "repeats"))
    result = run(args.new_tokens, batch_sizes, args.prompt_len, args.repeats)
    command = " ".join(["python -m specjax.bench.decode", *(argv if argv is not None
                                                              else sys.argv[1:])])
    if args.out:
        write_section(Path(args.out), markdown(result, args, command))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
