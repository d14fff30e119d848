"""llama.cpp (through llama-cpp-python) as a peer of specjax on the same weights, batch 1.

  python -m specjax.bench.llamacpp [--target CKPT] [--draft CKPT] [--prompts 4]
      [--new 64] [--repeats 3] [--k 4] [--calibrate 4] [--transformers] [--threads 2]
      [--dtype float32] [--json FILE]

The target (and draft) are loaded in `--dtype` and written as GGUF files of that precision
(F32, or BF16 for bfloat16) with `specjax.save_gguf`, so llama.cpp runs exactly the weights
specjax runs. Methods: `plain` (llama.cpp's decoding), `prompt_lookup`
(llama-cpp-python's `LlamaPromptLookupDecoding(num_pred_tokens=k)` as `Llama(draft_model=)`)
and `draft`: a second `Llama` on the draft's GGUF that greedily drafts k tokens per step behind
llama-cpp-python's `LlamaDraftModel` interface (`GreedyLlamaDraft`). llama-cpp-python exposes
no draft-model speculation of llama.cpp's own (`common/speculative.cpp`), and its
`generate` verifies any draft as it does prompt lookup's: the target samples each position
and keeps the drafted tokens up to the first that differs, which is exact sampling from the
target at any temperature. Timing excludes model loading; every prompt starts from an empty
KV cache (no prefix reuse between calls).

The CLI compares llama.cpp's plain and prompt-lookup decoding (and draft, with --draft) with
specjax's `generate`, plain and with n-gram speculation (`NGram(k)`, its adaptive rule
started from its full-depth acceptance on `--calibrate` other HumanEval prompts), on
HumanEval prompts (and, with --transformers, transformers' generate, plain and with
`prompt_lookup_num_tokens=k`), interleaved, median of the repeats, and counts how many
prompts' greedy tokens agree with specjax's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from specjax.bench.prompts import BENCH_INSTALL
from specjax.bench.target import GGUF_TYPES

METHODS = ("plain", "prompt_lookup", "draft")


class LlamaCppNotInstalled(ImportError):
    """llama-cpp-python is not installed; the message says how to install it."""


def require_llama_cpp():
    """The `llama_cpp` module, or LlamaCppNotInstalled naming the install command."""
    try:
        import llama_cpp
        import llama_cpp.llama_speculative  # noqa: F401
    except ImportError as e:
        raise LlamaCppNotInstalled(
            f"llama.cpp's Python bindings (llama-cpp-python) are not installed ({e}); "
            f"install the bench extra: {BENCH_INSTALL}") from e
    return llama_cpp


def available() -> bool:
    """Whether llama-cpp-python imports."""
    try:
        require_llama_cpp()
    except LlamaCppNotInstalled:
        return False
    return True


def context_size(prompts: Sequence[Sequence[int]], new: int, k: int = 0) -> int:
    """A KV-cache size that holds the longest prompt, `new` tokens and a draft of k, rounded
    up to 256."""
    need = max(len(p) for p in prompts) + new + k + 8
    return -(-need // 256) * 256


def open_llama(path: str | Path, *, n_ctx: int, threads: int, n_batch: int, seed: int,
               draft_model=None):
    """A `llama_cpp.Llama` on the GGUF file at `path` (a clear error when it is missing)."""
    llama_cpp = require_llama_cpp()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    # with a draft model llama-cpp-python keeps every position's logits, but sizes their
    # buffer by the logits_all argument: False gives n_batch rows, and a prompt longer
    # than n_batch fails with a numpy broadcast error. True gives n_ctx rows.
    return llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch,
                           n_threads=threads, n_threads_batch=threads,
                           logits_all=draft_model is not None,
                           verbose=False, seed=seed, draft_model=draft_model)


def greedy_llama_draft(path: str | Path, *, k: int, n_ctx: int, threads: int = 2,
                       n_batch: int = 512):
    """A `llama_cpp.llama_speculative.LlamaDraftModel` drafting k tokens greedily with a second
    `Llama` on the GGUF file `path` (its KV cache kept across calls, rolled back to the part
    of the context it shares with the target's)."""
    from llama_cpp.llama_speculative import LlamaDraftModel

    class GreedyLlamaDraft(LlamaDraftModel):
        def __init__(self):
            self.llm = open_llama(path, n_ctx=n_ctx, threads=threads, n_batch=n_batch, seed=0)
            self.llm._sampler = self.llm._init_sampler(temp=0.0)  # argmax, reused
            self.k = k

        def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
            llm, ids = self.llm, input_ids.tolist()
            room = llm.n_ctx() - len(ids)
            if room <= 1:
                return np.array([], dtype=np.intc)
            # keep the cached prefix the target's context still has, evaluate the rest (at
            # least one token, for the logits to draft from)
            cached = llm.input_ids[:llm.n_tokens].tolist()
            common = 0
            for a, b in zip(cached, ids):
                if a != b:
                    break
                common += 1
            llm.n_tokens = min(common, len(ids) - 1)
            llm.eval(ids[llm.n_tokens:])
            out = []
            for i in range(min(self.k, room - 1)):
                out.append(llm.sample())
                if i + 1 < self.k:
                    llm.eval([out[-1]])
            return np.array(out, dtype=np.intc)

    return GreedyLlamaDraft()


@dataclasses.dataclass
class Runner:
    """One llama.cpp model ready to generate (loaded once): `method` is "plain",
    "prompt_lookup" (k tokens) or "draft" (the GGUF file `draft`, k tokens)."""

    path: str | Path
    method: str = "plain"
    k: int = 4
    draft: str | Path | None = None
    n_ctx: int = 2048
    threads: int = 2
    n_batch: int = 512
    seed: int = 0

    def __post_init__(self):
        llama_cpp = require_llama_cpp()
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r} must be one of {METHODS}")
        if self.method == "draft" and self.draft is None:
            raise ValueError("method='draft' needs the draft's GGUF file (draft=)")
        if self.k < 1:
            raise ValueError(f"k={self.k} must be >= 1")
        if self.method == "prompt_lookup":
            drafter = llama_cpp.llama_speculative.LlamaPromptLookupDecoding(
                num_pred_tokens=self.k)
        elif self.method == "draft":
            drafter = greedy_llama_draft(self.draft, k=self.k, n_ctx=self.n_ctx,
                                         threads=self.threads, n_batch=self.n_batch)
        else:
            drafter = None
        self.llm = open_llama(self.path, n_ctx=self.n_ctx, threads=self.threads,
                          n_batch=self.n_batch, seed=self.seed, draft_model=drafter)
        self._evals = 0
        self.calls = 0  # target forward calls of the last `llamacpp_pass`
        self.first_token_s = 0.0  # the last `generate` call's seconds to its first token
        inner = self.llm.eval

        def counted(tokens):  # target forward calls, for τ
            self._evals += 1
            return inner(tokens)
        self.llm.eval = counted

    def generate(self, prompt: Sequence[int], new: int, *, temperature: float = 0.0,
                 seed: int = 0) -> tuple[list[int], float, int]:
        """Exactly `new` tokens after `prompt` (EOS does not stop), from an empty cache,
        sampling at `temperature` with no top-k/top-p/min-p or penalties (greedy at 0):
        (tokens, wall seconds, target forward calls)."""
        if len(prompt) + new + self.k > self.llm.n_ctx():
            raise ValueError(f"a {len(prompt)}-token prompt and {new} new tokens do not fit "
                             f"n_ctx={self.llm.n_ctx()}")
        self.llm.reset()  # no prefix reuse from the previous call
        self.llm.set_seed(seed)
        self._evals = 0
        out: list[int] = []
        t0 = time.perf_counter()
        for token in self.llm.generate(list(prompt), temp=temperature, top_k=0, top_p=1.0,
                                       min_p=0.0, typical_p=1.0, repeat_penalty=1.0,
                                       reset=True):
            out.append(int(token))
            if len(out) == 1:
                self.first_token_s = time.perf_counter() - t0
            if len(out) == new:
                break
        return out, time.perf_counter() - t0, self._evals

    def close(self) -> None:
        self.llm.close()


