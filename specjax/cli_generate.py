"""`specjax generate`: one prompt decoded plainly, then with a speculator, from a model
or from a training run (`--workdir`: its target, draft, heads, and the adaptive rule's
calibration from the run's comparison), with greedy identity checked."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

SPECULATORS = ("none", "ngram", "draft", "eagle", "medusa", "ngram_eagle")
HEAD_SPECULATORS = ("eagle", "medusa")  # those that load trained heads (`--heads`)
RESULTS = "results.json"  # the run's comparison, with its calibrations ("priors")
# the target's own continuations a regenerating run writes (`specjax.train.regenerate`),
# its comparison's `ngram_corpus` corpus
REGENERATED = Path("regenerated") / "regenerated.jsonl"
DEFAULT_TREE = (4, 4, 16)  # EAGLE's dynamic tree: top_k, depth, nodes
# flags only some speculators read: given with another, they would be ignored unseen
FLAG_OWNERS = {"ngram_corpus": ("ngram",), "draft": ("draft",), "draft_vocab": ("draft",),
               "heads": ("eagle", "medusa", "ngram_eagle"), "tree": ("eagle", "ngram_eagle")}


def add_arguments(g: argparse.ArgumentParser) -> None:
    """`specjax generate`'s flags."""
    g.add_argument("--model", help="a Hugging Face or orbax directory, a .gguf file (or a "
                   "directory holding one) or a hub id in the local cache (default: a "
                   "random tiny Llama; with --workdir, the run's target)")
    g.add_argument("--workdir", metavar="RUN", default=None,
                   help="a quickstart or recipe run: its target, draft and heads stand in "
                   "for --model, --draft, --draft-vocab and --heads, its k and tree for "
                   "--k and --tree, and its calibration (results.json) primes the "
                   "adaptive rule")
    g.add_argument("--prompt", help="text prompt (needs the model's tokenizer)")
    g.add_argument("--ids", help="comma-separated prompt token ids")
    g.add_argument("--chat", action="store_true",
                   help="--prompt is a user's message, put in the model's chat template "
                        "(an instruct model answers it)")
    g.add_argument("--system", default=None,
                   help="with --chat: a system message before the user's")
    g.add_argument("--answer-start", default=None, metavar="TEXT",
                   help="with --chat: the answer's first words, which the model continues "
                        "(e.g. an opened code block)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest (0: off)")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the likeliest tokens holding this mass (1: off)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below this fraction of the likeliest's probability "
                        "(0: off)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--speculator", choices=SPECULATORS, default="ngram")
    g.add_argument("--draft", help="draft model directory for --speculator draft")
    g.add_argument("--draft-vocab", help="trim the draft's LM head to these target ids (a "
                   ".npy file, as the quickstart writes to <workdir>/draft_vocab/vocab.npy)")
    g.add_argument("--heads", metavar="DIR", help="the trained heads for --speculator "
                   "eagle, medusa or ngram_eagle (a run's <stage>/heads, e.g. "
                   "runs/quickstart/eagle3/heads); ngram_eagle: n-gram's chain where lookup "
                   "matches, the EAGLE head's tree elsewhere")
    g.add_argument("--tree", metavar="TOP_K,DEPTH,NODES", default=None,
                   help="EAGLE's dynamic tree (default 4,4,16, or the run's)")
    g.add_argument("--k", type=int, default=None,
                   help="n-gram and draft chain length (default 4, or the run's)")
    g.add_argument("--ngram-corpus", metavar="JSONL", default=None,
                   help="n-gram also drafts from these texts ('text') or token ids ('ids'), "
                        "one JSON object a line, where a row's own tokens hold no match "
                        "(a run's regenerated/regenerated.jsonl comes with its calibration)")
    g.add_argument("--kv-cache-dtype", default=None,
                   help="the KV caches (target, draft): a float dtype, or int8 (per-token scales)")
    g.add_argument("--json", action="store_true", help="also print stats as JSON")


