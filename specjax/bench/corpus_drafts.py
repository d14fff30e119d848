"""How often the corpus n-gram's drafts are right, by `min_share`, without timing.

The target writes greedy continuations of held-out prompts. Then every generated
position is replayed: the n-gram (`NGram.with_corpus`, built at each `min_share`)
proposes from the tokens so far, as in the decode loop (the row's own match first,
then the corpus, at most `corpus_k` tokens), and the continuation tells how many of
its tokens would be accepted. Per category and `min_share`, the table gives:
- how often a position has an own match, and how often a corpus draft;
- the corpus drafts' acceptance per depth (each depth given the one before);
- tokens per verify cost on the corpus-drafted positions: (1 + accepted) / v(1 + drafted),
  v from this backend's verify-cost model (`default_verify_cost`), no draft call or loop
  upkeep;
- net per 100 positions: the sum of (1 + accepted − v) over them, per 100 positions.

Each position is counted once, whether or not the loop would reach it (an accepted
draft skips the positions it covers), so this ranks settings; the suite times them.

  python -m specjax.bench.corpus_drafts --workdir RUN --corpus FILE|train
      [--categories humaneval,docstring,completion] [--prompts 16] [--prompt-tokens N]
      [--new 64] [--k 4]
      [--corpus-k 2] [--min-shares 0,0.1,0.2,0.3,0.4,0.5] [--seed 2]
"""

from __future__ import annotations

import argparse
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from specjax.cli_args import at_least_one, comma_list


def replay(spec, sequences: Sequence[Sequence[int]], starts: Sequence[int], verify_cost,
           chunk: int = 1024) -> dict:
    """`spec` (an `NGram`) proposing at every position p of each sequence from starts[i]
    on (its tokens [0, p) as the context, p + k <= its length), checked against the
    sequence's own next tokens. Returns positions, own and corpus (draft rates),
    acceptance [k] (the corpus drafts' per depth, None where none reached it),
    tokens_per_cost and net_per_100 (the module docstring)."""
    from specjax.speculators.base import ProposeContext

    k = spec.k
    width = max(len(s) for s in sequences)
    rows, lens, truth = [], [], []
    for seq, start in zip(sequences, starts):
        for p in range(max(start, 1), len(seq) - k + 1):
            rows.append(np.pad(np.asarray(seq[:p], np.int32), (0, width - p)))
            lens.append(p)
            truth.append(np.asarray(seq[p:p + k], np.int32))
    if not rows:
        raise ValueError(f"no position to replay: every sequence is shorter than its start "
                         f"+ k = {k}")
    own_only = spec.replace(corpus=None)  # its peek tells where a row has its own match
    own, drafted, correct = [], [], []
    for i in range(0, len(rows), chunk):
        toks = jnp.asarray(np.stack(rows[i:i + chunk]))
        n = jnp.asarray(lens[i:i + chunk])
        ctx = ProposeContext(toks, n, jnp.ones(n.shape, bool), None, None,
                             jnp.full(n.shape, k, jnp.int32))
        tree, _ = spec.propose(None, ctx, None)
        own.append(np.asarray(own_only.has_draft(None, toks, n)))
        drafted.append(np.asarray(tree.valid).sum(axis=1))
        correct.append(np.asarray(tree.tokens) == np.stack(truth[i:i + chunk]))
    own, drafted, correct = map(np.concatenate, (own, drafted, correct))
    corpus = ~own & (drafted > 0)
    # accepted: the leading drafted tokens the sequence goes on with
    accepted = np.cumprod(correct & (np.arange(k) < drafted[:, None]), axis=1).sum(axis=1)
    reach = [int(np.sum(corpus & (drafted > d) & (accepted >= d))) for d in range(k)]
    hits = [int(np.sum(corpus & (accepted > d))) for d in range(k)]
    v = np.asarray(verify_cost(1 + drafted[corpus]), np.float64)
    gained = 1 + accepted[corpus]
    return dict(positions=len(rows), own=float(own.mean()), corpus=float(corpus.mean()),
                acceptance=[h / r if r else None for h, r in zip(hits, reach)],
                tokens_per_cost=float(gained.sum() / v.sum()) if v.size else None,
                net_per_100=float(100 * (gained - v).sum() / len(rows)))


