"""The `specjax` command line.

  specjax run CONFIG.gin [--gin 'binding = value' ...] [--workdir DIR]
  specjax generate [--model DIR] [--prompt TEXT | --ids 1,2,3] [--speculator ngram|draft|none]
      [--ngram-corpus JSONL]
  specjax bench decode [...]
  specjax bench speculative [...]
  specjax bench suite --workdir RUN [...]
  specjax export --format speculators|eagle3|medusa|gguf RUN_OR_HEADS_DIR OUT
      [--target DIR] [--verifier NAME] [--dtype F32|F16|BF16|Q8_0]

Every command takes --compilation-cache DIR|off: where jax's persistent compilation
cache lives (default $SPECJAX_COMPILATION_CACHE, else ~/.cache/specjax/jax; `off`
disables it), so a second run reads its compiled programs back instead of compiling.
Errors in arguments exit non-zero with a one-line message naming the value.
"""

from __future__ import annotations

import argparse
import json
import sys


def _generate(args) -> int:
    import specjax
    from specjax.config import tiny_llama
    from specjax.speculators import DraftModel, NGram
    from specjax.speculators.draft_model import load_vocab

    if args.model:
        model = specjax.load(args.model)
        source = args.model
    else:  # a small random model built on the spot: no download, runs anywhere
        model = specjax.init_model(tiny_llama(vocab_size=256, hidden_size=128, num_layers=4,
                                              intermediate_size=344, num_heads=4,
                                              num_kv_heads=2), seed=args.seed)
        source = f"random tiny Llama ({model.num_params():,} params, seed {args.seed})"
    if args.ids:
        prompts = [[int(x) for x in args.ids.split(",")]]
    elif args.prompt:
        prompts = [args.prompt]
    else:
        prompts = [[1, 2, 3, 4, 5, 6, 7, 8] * 4]
    spec = None
    if args.ngram_corpus and args.speculator != "ngram":
        raise ValueError(f"--ngram-corpus is n-gram's; --speculator is {args.speculator!r}")
    if args.speculator == "ngram":
        spec = NGram(k=args.k)
        if args.ngram_corpus:
            spec = spec.with_corpus_file(args.ngram_corpus, model)
    elif args.speculator == "draft":
        if not args.draft:
            raise ValueError("--speculator draft needs --draft DIR")
        vocab = load_vocab(args.draft_vocab) if args.draft_vocab else None
        spec = DraftModel.create(specjax.load(args.draft), k=args.k, target=model, vocab=vocab)
    print(f"model: {source}")
    common = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                  seed=args.seed, kv_cache_dtype=args.kv_cache_dtype)
    plain = specjax.generate(model, prompts, **common)
    print(f"autoregressive: {plain.stats.summary()}")
    if spec is not None:
        out = specjax.generate(model, prompts, speculator=spec, **common)
        print(f"{args.speculator:>14}: {out.stats.summary()}")
        if args.temperature == 0:
            same = out.tokens == plain.tokens
            print(f"greedy outputs identical: {same}")
            if not same:
                return 1
        plain = out
    for row, toks in enumerate(plain.tokens):
        shown = plain.text[row] if plain.text else toks
        print(f"[{row}] {shown}")
    if args.json:
        print(json.dumps(plain.stats.to_dict()))
    return 0


def _run(args) -> int:
    """`specjax run CONFIG.gin`: any configured experiment (training or evaluation)."""
    import logging

    from specjax.train.run import run_config

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("specjax.train").setLevel(logging.INFO)
    result = run_config(args.config, args.gin, workdir=args.workdir)
    if hasattr(result, "export_dir"):
        print(f"workdir: {result.workdir}\nexport: {result.export_dir}\n"
              f"eval: {result.train.eval}")
    return 0


def _export(args) -> int:
    """`specjax export`: heads or a draft in a format vLLM, SGLang or llama.cpp loads."""
    from specjax.export.from_run import export

    out = export(args.format, args.source, args.out, target=args.target,
                 verifier=args.verifier, dtype=args.dtype)
    print(f"wrote {args.format}: {out}")
    return 0


def _bench(args, rest) -> int:
    if args.what == "decode":
        from specjax.bench import decode
        return decode.main(rest)
    if args.what == "speculative":
        from specjax.bench import speculative
        return speculative.main(rest)
    if args.what == "suite":
        from specjax.bench import suite
        return suite.main(rest)
    raise ValueError(f"unknown benchmark {args.what!r}")