@dataclasses.dataclass(frozen=True)
class Run:
    """What a training run directory offers `generate`: paths that exist (else None),
    the comparison's chain length, each head stage's tree and the calibrations."""

    target: Path
    draft: Path | None
    draft_vocab: Path | None
    regenerated: Path | None
    heads: dict  # speculator -> (stage name, its heads directory)
    k: int | None
    trees: dict  # stage name -> (top_k, depth, nodes)
    priors: dict  # temperature ("0.0") -> {method: Calibration fields}

    @classmethod
    def read(cls, workdir: str | Path) -> "Run":
        from specjax.bench.speculative import workdir_paths

        w = Path(workdir)
        paths = workdir_paths(w)  # where a run keeps its exports, vocabulary and heads
        target = paths["target"]
        if not target.is_dir():
            raise FileNotFoundError(f"--workdir {str(w)!r}: no {target.relative_to(w)} "
                                    "(not a quickstart or recipe run, or its target stage "
                                    "has not finished)")
        # speculator -> (its stage's name, the heads), and each such stage's tree
        heads = {spec: (paths[spec].parent.name, paths[spec]) for spec in HEAD_SPECULATORS
                 if paths[spec].is_dir()}
        trees = {stage: tuple(tree) for stage, _ in heads.values()
                 if (tree := _json(w / stage / "DONE.json").get("settings", {}).get(
                     "stage", {}).get("eagle_tree"))}
        results = _json(w / RESULTS)
        return cls(target=target,
                   draft=paths["draft"] if paths["draft"].is_dir() else None,
                   draft_vocab=paths["draft_vocab"] if paths["draft_vocab"].is_file() else None,
                   regenerated=w / REGENERATED if (w / REGENERATED).is_file() else None,
                   heads=heads,
                   k=results.get("settings", {}).get("k"), trees=trees,
                   priors=results.get("priors") or {})


def _json(path: Path) -> dict:
    """The JSON object in `path`; {} where there is no such file."""
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from e


def build(args, model, run: Run | None):
    """(the speculator `args` ask for, or None; the name its calibration has in the run's
    results, or None where the run has none or its settings differ from these)."""
    import specjax
    from specjax.cli_args import parse_tree
    from specjax.speculators import DraftModel, Hybrid, NGram, head_speculator
    from specjax.speculators.draft_model import load_vocab

    name = args.speculator
    for flag, owners in FLAG_OWNERS.items():
        if getattr(args, flag) and name not in owners:
            raise ValueError(f"--{flag.replace('_', '-')} is for --speculator "
                             f"{' or '.join(owners)}; --speculator is {name!r}")
    run_k = run.k if run else None
    k = args.k if args.k is not None else (run_k or 4)
    if k < 1:
        raise ValueError(f"--k={k} must be >= 1")
    as_run = run_k is not None and k == run_k  # the chain the run calibrated
    if name == "none":
        return None, None
    if name == "ngram":
        if not args.ngram_corpus:
            return NGram(k=k), name if as_run else None
        # the run's own continuations are the corpus its comparison calibrated
        own = (run is not None and run.regenerated is not None
               and Path(args.ngram_corpus).resolve() == run.regenerated.resolve())
        spec = NGram(k=k).with_corpus_file(args.ngram_corpus, model)
        return spec, "ngram_corpus" if own and as_run else None
    if name == "draft":
        if args.draft:
            path, vocab_file, as_run = args.draft, args.draft_vocab, False
        elif run and run.draft:  # another vocabulary is another draft than calibrated
            path, vocab_file = run.draft, args.draft_vocab or run.draft_vocab
            as_run = as_run and not args.draft_vocab
        else:
            raise ValueError("--speculator draft needs --draft DIR (or --workdir RUN with "
                             "a draft stage)")
        vocab = load_vocab(vocab_file) if vocab_file else None
        spec = DraftModel.create(specjax.load(path), k=k, target=model, vocab=vocab)
        return spec, name if as_run else None
    kind = "eagle" if name == "ngram_eagle" else name  # the heads it loads
    if args.heads:
        stage, path = None, args.heads
    elif run and kind in run.heads:
        stage, path = run.heads[kind]
    else:
        raise ValueError(f"--speculator {name} needs --heads DIR (a run's <stage>/heads) or "
                         f"--workdir RUN with {kind} heads")
    run_tree = run.trees.get(stage, DEFAULT_TREE) if stage else DEFAULT_TREE
    tree = parse_tree("--tree", args.tree) if args.tree else run_tree
    spec = head_speculator(path, model, tree, kind=kind)
    if name == "ngram_eagle":  # a run's comparison calibrates the head alone
        return Hybrid.of(spec, k), None
    return spec, stage if stage and tree == run_tree else None