def llamacpp_pass(runner: Runner, prompts: list[list[int]], *, new: int,
                  temperature: float = 0.0, seed: int = 0) -> tuple[list[list[int]], float]:
    """`prompts` through llama.cpp one by one (prompt `i` sampled with seed `seed + i`), as
    `speculative.hf_pass` runs transformers: (tokens per prompt, wall seconds)."""
    tokens, wall, calls = [], 0.0, 0
    for i, p in enumerate(prompts):
        out, seconds, n = runner.generate(p, new, temperature=temperature, seed=seed + i)
        tokens.append(out)
        wall += seconds
        calls += n
    runner.calls = calls
    return tokens, wall


def bench(runner: Runner, prompts: list[list[int]], *, new: int, temperature: float = 0.0,
          seed: int = 0, repeats: int = 3) -> dict:
    """One warm-up call, then `repeats` rounds over the prompts: per prompt the median
    tokens/s and ms/token, the tokens (of the last round) and τ (new tokens per target
    forward call; 1 for plain decoding)."""
    runner.generate(prompts[0], min(new, 4), temperature=temperature, seed=seed)
    walls = [[] for _ in prompts]
    tokens, calls = [None] * len(prompts), [0] * len(prompts)
    for _ in range(repeats):
        for i, p in enumerate(prompts):
            tokens[i], wall, calls[i] = runner.generate(p, new, temperature=temperature,
                                                        seed=seed + i)
            walls[i].append(wall)
    med = [statistics.median(w) for w in walls]
    return dict(method=runner.method, tokens=tokens,
                tokens_per_s=[new / m for m in med], ms_per_token=[m / new * 1e3 for m in med],
                tau=new * len(prompts) / sum(calls))


