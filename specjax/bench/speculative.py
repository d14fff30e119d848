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
import jax.numpy as jnp
import numpy as np

import specjax
from specjax.config import ModelConfig
from specjax.stats import leviathan_speedup

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


def measured_cost_ratio(target: specjax.Model, draft: specjax.Model, repeats: int = 20) -> float:
    """Wall time of one single-token draft forward / one target forward (batch 1, T=1)."""
    from specjax.model import decode_params

    def one(model):
        fwd = jax.jit(lambda p, t: specjax.step(model.config, p, None, t, t * 0)[0])
        tok = jnp.zeros((1, 1), jnp.int32)
        params = decode_params(model.config, model.params)  # the layout generate uses
        return _time(lambda: fwd(params, tok).block_until_ready(), repeats)[0]
    return one(draft) / one(target)


def run_specjax(target, prompts, new, speculators: dict, repeats: int) -> list[dict]:
    rows = []
    base_tps = None
    for name, spec in speculators.items():
        def gen(spec=spec):
            return specjax.generate(target, prompts, max_new_tokens=new, ignore_eos=True,
                                    speculator=spec)
        _, out = _time(gen, 1)
        tps = []
        for _ in range(repeats):
            out = gen()
            tps.append(out.stats.tokens_per_s)
        s = out.stats
        row = dict(method=name, alpha=s.acceptance_rate, tau=s.mean_accepted_length,
                   k=s.mean_k, tokens_per_s=statistics.median(tps), ttft_ms=s.ttft_s * 1e3,
                   tpot_ms=s.tpot_s * 1e3, cost_ratio=s.cost_ratio, tokens=out.tokens)
        if base_tps is None:
            base_tps = row["tokens_per_s"]
        row["speedup"] = row["tokens_per_s"] / base_tps
        row["analytical"] = s.expected_speedup
        row["verify_cost"] = s.verify_cost
        rows.append(row)
    return rows


def run_transformers(target, draft, prompts, new, k: int, repeats: int) -> list[dict]:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        specjax.save_hf(target, Path(tmp) / "target")
        hf_t = LlamaForCausalLM.from_pretrained(Path(tmp) / "target").eval()
        hf_d = None
        if draft is not None:
            specjax.save_hf(draft, Path(tmp) / "draft")
            hf_d = LlamaForCausalLM.from_pretrained(Path(tmp) / "draft").eval()
    variants = {"hf generate": {}, "hf prompt_lookup": {"prompt_lookup_num_tokens": k}}
    if hf_d is not None:
        variants["hf assistant_model"] = {"assistant_model": hf_d}
    rows, base = [], None
    for name, extra in variants.items():
        def gen(extra=extra):
            outs = []
            for p in prompts:  # assisted generation is batch-1 only
                ids = torch.tensor([p])
                with torch.no_grad():
                    o = hf_t.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=new, min_new_tokens=new, **extra)
                outs.append(o[0, len(p):].tolist())
            return outs
        t, outs = _time(gen, repeats)
        tps = len(prompts) * new / t
        base = base or tps
        rows.append(dict(method=name, tokens_per_s=tps, speedup=tps / base, tokens=outs))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="specjax bench speculative", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="target model directory (default: random 25M Llama)")
    ap.add_argument("--draft", help="draft model directory")
    ap.add_argument("--medusa", help="Medusa heads directory (train.jobs.heads output)")
    ap.add_argument("--eagle", help="EAGLE head directory (train.jobs.heads output)")
    ap.add_argument("--workdir", help="a quickstart run directory: all of the above")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--batch", type=int, default=1, help="prompts (when generated)")
    ap.add_argument("--prompts", help="JSON lines of token-id lists")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hf", action="store_true", help="also time transformers on the same weights")
    ap.add_argument("--out", help="write results as JSON")
    args = ap.parse_args(argv)
    from specjax.speculators import DraftModel, Eagle, Medusa, NGram

    if args.workdir:
        w = Path(args.workdir)
        args.target = args.target or str(w / "target" / "export")
        args.draft = args.draft or str(w / "draft" / "export")
        args.medusa = args.medusa or str(w / "medusa" / "heads")
        args.eagle = args.eagle or str(w / "eagle" / "heads")
    target = specjax.load(args.target) if args.target else specjax.init_model(BENCH_25M, 0)
    draft = specjax.load(args.draft) if args.draft else None
    prompts = _prompts(args, target.config.vocab_size)
    specs = {"autoregressive": None, "ngram": NGram(k=args.k)}
    if draft is not None:
        specs["draft"] = DraftModel(model=draft, k=args.k, target=target)
    if args.medusa:
        specs["medusa"] = Medusa(heads=args.medusa, target=target)
    if args.eagle:
        specs["eagle"] = Eagle(heads=args.eagle, target=target, top_k=4, depth=4,
                               total_tokens=16)
    rows = run_specjax(target, prompts, args.new, specs, args.repeats)
    if draft is not None:
        c = measured_cost_ratio(target, draft)
        for r in rows:
            if r["method"] == "draft":
                r["cost_ratio_measured"] = c
                r["analytical"] = leviathan_speedup(r["alpha"], r["k"], c, r["verify_cost"])
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