def _cache_option(parser, default=None) -> None:
    parser.add_argument("--compilation-cache", metavar="DIR|off", default=default,
                        help="jax's persistent compilation cache (default: "
                             "$SPECJAX_COMPILATION_CACHE, else ~/.cache/specjax/jax); "
                             "off disables it")


def _parser() -> argparse.ArgumentParser:
    """The command line: the subcommands with their flags and defaults (`bench` passes the
    rest of its arguments on to the benchmark)."""
    parser = argparse.ArgumentParser(prog="specjax", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _cache_option(parser)
    # The option also after the subcommand; SUPPRESS keeps a value given before it.
    common = argparse.ArgumentParser(add_help=False)
    _cache_option(common, default=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate from a model (default: a random tiny one)",
                       parents=[common])
    g.add_argument("--model", help="Hugging Face or orbax directory")
    g.add_argument("--prompt", help="text prompt (needs the model's tokenizer)")
    g.add_argument("--ids", help="comma-separated prompt token ids")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--speculator", choices=["none", "ngram", "draft"], default="ngram")
    g.add_argument("--draft", help="draft model directory for --speculator draft")
    g.add_argument("--draft-vocab", help="trim the draft's LM head to these target ids (a "
                   ".npy file, as the quickstart writes to <workdir>/draft_vocab/vocab.npy)")
    g.add_argument("--k", type=int, default=4)
    g.add_argument("--ngram-corpus", metavar="JSONL", default=None,
                   help="n-gram also drafts from these texts ('text') or token ids ('ids'), "
                        "one JSON object a line, where a row's own tokens hold no match")
    g.add_argument("--kv-cache-dtype", default=None,
                   help="the KV caches (target, draft): a float dtype, or int8 (per-token scales)")
    g.add_argument("--json", action="store_true", help="also print stats as JSON")
    r = sub.add_parser("run", help="run a gin experiment (training or evaluation)",
                       parents=[common])
    r.add_argument("config", help="a .gin file, e.g. configs/experiments/quickstart.gin")
    r.add_argument("--gin", action="append", default=[], metavar="BINDING",
                   help="extra binding, e.g. 'target/trainer.TrainConfig.steps = 10'")
    r.add_argument("--workdir", default=None,
                   help="run directory (default runs/<config name>); re-running resumes")
    e = sub.add_parser("export", parents=[common],
                       help="export heads (speculators, eagle3, medusa) or a draft (gguf)")
    # a plain string: an unknown format is answered by `export` naming the choices
    e.add_argument("--format", required=True, metavar="speculators|eagle3|medusa|gguf")
    e.add_argument("source", metavar="RUN_OR_HEADS_DIR",
                   help="a training run directory, a heads directory or (gguf) a model")
    e.add_argument("out", metavar="OUT", help="output directory (a .gguf file for gguf)")
    e.add_argument("--target", default=None,
                   help="the target model directory (default: the one the run recorded)")
    e.add_argument("--verifier", default=None,
                   help="the target's hub id written into the export (default: --target)")
    e.add_argument("--dtype", default="F32",
                   help="weights: F32, F16 or Q8_0 (gguf); F32, BF16 or F16 (heads)")
    # No -h of its own: `specjax bench suite --help` shows the benchmark's flags.
    b = sub.add_parser("bench", help="benchmarks (scripts, not tests)", add_help=False,
                       parents=[common])
    b.add_argument("what", choices=["decode", "speculative", "suite"])
    return parser


def main(argv=None) -> int:
    """Parses the command line and runs the subcommand; a user error prints one line and
    returns 2."""
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    try:
        if args.command in ("generate", "run", "export") and rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        from specjax import compile_cache

        compile_cache.enable(args.compilation_cache)
        if args.command == "generate":
            return _generate(args)
        if args.command == "run":
            if args.workdir is None:
                from pathlib import Path
                args.workdir = str(Path("runs") / Path(args.config).stem)
            return _run(args)
        if args.command == "export":
            return _export(args)
        return _bench(args, rest)
    except (ValueError, FileNotFoundError, KeyError, NameError) as e:
        print(f"specjax: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
