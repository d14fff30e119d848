"""The `specjax` command line.

  specjax run CONFIG.gin [--gin 'binding = value' ...] [--workdir DIR]
  specjax generate [--model PATH | --workdir RUN] [--prompt TEXT | --ids 1,2,3]
      [--speculator none|ngram|draft|eagle|medusa] [--heads DIR] [--tree TOP_K,DEPTH,NODES]
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
import sys

from specjax import cli_generate


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
    cli_generate.add_arguments(g)
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
            return cli_generate.main(args)
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