def markdown(rows: list[dict]) -> str:
    head = ("| category | min_share | own match | corpus draft | corpus acceptance per depth "
            "| tokens per verify cost | net per 100 positions |\n"
            "|---|---:|---:|---:|---|---:|---:|")
    lines = [head]
    for r in rows:
        acc = " / ".join("–" if a is None else f"{a:.2f}" for a in r["acceptance"])
        tpc = "–" if r["tokens_per_cost"] is None else f"{r['tokens_per_cost']:.3f}"
        lines.append(f"| {r['category']} | {r['min_share']:g} | {r['own']:.3f} | "
                     f"{r['corpus']:.3f} | {acc} | {tpc} | {r['net_per_100']:+.1f} |")
    return "\n".join(lines)


def shares_arg(ap, text: str) -> tuple[float, ...]:
    """--min-shares: numbers in [0, 1], comma-separated; `ap.error` naming the flag."""
    out = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            ap.error(f"--min-shares={text!r}: {part!r} is not a number")
        if not 0 <= value <= 1:
            ap.error(f"--min-shares={text!r}: {value:g} is outside [0, 1]")
        out.append(value)
    return tuple(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specjax.bench.corpus_drafts",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True, help="a quickstart or recipe run")
    ap.add_argument("--corpus", required=True, metavar="JSONL|train",
                    help="the corpus file (`NGram.with_corpus_file`), or 'train': the "
                    "training split of the corpus the held-out prompts come from "
                    "(human-written text of their domain, as a REST datastore)")
    ap.add_argument("--categories", default="humaneval,docstring,completion")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per category")
    ap.add_argument("--prompt-tokens", type=int, default=None,
                    help="longest prompt (default: the suite's length for each category)")
    ap.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--corpus-k", type=int, default=2)
    ap.add_argument("--min-shares", default="0,0.1,0.2,0.3,0.4,0.5")
    ap.add_argument("--seed", type=int, default=2, help="which prompts are drawn")
    args = ap.parse_args(argv)
    at_least_one(ap, args, ("prompts", "new", "k", "corpus_k")
                 + (("prompt_tokens",) if args.prompt_tokens is not None else ()))
    shares = shares_arg(ap, args.min_shares)
    from specjax.bench.prompts import ALL_CATEGORIES, build_prompts
    from specjax.bench.suite_args import DEFAULT_LENGTHS
    from specjax.bench.suite_workdir import Workdir

    cats = comma_list(ap, "--categories", args.categories, choices=ALL_CATEGORIES)
    try:
        paths = Workdir.check(args.workdir, [])
    except FileNotFoundError as e:
        ap.error(str(e))
    import specjax
    from specjax.bench.speculative import specjax_pass
    from specjax.corpus import encode_documents
    from specjax.decoding.cost import default_verify_cost
    from specjax.speculators import NGram
    from specjax.speculators.ngram_corpus import read_corpus

    target = specjax.load(paths.target, dtype="float32")
    corpus, _ = paths.corpus()
    try:
        docs = (encode_documents(target.tokenizer, corpus.train) if args.corpus == "train"
                else read_corpus(args.corpus, target.tokenizer))
    except (OSError, ValueError) as e:
        ap.error(f"--corpus: {e}")
    heldout = list(corpus.eval)
    cost = default_verify_cost(target.config)
    specs = {s: NGram(k=args.k, corpus_k=args.corpus_k).with_corpus(
        docs, target.config.vocab_size, min_share=s) for s in shares}
    rows = []
    for cat in cats:
        length = args.prompt_tokens or DEFAULT_LENGTHS[cat]
        try:
            drawn = build_prompts(cat, heldout, target.tokenizer, args.prompts, length,
                                  args.seed)
        except ValueError as e:
            ap.error(str(e))
        prompts = [p.ids for p in drawn]
        out, _, _ = specjax_pass(target, None, prompts, new=args.new, batch=len(prompts))
        seqs = [list(p) + list(t) for p, t in zip(prompts, out)]
        for s, spec in specs.items():
            rows.append(dict(category=cat, min_share=s, **replay(
                spec, seqs, [len(p) for p in prompts], cost)))
    name = f"the training split of {corpus.name}" if args.corpus == "train" else args.corpus
    print(f"corpus: {name}, {len(docs):,} texts, {sum(map(len, docs)):,} tokens; n-gram k = "
          f"{args.k}, corpus_k = {args.corpus_k}; {args.prompts} prompts per category "
          f"(seed {args.seed}), {args.new} greedy tokens each")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
