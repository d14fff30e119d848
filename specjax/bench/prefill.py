"""Prompt processing: the time to the first token for prompts of several lengths, specjax
beside llama.cpp on the same weights, batch 1.

specjax: `generate(..., max_new_tokens=1).stats.ttft_s`, the prefill program alone
(compiled in a warm-up call first), over `--batch` copies of the prompt; with `--ngram`
also the prefill of a speculative call (`NGram(k=4)`, `adaptive=False`), which carries
the speculator's state through the prompt. llama.cpp (with `--llamacpp`): llama-cpp-python's
`Llama.eval(prompt)` from an empty KV cache, on a GGUF of the same weights (`write`: one
written with `specjax.save_gguf` into a temporary directory, F32, or BF16 with `--dtype
bfloat16`), `--threads` threads and
a batch of 512 tokens. Interleaved rounds (`timing.side_by_side`), medians. Prompts: the
first N tokens of the standard library's `argparse.py` (`bench.prompts.source_ids`).

  python -m specjax.bench.prefill [--target CKPT] [--tokens 128,512,2048] [--repeats 3]
      [--batch 1] [--ngram] [--llamacpp GGUF|write] [--threads 2] [--dtype float32]
      [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from specjax.bench.target import GGUF_TYPES
from specjax.cli_args import at_least_one, comma_list


def specjax_ttft(model, ids: list[int], batch: int = 1, speculator=None):
    """A call that returns the prefill's seconds for `batch` rows of `ids` (the prefill
    program alone; with `speculator`, the speculative call's, drafting at every step)."""
    import specjax

    kw = dict(speculator=speculator, adaptive=False) if speculator is not None else {}

    def run() -> float:
        out = specjax.generate(model, [ids] * batch, max_new_tokens=1, ignore_eos=True, **kw)
        return out.stats.ttft_s
    return run


def llamacpp_eval(llm, ids: list[int]):
    """A call that returns llama.cpp's seconds to evaluate `ids` from an empty cache."""
    def run() -> float:
        llm.reset()
        t = time.perf_counter()
        llm.eval(list(ids))
        return time.perf_counter() - t
    return run


def measure(passes: dict, repeats: int) -> dict[str, float]:
    """{name: median seconds}: one untimed warm-up of each pass, then `repeats`
    interleaved rounds."""
    from specjax.timing import side_by_side

    for run in passes.values():
        run()
    return {name: statistics.median(got) for name, got in side_by_side(passes, repeats).items()}


def table(rows: list[dict]) -> str:
    peer = any("llamacpp_ms" in r for r in rows)
    ngram = any("ngram_ms" in r for r in rows)
    head = "| prompt tokens | specjax ms | specjax tokens/s |"
    rule = "|---:|---:|---:|"
    if ngram:
        head += " specjax n-gram ms |"
        rule += "---:|"
    if peer:
        head += " llama.cpp ms | specjax / llama.cpp speed |"
        rule += "---:|---:|"
    lines = [head, rule]
    for r in rows:
        line = (f"| {r['tokens']} | {r['specjax_ms']:.0f} | "
                f"{r['tokens'] * r['batch'] / r['specjax_ms'] * 1e3:.0f} |")
        if ngram:
            line += f" {r['ngram_ms']:.0f} |"
        if peer:
            line += f" {r['llamacpp_ms']:.0f} | {r['llamacpp_ms'] / r['specjax_ms']:.2f}× |"
        lines.append(line)
    return "\n".join(lines)


def _parse(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m specjax.bench.prefill", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="anything specjax.load reads (default: "
                    "the packaged SmolLM2-135M-Instruct)")
    ap.add_argument("--tokens", default="128,512,2048", help="prompt lengths")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1, help="rows per specjax call")
    ap.add_argument("--ngram", action="store_true",
                    help="also time a speculative call's prefill (NGram(k=4))")
    ap.add_argument("--llamacpp", default=None, metavar="GGUF|write",
                    help="also time llama.cpp on this F32 GGUF of the same weights")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    ap.add_argument("--dtype", default="float32", choices=sorted(GGUF_TYPES),
                    help="the target's weights and compute")
    ap.add_argument("--json", default="", help="write the rows here")
    args = ap.parse_args(argv)
    at_least_one(ap, args, ("repeats", "threads", "batch"))
    args.tokens = comma_list(ap, "--tokens", args.tokens, int, minimum=1)
    return args


def main(argv=None) -> int:
    import specjax
    from specjax.bench.prompts import source_ids
    from specjax.bench.target import load_target
    from specjax.speculators.ngram import NGram

    args = _parse(argv)
    model = load_target(args.target, args.dtype)
    limit = model.config.max_position_embeddings
    if max(args.tokens) + 1 > limit:
        raise SystemExit(f"--tokens: {max(args.tokens)} tokens and one new one exceed the "
                         f"model's {limit} positions")
    prompts = {n: source_ids(model.tokenizer, model.config.vocab_size, n)
               for n in args.tokens}
    llm = None
    with tempfile.TemporaryDirectory() as tmp:
        if args.llamacpp is not None:
            from specjax.bench import llamacpp as lc

            kind = GGUF_TYPES[args.dtype]
            gguf = (specjax.save_gguf(model, Path(tmp) / f"target-{kind}.gguf", dtype=kind)
                    if args.llamacpp == "write" else Path(args.llamacpp))
            llm = lc.open_llama(gguf, n_ctx=lc.context_size(list(prompts.values()), new=1),
                                threads=args.threads, n_batch=512, seed=0)
        rows = []
        try:
            for n, ids in prompts.items():
                passes = {"specjax": specjax_ttft(model, ids, args.batch)}
                if args.ngram:
                    passes["ngram"] = specjax_ttft(model, ids, args.batch, NGram(k=4))
                if llm is not None:
                    passes["llamacpp"] = llamacpp_eval(llm, ids)
                got = measure(passes, args.repeats)
                rows.append({"tokens": n, "batch": args.batch,
                             **{f"{k}_ms": v * 1e3 for k, v in got.items()}})
                print(table(rows[-1:]).splitlines()[-1], flush=True)
        finally:
            if llm is not None:
                llm.close()
    print(f"time to the first token, specjax at batch {args.batch}, medians of "
          f"{args.repeats} interleaved rounds")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