def calibration(run: Run | None, method: str | None, temperature: float):
    """The run's `Calibration` of `method` at `temperature`, or None where it has none."""
    from specjax.calibrate import Calibration

    if run is None or method is None:
        return None
    fields = run.priors.get(str(float(temperature)), {}).get(method)
    return Calibration(**fields) if fields else None


def main(args) -> int:
    """Decodes the prompt plainly and with the speculator; prints both summaries, the
    text and, greedy, whether the outputs agree (exit 1 where they do not). The weights
    stay on base pages unless the two calls decode enough tokens to earn back moving
    them to huge pages (`specjax.huge_pages.off_unless_earned`)."""
    from specjax import huge_pages

    calls = 1 if args.speculator == "none" else 2
    with huge_pages.off_unless_earned(calls * max(args.max_new_tokens, 0)):
        return _generate(args)


def _generate(args) -> int:
    """`main`'s work."""
    import specjax
    from specjax.calibrate import calibrated_kwargs
    from specjax.config import tiny_llama

    for flag in ("system", "answer_start"):
        if getattr(args, flag) is not None and not args.chat:
            raise ValueError(f"--{flag.replace('_', '-')} is for --chat")
    if args.chat and (not args.prompt or args.ids):
        raise ValueError("--chat needs --prompt TEXT (the user's message) and no --ids")
    run = Run.read(args.workdir) if args.workdir else None
    if args.model or run:
        source = args.model or str(run.target)
        model = specjax.load(source)
    else:  # a small random model built on the spot: no download, runs anywhere
        model = specjax.init_model(tiny_llama(vocab_size=256, hidden_size=128, num_layers=4,
                                              intermediate_size=344, num_heads=4,
                                              num_kv_heads=2), seed=args.seed)
        source = f"random tiny Llama ({model.num_params():,} params, seed {args.seed})"
    if args.ids:
        try:
            prompts = [[int(x) for x in args.ids.split(",")]]
        except ValueError:
            raise ValueError(f"--ids={args.ids!r} must be comma-separated integers") from None
    elif args.prompt and args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}]
        if args.answer_start is not None:
            messages.append({"role": "assistant", "content": args.answer_start})
        prompts = [specjax.apply_chat_template(
            model, messages, continue_final_message=args.answer_start is not None)]
    elif args.prompt:
        prompts = [args.prompt]
    else:
        prompts = [[1, 2, 3, 4, 5, 6, 7, 8] * 4]
    spec, method = build(args, model, run)
    # the run calibrated its own target with the default KV cache
    as_run = args.model is None and args.kv_cache_dtype is None
    cal = calibration(run, method, args.temperature) if as_run else None
    print(f"model: {source}")
    if run is not None and spec is not None:
        print(f"calibration: {method} at T = {args.temperature:g}, from "
              f"{Path(args.workdir) / RESULTS}" if cal else "calibration: none (the run "
              "has none for these settings); the adaptive rule starts from its defaults")
    common = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                  top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed,
                  kv_cache_dtype=args.kv_cache_dtype)
    plain = specjax.generate(model, prompts, **common)
    print(f"autoregressive: {plain.stats.summary()}")
    if spec is not None:
        out = specjax.generate(model, prompts, speculator=spec, **common,
                               **calibrated_kwargs(cal, spec))
        print(f"{args.speculator:>14}: {out.stats.summary()}")
        if out.stats.speculative_calls == 0:
            print("                (plain decoding's programs: the adaptive rule, from "
                  f"{'the calibration' if cal else 'its default priors'}, expects no gain "
                  "from drafting here)")
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
