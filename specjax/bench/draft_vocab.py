"""What trimming a draft model's vocabulary saves and costs, on a quickstart run's draft.

For each size (the training corpus's N most frequent ids, as the quickstart picks them
with `specjax.train.jobs.corpus_vocab`; `all`: the whole vocabulary), on held-out
prompts of each category:
- c: one draft call's measured cost relative to a target step, greedy and sampled
  (`specjax.calibrate.measured_cost_ratio`, which times the two interleaved);
- coverage: the share of the target's own greedy tokens that the vocabulary holds;
- the draft's acceptance per depth at full depth (k drafts every step, adaptive off),
  greedy and at T = 1, τ, and the analytical speedup those imply
  (`GenerationStats.expected_speedup`: c and the verify-cost model).

  python -m specjax.bench.draft_vocab --workdir RUN [--sizes all,16384,8192,4096]
      [--categories humaneval,completion] [--prompts 8] [--prompt-tokens 256] [--k 4]
      [--new 64]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from specjax.cli_args import ALL, at_least_one, comma_list


def sizes_arg(text: str, ap) -> tuple:
    """`all` or integers >= 1, comma-separated; `ap.error` naming the flag otherwise."""
    out = []
    for part in text.split(","):
        if part == ALL:
            out.append(ALL)
            continue
        try:
            value = int(part)
        except ValueError:
            ap.error(f"--sizes={text!r}: {part!r} is neither 'all' nor an integer")
        if value < 1:
            ap.error(f"--sizes={text!r}: {value} must be >= 1")
        out.append(value)
    return tuple(out)


def training_counts(done_file: Path, tokenizer, vocab_size: int) -> np.ndarray:
    """[V] counts of each target id in the run's training documents (its DONE.json's
    corpus settings), counted as the quickstart counts them for its draft vocabulary."""
    from specjax.corpus import CorpusConfig, load_corpus, token_counts

    corpus = json.loads(Path(done_file).read_text())["settings"]["data"]["corpus"]
    return token_counts(load_corpus(CorpusConfig(**corpus)).train, tokenizer, vocab_size)


def measure(target, draft, vocabs: dict, prompts: dict, *, k: int, new: int) -> list[dict]:
    """One row per (size, category, temperature): c, coverage, acceptance, τ, analytical."""
    from specjax.bench.speculative import specjax_pass
    from specjax.calibrate import draft_cost_ratios
    from specjax.speculators import DraftModel

    greedy = {cat: specjax_pass(target, None, ps, new=new, batch=len(ps))[0]
              for cat, ps in prompts.items()}
    rows = []
    for size, ids in vocabs.items():
        spec = DraftModel.create(draft, k=k, target=target, vocab=ids)
        costs = draft_cost_ratios(target, spec, (0.0, 1.0))
        kept = np.ones(target.config.vocab_size, bool) if ids is None else np.isin(
            np.arange(target.config.vocab_size), ids)
        for cat, ps in prompts.items():
            out = np.concatenate([np.asarray(t) for t in greedy[cat]])
            for t, c in costs.items():
                _, s, _ = specjax_pass(target, spec, ps, new=new, batch=len(ps), temperature=t,
                                       adaptive=False, cost_ratio=c)
                rows.append(dict(size=size, category=cat, temperature=t, cost_ratio=c,
                                 coverage=float(kept[out].mean()),
                                 acceptance=s.acceptance_by_position,
                                 tau=s.mean_accepted_length, analytical=s.expected_speedup))
    return rows


def markdown(rows: list[dict]) -> str:
    head = ("| vocabulary | category | T | c | coverage | acceptance per depth | τ | "
            "speedup (analytical) |\n|---|---|---:|---:|---:|---|---:|---:|")
    lines = [head]
    for r in rows:
        acc = " / ".join("–" if a is None else f"{a:.2f}" for a in r["acceptance"])
        size = r["size"] if r["size"] == ALL else f"{r['size']:,}"
        lines.append(f"| {size} | {r['category']} | {r['temperature']:g} | "
                     f"{r['cost_ratio']:.3f} | {r['coverage']:.3f} | {acc} | {r['tau']:.2f} | "
                     f"{r['analytical']:.2f}× |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specjax.bench.draft_vocab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True, help="a quickstart run with a draft")
    ap.add_argument("--sizes", default="all,16384,8192,4096",
                    help="vocabulary sizes ('all': untrimmed)")
    ap.add_argument("--categories", default="humaneval,completion")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per category")
    ap.add_argument("--prompt-tokens", type=int, default=256, help="longest prompt")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    args = ap.parse_args(argv)
    sizes = sizes_arg(args.sizes, ap)
    at_least_one(ap, args, ("prompts", "prompt_tokens", "k", "new"))
    from specjax.bench.prompts import ALL_CATEGORIES
    from specjax.bench.suite_workdir import Workdir

    cats = comma_list(ap, "--categories", args.categories, choices=ALL_CATEGORIES)
    try:
        paths = Workdir.check(args.workdir, ["draft"])
    except FileNotFoundError as e:
        ap.error(str(e))
    import specjax
    from specjax.bench.prompts import build_prompts
    from specjax.heads import build_vocab_map

    target = specjax.load(paths.target, dtype="float32")
    draft = specjax.load(paths.draft, dtype="float32")
    v = target.config.vocab_size
    too_big = [s for s in sizes if s != ALL and s > v]
    if too_big:
        ap.error(f"--sizes: {too_big} exceed the vocabulary ({v:,} ids)")
    counts = training_counts(paths.done, target.tokenizer, v)
    vocabs = {s: None if s == ALL else build_vocab_map(counts, s) for s in sizes}
    docs, _ = paths.heldout_documents()
    prompts = {c: [p.ids for p in build_prompts(c, docs, target.tokenizer, args.prompts,
                                                args.prompt_tokens, 0)] for c in cats}
    rows = measure(target, draft, vocabs, prompts, k=args.k, new=args.new)
    print(f"draft {draft.num_params():,} params, k = {args.k}, {args.prompts} prompts per "
          f"category, {args.new} new tokens, batch {args.prompts}")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