def decode_step_ms(path: str | Path, prompts: list[list[int]], *, new: int,
                   threads: int = 2, temperature: float = 0.0,
                   seed: int = 0) -> tuple[float, list[list[int]]]:
    """llama.cpp's one-token decode step as the suite's plain decoding runs it (one forward
    and llama-cpp-python's sampler chain at `temperature`, greedy at 0): the median over
    prompts of milliseconds per token after the first, and the tokens. What
    `specjax.bench.profile` sets beside specjax's step."""
    if new < 2:
        raise ValueError(f"new={new} must be >= 2: the step is timed after the first token")
    runner = Runner(path, "plain", n_ctx=context_size(prompts, new), threads=threads)
    per, tokens = [], []
    try:
        for i, p in enumerate(prompts):
            out, wall, _ = runner.generate(p, new, temperature=temperature, seed=seed + i)
            per.append((wall - runner.first_token_s) / (new - 1) * 1e3)
            tokens.append(out)
    finally:
        runner.close()
    return statistics.median(per), tokens


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where the token lists differ (None if equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """How many prompts' tokens agree, and where the others first differ."""
    where = [first_difference(a, b) for a, b in zip(ours, theirs)]
    return dict(agree=sum(w is None for w in where), prompts=len(where),
                first_difference=where)


# --- CLI: llama.cpp vs specjax on HumanEval prompts --------------------------------------------


def _parse(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m specjax.bench.llamacpp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="anything specjax.load reads (default: "
                    "the packaged SmolLM2-135M-Instruct)")
    ap.add_argument("--draft", default=None, help="a draft checkpoint: also time `draft`")
    ap.add_argument("--workdir", default=None, help="where the GGUF files go (default: a "
                    "temporary directory)")
    ap.add_argument("--dtype", default="float32", choices=sorted(GGUF_TYPES),
                    help="the weights and compute of specjax's model (and transformers'), "
                    "written for llama.cpp as the GGUF type of the same precision")
    ap.add_argument("--prompts", type=int, default=4, help="HumanEval prompts")
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calibrate", type=int, default=4, help="other HumanEval prompts whose "
                    "full-depth n-gram acceptance starts specjax's adaptive rule "
                    "(generate's acceptance_prior; 0: the default prior)")
    ap.add_argument("--transformers", action="store_true", help="also time transformers' "
                    "generate, plain and with prompt lookup (k tokens), on the same weights")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="", help="write the results here")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    import tempfile

    import specjax
    from specjax.bench.prompts import build_prompts

    args = _parse(argv)
    require_llama_cpp()
    if args.target is None:
        from specjax.checkpoint.packaged import smollm2
        args.target = str(smollm2())
    target = specjax.load(args.target, dtype=args.dtype)
    draft = specjax.load(args.draft, dtype=args.dtype) if args.draft else None
    gguf_type = GGUF_TYPES[args.dtype]
    if args.calibrate < 0:
        raise SystemExit(f"--calibrate={args.calibrate} must be >= 0")
    pool = [p.ids for p in build_prompts("humaneval", (), target.tokenizer,
                                         args.prompts + args.calibrate,
                                         args.max_prompt_tokens, args.seed)]
    prompts, calibration = pool[:args.prompts], pool[args.prompts:]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        path = specjax.save_gguf(target, work / f"target-{gguf_type}.gguf", dtype=gguf_type)
        draft_path = (specjax.save_gguf(draft, work / f"draft-{gguf_type}.gguf", dtype=gguf_type)
                      if draft else None)
        n_ctx = context_size(prompts, args.new, args.k)
        runners = {m: Runner(path, m, k=args.k, draft=draft_path, n_ctx=n_ctx,
                             threads=args.threads, seed=args.seed)
                   for m in METHODS if m != "draft" or draft_path}
        result = _compare(target, runners, prompts, args, calibration)
    print(f"{len(prompts)} HumanEval prompts ({min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens), {args.new} new tokens, batch 1, greedy, "
          f"{args.dtype} weights (llama.cpp: {gguf_type} GGUF), "
          f"median of {args.repeats} interleaved rounds, {args.threads} llama.cpp threads")
    for name, r in result["methods"].items():
        print(f"  {name:<24} {statistics.median(r['ms_per_token']):7.2f} ms/token "
              f"(per prompt {', '.join(f'{x:.2f}' for x in r['ms_per_token'])})"
              + (f"  τ {r['tau']:.2f}" if r.get("tau") else "")
              + (f"  greedy agrees with specjax on {r['agree']}/{r['prompts']} prompts"
                 f" (first difference {r['first_difference']})" if "agree" in r else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def _compare(target, runners: dict, prompts, args, calibration=()) -> dict:
    """specjax generate (batch 1, prompt by prompt) and every runner, interleaved; specjax's
    n-gram rule starts from its acceptance and step overhead on the `calibration`
    prompts."""
    import specjax
    from specjax.bench.speculative import hf_pass, hf_variants, load_hf
    from specjax.calibrate import calibrated_kwargs, calibration as calibrate
    from specjax.speculators import NGram

    ours = {"specjax_generate": None, "specjax_ngram": NGram(k=args.k)}
    cal = calibrate(target, NGram(k=args.k), calibration, new_tokens=args.new)
    hf = load_hf(target) if args.transformers else None
    peers = ({name.replace("hf_", "transformers_"): extra
              for name, extra in hf_variants(None, args.k).items()} if hf is not None else {})

    def spec(p, speculator):
        t0 = time.perf_counter()
        out = specjax.generate(target, [p], max_new_tokens=args.new, ignore_eos=True,
                               speculator=speculator,
                               **calibrated_kwargs(cal, speculator))
        return out.tokens[0], time.perf_counter() - t0

    for p in prompts:  # compiles every prompt shape once
        for speculator in ours.values():
            spec(p, speculator)
    for r in runners.values():
        r.generate(prompts[0], 4)
    for extra in peers.values():
        hf_pass(hf, prompts[:1], new=4, **extra)
    names = [*ours, *peers, *(f"llamacpp_{m}" for m in runners)]
    walls = {n: [[] for _ in prompts] for n in names}
    tokens = {n: [None] * len(prompts) for n in names}
    calls = {n: 0 for n in names}
    for _ in range(args.repeats):
        for i, p in enumerate(prompts):
            for n, speculator in ours.items():
                tokens[n][i], w = spec(p, speculator)
                walls[n][i].append(w)
            for n, extra in peers.items():
                (tokens[n][i],), w = hf_pass(hf, [p], new=args.new, **extra)
                walls[n][i].append(w)
            for m, r in runners.items():
                tokens[f"llamacpp_{m}"][i], w, c = r.generate(p, args.new)
                walls[f"llamacpp_{m}"][i].append(w)
                calls[f"llamacpp_{m}"] += c
    out = {}
    for n in names:
        ms = [statistics.median(w) / args.new * 1e3 for w in walls[n]]
        out[n] = dict(ms_per_token=ms, tokens=tokens[n])
        if n.startswith("llamacpp_"):
            out[n]["tau"] = args.new * len(prompts) * args.repeats / calls[n]
        if n != "specjax_generate":
            out[n].update(agreement(tokens["specjax_generate"], tokens[n]))
    return dict(settings={k: v for k, v in vars(args).items()}, prompt_tokens=[len(p) for p in
                                                                             prompts],
                ngram_prior=cal.prior, ngram_proposal_rate=cal.proposal,
                ngram_step_overhead=cal.overhead, ngram_idle_overhead=cal.idle,
                ngram_prior_tries=cal.tries, methods=out)


if __name__ == "__main__":
    sys.exit(main())
