"""Speculative decoding benchmark: every method on the same target and prompts, one run.

  python -m specjax.bench.speculative [--target DIR] [--draft DIR] [--medusa DIR]
      [--eagle DIR] [--workdir QUICKSTART_RUN] [--k 4] [--new 64] [--prompts FILE]
      [--hf] [--out FILE.json]

`--workdir runs/quickstart` takes the target, draft, Medusa and EAGLE heads that the
quickstart trained.

Prints, per method, α, τ, tokens/s, the measured speedup over autoregressive decoding
in the same run, and Leviathan's analytical expectation from α, k and the draft/target
cost ratio (measured here from one draft call and one target call). With `--hf`, the
same weights (exported with `specjax.save_hf`) also run through transformers'
`generate`, assisted generation (`assistant_model`) and prompt lookup
(`prompt_lookup_num_tokens`), batch 1, greedy. Without `--target` a random ~25M
Llama is built: its α says nothing about real drafts, only about the machinery.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

import specjax
from specjax.calibrate import measured_cost_ratios
from specjax.config import ModelConfig
from specjax.passes import generate_calls, merge_pass

BENCH_25M = ModelConfig(vocab_size=8192, hidden_size=512, intermediate_size=1408,
                        num_layers=8, num_heads=8, num_kv_heads=4, max_position_embeddings=2048)


def _prompts(args, vocab: int) -> list[list[int]]:
    if args.prompts:
        return [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line]
    rng = np.random.default_rng(0)
    # Code-like prompts: a random block repeated with edits, so prompt lookup has material.
    out = []
    for i in range(args.batch):
        block = rng.integers(0, vocab, 16).tolist()
        out.append((block + rng.integers(0, vocab, 4).tolist()) * 3)
    return out


def _time(fn, repeats: int) -> tuple[float, object]:
    fn()  # warm-up (compiles)
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def specjax_pass(target: specjax.Model, speculator, prompts: list[list[int]], *, new: int,
                 batch: int, temperature: float = 0.0, seed: int = 0, adaptive: bool = True,
                 cost_ratio: float | None = None, calibration=None, kv_cache_dtype=None,
                 verification: str | None = None):
    """`prompts` through `specjax.generate` in consecutive batches of `batch` rows, exactly
    `new` tokens each: (tokens per prompt, stats merged over the calls, wall seconds of
    the calls without compilation); `specjax.passes.generate_calls` says what each
    argument does."""
    return merge_pass([call() for call in generate_calls(
        target, speculator, prompts, new=new, batch=batch, temperature=temperature,
        seed=seed, adaptive=adaptive, cost_ratio=cost_ratio, calibration=calibration,
        kv_cache_dtype=kv_cache_dtype, verification=verification)])


def run_specjax(target, prompts, new, speculators: dict, repeats: int,
                cost_ratios: dict | None = None) -> list[dict]:
    """cost_ratios: measured draft/target cost per method name (the adaptive rule and the
    analytical speedup use it); methods not named use their parameter-count estimate."""
    rows = []
    base_tps = None
    cost_ratios = cost_ratios or {}
    for name, spec in speculators.items():
        def gen(spec=spec, c=cost_ratios.get(name)):
            return specjax_pass(target, spec, prompts, new=new, batch=len(prompts),
                                cost_ratio=c)
        _, out = _time(gen, 1)
        tps = []
        for _ in range(repeats):
            out = gen()
            tps.append(out[1].tokens_per_s)
        tokens, s, _ = out
        row = dict(method=name, alpha=s.acceptance_rate, tau=s.mean_accepted_length,
                   k=s.mean_k, tokens_per_s=statistics.median(tps), ttft_ms=s.ttft_s * 1e3,
                   tpot_ms=s.tpot_s * 1e3, cost_ratio=s.cost_ratio, tokens=tokens)
        if base_tps is None:
            base_tps = row["tokens_per_s"]
        row["speedup"] = row["tokens_per_s"] / base_tps
        row["analytical"] = s.expected_speedup
        row["verify_cost"] = s.verify_cost
        rows.append(row)
    return rows


def load_hf(model: specjax.Model):
    """`model`'s weights in transformers' class for its architecture (`LlamaForCausalLM`,
    `Qwen3ForCausalLM`, ...; in the model's dtype), exported with `specjax.save_hf`; it
    generates exactly `max_new_tokens` (no stop at EOS, as specjax's `ignore_eos=True`)."""
    import torch
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        specjax.save_hf(model, tmp)
        hf = AutoModelForCausalLM.from_pretrained(
            tmp, dtype=getattr(torch, model.config.dtype)).eval()
    hf.generation_config.eos_token_id = None
    return hf


def hf_variants(hf_draft, k: int) -> dict[str, dict]:
    """transformers' `generate` arguments per method: plain, prompt lookup (k tokens) and,
    with a draft, assisted generation (its default number of assistant tokens)."""
    variants = {"hf_generate": {}, "hf_prompt_lookup": {"prompt_lookup_num_tokens": k}}
    if hf_draft is not None:
        variants["hf_assistant"] = {"assistant_model": hf_draft}
    return variants


def hf_pass(hf, prompts: list[list[int]], *, new: int, temperature: float = 0.0,
            seed: int = 0, **extra) -> tuple[list[list[int]], float]:
    """transformers' `generate` prompt by prompt (assisted generation and prompt lookup
    are batch 1 only), exactly `new` tokens each, sampling at `temperature` with no
    top-k/top-p (like specjax): (tokens per prompt, wall seconds)."""
    import torch

    torch.manual_seed(seed)
    sampling = (dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
                if temperature > 0 else dict(do_sample=False))
    outs = []
    t0 = time.perf_counter()
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            o = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                            **sampling, **extra)
        outs.append(o[0, len(p):].tolist())
    return outs, time.perf_counter() - t0


def run_transformers(target, draft, prompts, new, k: int, repeats: int) -> list[dict]:
    hf_t = load_hf(target)
    hf_d = load_hf(draft) if draft is not None else None
    rows, base = [], None
    for name, extra in hf_variants(hf_d, k).items():
        t, (outs, _) = _time(lambda extra=extra: hf_pass(hf_t, prompts, new=new, **extra),
                             repeats)
        tps = len(prompts) * new / t
        base = base or tps
        rows.append(dict(method=name, tokens_per_s=tps, speedup=tps / base, tokens=outs))
    return rows


def workdir_paths(workdir: str | Path) -> dict[str, Path]:
    """Where a quickstart run directory keeps what the benchmarks load. `eagle` is
    eagle/heads, or the quickstart's EAGLE-3 head in eagle3/heads when only that exists;
    `draft_vocab` the draft's trimmed vocabulary (absent where the draft keeps them all)."""
    w = Path(workdir)
    eagle = w / "eagle" / "heads"
    if not eagle.exists() and (w / "eagle3" / "heads").exists():
        eagle = w / "eagle3" / "heads"
    return {"target": w / "target" / "export", "draft": w / "draft" / "export",
            "draft_vocab": w / "draft_vocab" / "vocab.npy",
            "medusa": w / "medusa" / "heads", "eagle": eagle}


def build_speculators(target: specjax.Model, *, draft: specjax.Model | None = None,
                      medusa=None, eagle=None, k: int = 4,
                      eagle_tree: tuple[int, int, int] = (4, 4, 16),
                      draft_vocab=None) -> dict:
    """Every method that has what it needs, by name ("autoregressive" is None): n-gram and
    draft chains of k, Medusa's default tree cut to its heads, an EAGLE-2 dynamic tree
    of `eagle_tree` (top_k, depth, total_tokens) and n-gram's chain in that tree where
    lookup matches (`ngram_eagle`); heads are directories. draft_vocab: a
    `vocab.npy` the draft is trimmed to, used where that file exists."""
    from specjax.speculators import DraftModel, Hybrid, NGram, head_speculator
    from specjax.speculators.draft_model import load_vocab

    specs = {"autoregressive": None, "ngram": NGram(k=k)}
    if draft is not None:
        vocab = load_vocab(draft_vocab) if draft_vocab and Path(draft_vocab).exists() else None
        specs["draft"] = DraftModel.create(draft, k=k, target=target, vocab=vocab)
    for name, heads in (("medusa", medusa), ("eagle", eagle)):
        if heads:
            specs[name] = head_speculator(heads, target, eagle_tree)
    if eagle:
        specs["ngram_eagle"] = Hybrid.of(specs["eagle"], k)
    return specs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="specjax bench speculative", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="target model directory (default: random 25M Llama)")
    ap.add_argument("--draft", help="draft model directory")
    ap.add_argument("--draft-vocab", help="the draft's trimmed vocabulary (vocab.npy)")
    ap.add_argument("--medusa", help="Medusa heads directory (specjax.train.jobs.heads output)")
    ap.add_argument("--eagle", help="EAGLE head directory (specjax.train.jobs.heads output)")
    ap.add_argument("--workdir", help="a quickstart run directory: all of the above")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--batch", type=int, default=1, help="prompts (when generated)")
    ap.add_argument("--prompts", help="JSON lines of token-id lists")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hf", action="store_true", help="also time transformers on the same weights")
    ap.add_argument("--out", help="write results as JSON")
    args = ap.parse_args(argv)
    if args.workdir:
        for name, path in workdir_paths(args.workdir).items():
            setattr(args, name, getattr(args, name) or str(path))
    target = specjax.load(args.target) if args.target else specjax.init_model(BENCH_25M, 0)
    draft = specjax.load(args.draft) if args.draft else None
    prompts = _prompts(args, target.config.vocab_size)
    specs = build_speculators(target, draft=draft, medusa=args.medusa, eagle=args.eagle,
                              k=args.k, draft_vocab=args.draft_vocab)
    costs = measured_cost_ratios(target, specs)[0.0]  # run_specjax decodes greedily
    rows = run_specjax(target, prompts, args.new, specs, args.repeats, costs)
    ref = rows[0]["tokens"]
    for r in rows:
        r["identical_to_greedy"] = r["tokens"] == ref
    hf_rows = run_transformers(target, draft, prompts, args.new, args.k, args.repeats) \
        if args.hf else []
    print(f"# {time.strftime('%Y-%m-%d')} {platform.machine()} {jax.devices()[0].device_kind}; "
          f"jax {jax.__version__}; target {target.num_params():,} params; "
          f"{len(prompts)} prompts × {args.new} tokens")
    print("| method | α | τ | tokens/s | speedup (measured) | speedup (analytical) | identical |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['alpha']:.3f} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | "
              f"{r['speedup']:.2f}× | {r['analytical']:.2f}× | {r['identical_to_greedy']} |")
    for r in hf_rows:
        same = r["tokens"] == ref
        print(f"| {r['method']} | – | – | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}× "
              f"(vs hf generate) | – | {same} |")
    if args.out:
        strip = lambda rs: [{k: v for k, v in r.items() if k != "tokens"} for r in rs]
        Path(args.out).write_text(json.dumps({"specjax": strip(rows), "transformers":
                                              strip(hf_rows)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
